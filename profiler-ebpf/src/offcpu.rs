//! Off-CPU intervals: the record, the per-thread state the sched and
//! syscall probes share, who ran instead (per-CPU runs) and where a
//! wakeup came from (interrupt nesting, [`waker`] contexts).

use crate::*;

/// A thread of the target was off-CPU from `start_ns` to `end_ns`, at least
/// the configured minimum.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuInterval {
    /// [`EventKind::OffCpu`].
    pub kind: u32,
    /// CPU it came back on.
    pub cpu: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// Stacks at switch-out.
    pub user_stack_id: i32,
    pub kernel_stack_id: i32,
    /// `prev_state` at switch-out: 0 means it was preempted while runnable
    /// (the interval is run-queue wait), anything else means it blocked.
    pub state: u32,
    /// Thread that woke it, 0 when unknown (preempted, or woken by an
    /// interrupt with no task of interest behind it).
    pub waker_tid: u32,
    pub waker_tgid: u32,
    /// Where the wakeup ran ([`waker`]): a task's wakeup (futex_wake, a
    /// pipe write: the system call it was in) or one in interrupt context
    /// (a timer, a device), where the "waker" task is only whoever was
    /// interrupted.
    pub waker_context: i32,
    pub comm: [u8; COMM_LEN],
    pub waker_comm: [u8; COMM_LEN],
    /// When it was woken (0 if not seen): from here to `end_ns` it was
    /// runnable, waiting for a CPU.
    pub woken_ns: u64,
    /// The task that had the CPU while this thread waited for it: the one
    /// whose run overlapped its wait the most, among the last runs on the
    /// CPU it came back on ([`CpuRuns`]); tid 0 is the idle task (the CPU
    /// was idle), or nothing known.
    pub ran_tid: u32,
    pub ran_tgid: u32,
    /// [`ran_flags`] of that task.
    pub ran_flags: u32,
    pub _pad: u32,
    pub ran_comm: [u8; COMM_LEN],
}

/// Bits of [`OffCpuInterval::ran_flags`].
pub mod ran_flags {
    /// A kernel thread (`PF_KTHREAD`): kcompactd, ksoftirqd, a kworker.
    pub const KTHREAD: u32 = 1;
    /// The kernel's `PF_KTHREAD` bit of `task_struct::flags`.
    pub const PF_KTHREAD: u32 = 0x0020_0000;
}

/// Per-thread state of a thread of the target, about its off-CPU
/// intervals. The entry stays for the thread's life and is rewritten in
/// place: a switch costs map lookups, not an insert and a delete (each
/// takes a lock and an LRU node). `start_ns` 0 means on a CPU now.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuStart {
    /// When the current interval began; 0 while the thread runs.
    pub start_ns: u64,
    /// The user registers at the switch-out: the deferred copy checks the
    /// stack pointer is unchanged at the system call's exit, and a thread
    /// still asleep at the end is unwound from them and its memory.
    pub user_ip: u64,
    pub user_sp: u64,
    pub user_bp: u64,
    pub user_stack_id: i32,
    pub kernel_stack_id: i32,
    pub state: u32,
    pub waker_tid: u32,
    pub waker_tgid: u32,
    /// Process of the sleeping thread (the switch-in side cannot read it).
    pub tgid: u32,
    pub waker_context: i32,
    pub waker_user_stack_id: i32,
    pub waker_comm: [u8; COMM_LEN],
    pub woken_ns: u64,
    /// A user stack to copy at the thread's next system call exit: the
    /// stack pointer it must still have then (else it came back another
    /// way); 0: none.
    pub pending_sp: u64,
    /// The waker of the last interval, kept from its switch-in to the
    /// system call's exit (the futex probe reads it there); `tid` 0: none.
    pub last_waker: LastWaker,
    pub last_woken_ns: u64,
    /// The futex wait the thread is in (written at the call's entry, read
    /// at its exit and by the wakeup probe): one entry per thread holds
    /// everything the hot probes need, so each looks it up once.
    pub futex: FutexStart,
    /// When this thread's stack was last copied as a futex waker (see
    /// [`WAKER_COPY_EVERY_NS`]).
    pub waker_copy_ns: u64,
    /// The registers of this thread's last stack copy sent at a system
    /// call exit, and when it was made (0: none). An idle worker goes back
    /// to the same wait, from the same frames, hundreds of times a second:
    /// an exit with the same `ip`, `sp` and `bp` within
    /// `USER_STACK_REPEAT_NS` sends [`stack_for::REPEAT`] instead of a
    /// copy, and userspace gives it that copy's stack.
    pub copy_ip: u64,
    pub copy_sp: u64,
    pub copy_bp: u64,
    pub copy_ns: u64,
    /// Short waits folded since the thread's last [`OffCpuFold`] went out
    /// (`intervals` 0: none).
    pub fold: FoldState,
}

