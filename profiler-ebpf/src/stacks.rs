//! Stacks: the stack maps' ids and epochs, the kernel and user stack
//! records (headers and the bytes after them), the ids that say where an
//! event's stack is instead of a map entry, and the wait system calls
//! whose kernel stack is named, not walked.

/// Frames kept per stack by the kernel's stack-trace map (its maximum).
pub const MAX_STACK_DEPTH: usize = 127;

/// Entries in the stack-trace map. A full map makes `bpf_get_stackid` fail,
/// which we count as a lost stack, never as a silent drop.
pub const STACK_MAP_ENTRIES: u32 = 1 << STACK_INDEX_BITS;

/// Bits of a stack id that index the stack map (its 16 Ki entries); the
/// bits above carry the stack epoch (see [`stack_id_with_epoch`]).
pub const STACK_INDEX_BITS: u32 = 14;

/// Stack epochs are counted modulo this many (16 bits: a kernel stack id
/// stays below [`USER_STACK_ID_BASE`]). `slotprof run` starts a new epoch
/// after each slot it processes, so an id names one stack for 2^16 slots
/// (~7 h at 400 ms).
pub const STACK_EPOCH_MASK: u32 = (1 << 16) - 1;

/// Stack ids from here up name user stacks unwound in userspace (from
/// copies of the stack); below it, the kernel's stack maps.
pub const USER_STACK_ID_BASE: i32 = 1 << 30;

/// The id userspace sees for entry `index` of the stack map of `epoch`:
/// even epochs use `STACKS`, odd ones `STACKS_ODD`, and each map is emptied
/// before its next epoch begins. With the epoch in the id, an id read after
/// its map was emptied resolves to nothing, never to another stack.
pub const fn stack_id_with_epoch(index: u32, epoch: u32) -> i32 {
    (index | ((epoch & STACK_EPOCH_MASK) << STACK_INDEX_BITS)) as i32
}

/// (epoch, index in that epoch's map) of a non-negative stack id.
pub const fn split_stack_id(id: i32) -> (u32, u32) {
    let id = id as u32;
    (id >> STACK_INDEX_BITS, id & ((1 << STACK_INDEX_BITS) - 1))
}

/// Most uretprobe returns pending per thread that stack copies are mended
/// for.
pub const PENDING_RETURNS: usize = 8;

/// The calls of a thread with a uretprobe pending (innermost last): where
/// each one's return address is on the stack and what it was before the
/// kernel put its uretprobe trampoline there. A stack copy puts the
/// original back, so that unwinding goes on past the probed function.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingReturns {
    pub n: u32,
    pub _pad: u32,
    /// The stack address of each return address (the stack pointer at the
    /// function's entry).
    pub slot: [u64; PENDING_RETURNS],
    /// The return address itself.
    pub ret: [u64; PENDING_RETURNS],
}

/// An off-CPU interval's kernel stack, walked at its switch-in (a sleeping
/// task's kernel stack does not change until it runs, and only then is the
/// interval known to be long enough to report): `len` bytes of addresses,
/// leaf first, follow this header. The interval record that comes right
/// after it, of the same thread and start, has kernel stack id
/// [`KERNEL_STACK_INLINE`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KernelStackHeader {
    /// [`EventKind::KernelStack`](crate::EventKind::KernelStack).
    pub kind: u32,
    pub tid: u32,
    pub start_ns: u64,
    pub len: u32,
    pub _pad: u32,
}

/// The per-CPU scratch space a kernel stack record is built in.
#[repr(C)]
pub struct KernelStackRecord {
    pub header: KernelStackHeader,
    pub ips: [u64; MAX_STACK_DEPTH],
}

/// Kernel stack id of an off-CPU interval whose kernel stack is the
/// [`KernelStackHeader`] record just before it.
pub const KERNEL_STACK_INLINE: i32 = -10_003;

/// Kernel stack id of an off-CPU interval still open: its stack is walked
/// at the switch-in (userspace reads a thread still asleep at the end from
/// `/proc/PID/task/TID/stack`).
pub const KERNEL_STACK_AT_SWITCH_IN: i32 = -10_004;

/// Most bytes of user stack copied per stack (eight pages; `perf
/// --call-graph dwarf` copies 8 KiB by default). The copy starts at the
/// stack pointer and stops early at the first page that cannot be read,
/// or at the thread's outermost frame once userspace knows where that is
/// (`USER_STACK_TOP`): most copies are a few KiB. 16 KiB left a real
/// validator's replay, banking and RocksDB stacks without their entry
/// (5-7% of its on-CPU samples ended in `[stack copy ended]`).
pub const USER_STACK_BYTES: usize = 32768;

/// Why a [`UserStackHeader`] was taken: whose stack it is.
pub mod stack_for {
    /// A cpu-clock sample (the record before it, of the same thread).
    pub const SAMPLE: u32 = 1;
    /// A system call's exit: for the thread's records marked
    /// [`super::USER_STACK_NEXT`] (an off-CPU interval that began in this
    /// call, a futex wait, a madvise call).
    pub const SYSCALL_EXIT: u32 = 2;
    /// A switch-out outside any system call (a preemption, a page-fault
    /// sleep): for the off-CPU interval that begins at `start_ns`.
    pub const SWITCH_OUT: u32 = 3;
    /// A wakeup of a long futex sleeper by a thread of the target: the
    /// waker's own stack, copied in its context; `start_ns` is the wakeup's
    /// time (the futex record's `waker_woken_ns`).
    pub const WAKER: u32 = 4;
    /// Or'd in: the copy stopped where userspace said the thread's
    /// outermost frame ends (`USER_STACK_TOP`), not at the most we copy.
    pub const BOUNDED: u32 = 1 << 8;
    /// Or'd in, with no stack bytes: the thread is back at the system
    /// call exit it was at in its last copy of this kind, with the same
    /// `ip`, `sp` and `bp`, less than `USER_STACK_REPEAT_NS` after that
    /// copy: its stack is that copy's (see [`OffCpuStart::copy_ip`](crate::OffCpuStart::copy_ip)).
    pub const REPEAT: u32 = 1 << 9;
    /// The reason without the flags.
    pub const MASK: u32 = 0xff;
}

