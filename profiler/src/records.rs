//! The records every stage reads once the kernel's events are decoded
//! and kept: a thread in a stack, an off-CPU interval, and how waits and
//! wakeups are named. Below `aggregate`, `intervals` and `detectors`
//! (they all use these; none of them is used here).

use profiler_ebpf::COMM_LEN;

/// A thread and the stack it was in.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct StackKey {
    pub tgid: u32,
    pub tid: u32,
    pub comm: [u8; COMM_LEN],
    pub user_stack_id: i32,
    pub kernel_stack_id: i32,
}

/// An off-CPU interval as kept for bucketing.
#[derive(Clone, Copy, Debug)]
pub struct Interval {
    pub start_ns: u64,
    pub end_ns: u64,
    pub key: StackKey,
    /// Runnable but waiting for a CPU, not blocked.
    pub preempted: bool,
    /// When a blocked thread was woken (0: not seen); it waited for a CPU
    /// from then to `end_ns`.
    pub woken_ns: u64,
    /// The task that had the CPU until the thread got it back.
    pub ran: Runner,
    /// Not one interval but short waits the kernel folded (see
    /// `profiler_ebpf::OffCpuFold`): the first one's start to the last
    /// one's end, the thread running between them.
    pub folded: Option<Folded>,
}

/// Waits folded into one [`Interval`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Folded {
    pub intervals: u32,
    /// Their off-CPU time together (at most the span).
    pub offcpu_ns: u64,
    /// Of it, runnable after their wakeups.
    pub runnable_ns: u64,
}

impl Interval {
    /// Its off-CPU time: the span, or the folded waits' time.
    pub fn offcpu_ns(&self) -> u64 {
        let span = self.end_ns.saturating_sub(self.start_ns);
        self.folded.map_or(span, |f| f.offcpu_ns.min(span))
    }

    /// The off-CPU time of its part from `a` to `b` (within its span):
    /// folded waits' time is spread evenly over their span.
    pub fn offcpu_between(&self, a: u64, b: u64) -> u64 {
        let (a, b) = (a.max(self.start_ns), b.min(self.end_ns));
        if b <= a {
            return 0;
        }
        match self.folded {
            None => b - a,
            Some(f) => {
                let span = self.end_ns - self.start_ns;
                ((b - a) as u128 * f.offcpu_ns.min(span) as u128 / span as u128) as u64
            }
        }
    }

    /// How long it was runnable but not running: all of it when it was
    /// preempted, from its wakeup on when it blocked (0 if the wakeup was
    /// not seen).
    pub fn runnable_ns(&self) -> u64 {
        if let Some(f) = self.folded {
            return f.runnable_ns;
        }
        if self.preempted {
            self.end_ns.saturating_sub(self.start_ns)
        } else if self.woken_ns != 0 {
            self.end_ns.saturating_sub(self.woken_ns.max(self.start_ns))
        } else {
            0
        }
    }
}

/// The task that ran on a CPU until a waiting thread got it back.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub struct Runner {
    /// 0: the idle task (the CPU was idle), or not known.
    pub tid: u32,
    pub tgid: u32,
    pub comm: [u8; COMM_LEN],
    /// A kernel thread (kcompactd, ksoftirqd, a kworker).
    pub kthread: bool,
}

impl Runner {
    pub fn of(o: &profiler_ebpf::OffCpuInterval) -> Self {
        Self {
            tid: o.ran_tid,
            tgid: o.ran_tgid,
            comm: o.ran_comm,
            kthread: o.ran_flags & profiler_ebpf::ran_flags::KTHREAD != 0,
        }
    }
}

/// The kernel part of an off-CPU stack that began in an interruptible
/// sleep inside a waiting system call (`profiler_ebpf::WAIT_SYSCALLS`):
/// not walked, one frame names the call. Names carry what the gap
/// detector's cause classification looks for ("nanosleep", "poll",
/// "select").
pub fn syscall_wait_frame(nr: i32) -> String {
    match crate::kernel::syscalls::name(nr) {
        Some(name) => format!("[{name} wait: kernel path not walked]_[k]"),
        None => format!("[syscall {nr} wait: kernel path not walked]_[k]"),
    }
}

/// Whether a wakeup in `context` came from the task that was current (not
/// from an interrupt that only found it running).
pub fn waker_is_task(context: i32) -> bool {
    use profiler_ebpf::waker;
    context == waker::NOT_TAKEN || waker::is_task(context)
}