/// Off-CPU intervals are folded when shorter than this (and the rest of
/// [`OffCpuFold`]'s rule holds); 0 folds none (`--offcpu exact`).
pub const DEFAULT_FOLD_UNDER_NS: u64 = 20_000_000;

/// A thread's folded waits go out once the first of them is this old, at
/// its next switch: userspace places their time within this span (and
/// holds a slot back at most this long for them).
pub const FOLD_SPAN_NS: u64 = 100_000_000;

/// Short waits of one thread folded in the kernel since its last
/// [`OffCpuFold`]: see there. Kept in the thread's [`OffCpuStart`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FoldState {
    /// The first folded wait's start and the last one's end.
    pub first_start_ns: u64,
    pub last_end_ns: u64,
    /// Their off-CPU time together, and of it the time they were
    /// runnable after their wakeups (when the wakeup was seen).
    pub offcpu_ns: u64,
    pub runnable_ns: u64,
    /// The user registers every one of them slept at: those of the
    /// thread's last stack copy at a system call exit.
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// How many (0: none pending).
    pub intervals: u32,
    /// The wait system call they slept in.
    pub syscall_nr: i32,
    /// Their sleep state (`prev_state` at the switch-out).
    pub state: u32,
    pub _pad: u32,
}

impl FoldState {
    /// Nothing folded.
    pub const EMPTY: Self = Self {
        first_start_ns: 0,
        last_end_ns: 0,
        offcpu_ns: 0,
        runnable_ns: 0,
        ip: 0,
        sp: 0,
        bp: 0,
        intervals: 0,
        syscall_nr: 0,
        state: 0,
        _pad: 0,
    };
}

/// Off-CPU intervals of one thread, folded in the kernel into one record:
/// each an interruptible sleep in the same wait system call, shorter than
/// the folding bound, at the registers of the thread's last user stack
/// copy at a system call exit (so userspace has its stack already: the
/// copy a [`stack_for::REPEAT`] would stand for), of a thread no detector
/// reads interval by interval (not in the `EXACT_TIDS` map). An idle
/// worker going back to the same wait dozens of times a second costs one
/// record per [`FOLD_SPAN_NS`] instead of an interval and a stack header
/// each time; its off-CPU time is exact (summed here), its waits' order
/// within the span is not kept.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuFold {
    /// [`EventKind::OffCpuFold`].
    pub kind: u32,
    pub cpu: u32,
    /// The first folded wait's start and the last one's end.
    pub first_start_ns: u64,
    pub last_end_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// Their off-CPU time together, and of it the time they were
    /// runnable after their wakeups.
    pub offcpu_ns: u64,
    pub runnable_ns: u64,
    /// How many waits.
    pub intervals: u32,
    /// `KERNEL_STACK_SYSCALL_WAIT - nr`: the wait call's one frame.
    pub kernel_stack_id: i32,
    /// [`USER_STACK_AT_EXIT_COPY`]: the stack of the thread's exit copy
    /// taken at `ip`, `sp`, `bp` (userspace puts its id here).
    pub user_stack_id: i32,
    /// Their sleep state.
    pub state: u32,
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    pub comm: [u8; COMM_LEN],
}

/// Runs kept per CPU in [`CpuRuns`] (a power of two).
pub const CPU_RUNS: usize = 8;