/// A copy of the top of a thread's user stack and the registers to unwind
/// it from; `len` bytes of the stack (from `sp` up) follow this header in
/// the same record. Userspace unwinds it with the modules' CFI.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UserStackHeader {
    /// [`EventKind::UserStack`](crate::EventKind::UserStack).
    pub kind: u32,
    pub cpu: u32,
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Stack bytes after the header (0: the copy failed).
    pub len: u32,
    /// [`stack_for`].
    pub why: u32,
    /// For [`stack_for::SWITCH_OUT`]: the off-CPU interval's start.
    pub start_ns: u64,
}

/// The per-CPU scratch space a user stack record is built in.
#[repr(C)]
pub struct UserStackRecord {
    pub header: UserStackHeader,
    /// A page more than is ever sent: the verifier can then check the
    /// copy loop with a masked offset.
    pub stack: [u8; USER_STACK_BYTES + 4096],
}

/// User stack id of a record whose user stack is the next
/// [`UserStackHeader`] of the same thread (taken right after it, or at the
/// exit of the system call the thread is in).
pub const USER_STACK_NEXT: i32 = -10_001;

/// User stack id of an off-CPU interval whose user stack was copied at its
/// switch-out ([`stack_for::SWITCH_OUT`] with the same start).
pub const USER_STACK_AT_SWITCH_OUT: i32 = -10_002;

/// Waker user stack id of a futex wait whose waker (a thread of the
/// target) had its user stack copied at the wakeup: the
/// [`stack_for::WAKER`] copy of `waker_tid` with `start_ns` equal to the
/// record's `waker_woken_ns`.
pub const USER_STACK_WAKER_COPY: i32 = -10_003;

/// Waker user stack id of a futex wait whose waker (a thread of the
/// target) was not copied: it had been copied less than
/// [`WAKER_COPY_EVERY_NS`](crate::WAKER_COPY_EVERY_NS) before.
pub const USER_STACK_WAKER_SAMPLED_OUT: i32 = -10_004;

/// User stack id of an [`OffCpuFold`](crate::OffCpuFold): the stack of the
/// thread's last copy at a system call exit taken at the record's `ip`,
/// `sp` and `bp`.
pub const USER_STACK_AT_EXIT_COPY: i32 = -10_005;

/// Kernel stack id of an interval that began in an interruptible sleep
/// inside one of [`WAIT_SYSCALLS`]: `KERNEL_STACK_SYSCALL_WAIT - nr`. The
/// kernel path of such a sleep is always that call's wait (ep_poll,
/// do_nanosleep, do_sys_poll, ...), so it is not walked (the walk of a
/// sleeping task's kernel stack cost ~2-3 us here, at every reported
/// interval); one frame names the call. A sleep in another state (an mmap
/// lock, I/O) is walked.
pub const KERNEL_STACK_SYSCALL_WAIT: i32 = -11_000;

/// x86-64 system calls whose interruptible sleep is always the call's own
/// wait: futex, futex_waitv, nanosleep, clock_nanosleep, epoll_wait,
/// epoll_pwait, epoll_pwait2, poll, ppoll, select, pselect6, pause, wait4,
/// waitid, rt_sigtimedwait, rt_sigsuspend.
pub const WAIT_SYSCALLS: [i32; 16] = [
    202, 449, 35, 230, 232, 281, 441, 7, 271, 23, 270, 34, 61, 247, 128, 130,
];

/// Whether `nr` is one of [`WAIT_SYSCALLS`].
#[inline(always)]
pub fn is_wait_syscall(nr: i32) -> bool {
    let mut i = 0;
    while i < WAIT_SYSCALLS.len() {
        if WAIT_SYSCALLS[i] == nr {
            return true;
        }
        i += 1;
    }
    false
}

/// The system call of a [`KERNEL_STACK_SYSCALL_WAIT`] kernel stack id.
pub const fn syscall_wait_nr(id: i32) -> Option<i32> {
    let nr = KERNEL_STACK_SYSCALL_WAIT - id;
    if id <= KERNEL_STACK_SYSCALL_WAIT && nr < 1000 {
        Some(nr)
    } else {
        None
    }
}

/// Task state a thread sleeps in inside a futex wait (TASK_INTERRUPTIBLE,
/// as sched_switch reports it).
pub const TASK_INTERRUPTIBLE: u32 = 1;

/// Whether a task state (`prev_state` of sched_switch, the task's raw
/// `__state`) is an interruptible sleep. The kernel adds flags to it:
/// futex waits and nanosleep sleep in `TASK_INTERRUPTIBLE |
/// TASK_FREEZABLE` (0x2001) since 6.1, so only the two low bits decide
/// (`TASK_KILLABLE` has the uninterruptible bit).
#[inline(always)]
pub const fn sleeps_interruptible(state: u32) -> bool {
    state & 3 == TASK_INTERRUPTIBLE
}

/// Whether a stack id is an error that means a lost stack (map full or hash
/// collision), as opposed to "no stack of this kind" (-EFAULT: no user stack
/// for a kernel thread, no kernel stack for a sample taken in user mode).
pub const fn stack_lost(id: i32) -> bool {
    const EEXIST: i32 = 17;
    const ENOMEM: i32 = 12;
    id == -EEXIST || id == -ENOMEM
}
