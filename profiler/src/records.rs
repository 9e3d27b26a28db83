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