/// Per CPU: the last [`CPU_RUNS`] tasks that ran on it and when (the
/// sched_switch program logs each at its switch-out). When a thread of the
/// target gets the CPU back, the run that overlapped its wait the most is
/// the task that had the CPU instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuRuns {
    /// When the current task got the CPU (0: not seen yet).
    pub since_ns: u64,
    /// Runs logged so far (the next goes at `count % CPU_RUNS`).
    pub count: u64,
    /// Each run's task (a `task_struct` pointer, read only while it is
    /// among the last few on the CPU), start and end.
    pub task: [u64; CPU_RUNS],
    pub from_ns: [u64; CPU_RUNS],
    pub to_ns: [u64; CPU_RUNS],
}

/// A thread of the target has its stack copied as a futex waker at most
/// once in this long. LockContention names the holder from its wakers'
/// stacks; a thread that wakes others hundreds of times a second (a
/// validator's scheduler or fetch stage waking idle workers) is described
/// as well by a sample of them, and each copy costs ~2 us in the waker's
/// wakeup path. The waker's thread is recorded at every wakeup.
pub const WAKER_COPY_EVERY_NS: u64 = 10_000_000;

impl OffCpuStart {
    /// A thread's entry before anything is recorded in it: on a CPU, no
    /// stacks, no waker, no futex wait.
    pub const IDLE: Self = Self {
        start_ns: 0,
        user_ip: 0,
        user_sp: 0,
        user_bp: 0,
        user_stack_id: -1,
        kernel_stack_id: -1,
        state: 0,
        waker_tid: 0,
        waker_tgid: 0,
        tgid: 0,
        waker_context: waker::NOT_TAKEN,
        waker_user_stack_id: -1,
        waker_comm: [0; COMM_LEN],
        woken_ns: 0,
        pending_sp: 0,
        last_waker: LastWaker {
            tid: 0,
            user_stack_id: -1,
            context: waker::NOT_TAKEN,
            _pad: 0,
            comm: [0; COMM_LEN],
        },
        last_woken_ns: 0,
        futex: FutexStart {
            start_ns: 0,
            uaddr: 0,
            op: 0,
            _pad: 0,
        },
        waker_copy_ns: 0,
        copy_ip: 0,
        copy_sp: 0,
        copy_bp: 0,
        copy_ns: 0,
        fold: FoldState::EMPTY,
    };

    /// Every stack id this entry refers to (its own and its waker's).
    pub const fn stack_ids(&self) -> [i32; 3] {
        [self.user_stack_id, self.kernel_stack_id, self.waker_user_stack_id]
    }
}

/// Where a wakeup ran, as `waker_context` of the records: a system call
/// number (>= 0) when a task woke the thread from inside that call, else
/// one of these. Read at the wakeup from per-CPU interrupt nesting (kept by
/// the irq, softirq and hrtimer tracepoints) and the waker's saved user
/// registers: no stack walk (the kernel stack walk it replaced cost ~3.7 us
/// per wakeup on the real validator).
pub mod waker {
    /// Not looked at: the sleep was too short to be reported.
    pub const NOT_TAKEN: i32 = -1;
    /// In an hrtimer callback or the timer softirqs: a timeout or sleep
    /// ran out.
    pub const TIMER: i32 = -2;
    /// In a device interrupt handler.
    pub const HARDIRQ: i32 = -3;
    /// In another softirq (network receive, block completion, tasklets, RCU).
    pub const SOFTIRQ: i32 = -4;
    /// A kernel thread (kworker, ksoftirqd, ...).
    pub const KERNEL_THREAD: i32 = -5;
    /// A task outside any system call (a page fault, an exception).
    pub const TASK: i32 = -6;

    /// Whether the wakeup came from the task that was current (in a
    /// system call or not, a kernel thread included), not from an
    /// interrupt that only found it running.
    #[inline(always)]
    pub const fn is_task(context: i32) -> bool {
        context >= 0 || context == TASK || context == KERNEL_THREAD
    }
}

/// Softirq vectors that run timers (`TIMER_SOFTIRQ`, `HRTIMER_SOFTIRQ`).
pub const TIMER_SOFTIRQS: u32 = (1 << 1) | (1 << 8);

/// Per-CPU interrupt nesting, kept by the irq, softirq and hrtimer
/// tracepoints for the wakeup probe.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct IrqNesting {
    pub hardirq: u32,
    pub softirq: u32,
    pub hrtimer: u32,
    /// Bit mask of the softirq vectors running (nested: one per CPU at a
    /// time in practice).
    pub softirq_vecs: u32,
}
