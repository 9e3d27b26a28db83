//! The records slotprof's eBPF programs write and its userspace reads.
//!
//! Everything here is `#[repr(C)]`, `Copy` and free of pointers, so the same
//! definition compiles for `bpfel-unknown-none` and for the host, and a
//! ring-buffer record can be read with one unaligned copy.
#![no_std]

/// Length of a kernel task name (`comm`), NUL padding included.
pub const COMM_LEN: usize = 16;

/// Frames kept per stack by the kernel's stack-trace map (its maximum).
pub const MAX_STACK_DEPTH: usize = 127;

/// Distinct futex addresses whose short waits are counted in the kernel.
pub const FUTEX_ADDR_ENTRIES: u32 = 4096;

/// Futex ops that wait (low bits of `op`, flags masked off).
pub const fn futex_op_waits(op: u32) -> bool {
    // FUTEX_WAIT 0, FUTEX_LOCK_PI 6, FUTEX_WAIT_BITSET 9,
    // FUTEX_WAIT_REQUEUE_PI 11, FUTEX_LOCK_PI2 13.
    matches!(op & 0x7f, 0 | 6 | 9 | 11 | 13)
}

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

/// Threads that can be off-CPU at once and still be tracked (LRU: the oldest
/// entry, typically a thread that has exited while asleep, goes first).
pub const OFFCPU_MAP_ENTRIES: u32 = 16 * 1024;

/// Ring buffer size in bytes (a power of two, a multiple of the page size).
pub const RING_BYTES: u32 = 4 << 20;

/// First field of every ring-buffer record: which record follows.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// [`CpuSample`].
    CpuSample = 1,
    /// [`OffCpuInterval`].
    OffCpu = 2,
    /// [`SlotMark`].
    SlotMark = 3,
    /// [`MadviseCall`].
    Madvise = 4,
    /// [`FutexWait`].
    FutexWait = 5,
    /// [`LoopMark`].
    LoopMark = 6,
    /// [`UserRegs`].
    UserRegs = 7,
    /// [`HostEvent`].
    Host = 8,
    /// [`UserStackHeader`] and the stack bytes after it.
    UserStack = 9,
    /// [`KernelStackHeader`] and the addresses after it.
    KernelStack = 10,
    /// [`MemStall`].
    MemStall = 11,
    /// [`CacheWork`].
    CacheWork = 12,
}

/// A thread of the target stalled in the kernel's memory management:
/// direct reclaim, its cgroup's reclaim (memory.high / the limit) or
/// direct compaction, from the tracepoints' begin to end.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemStall {
    /// [`EventKind::MemStall`].
    pub kind: u32,
    pub cpu: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// [`mem_stall`]: which.
    pub what: u32,
    pub _pad: u32,
    /// Pages reclaimed (reclaim only).
    pub nr_reclaimed: u64,
    pub comm: [u8; COMM_LEN],
}

/// [`MemStall::what`].
pub mod mem_stall {
    /// vmscan:mm_vmscan_direct_reclaim_begin/end: the allocation found the
    /// system short of free memory and reclaimed itself.
    pub const DIRECT_RECLAIM: u32 = 1;
    /// vmscan:mm_vmscan_memcg_reclaim_begin/end: over its cgroup's
    /// memory.high or limit, it reclaimed from its cgroup.
    pub const CGROUP_RECLAIM: u32 = 2;
    /// compaction:mm_compaction_begin/end in the thread's own context:
    /// direct compaction for a higher-order allocation.
    pub const DIRECT_COMPACTION: u32 = 3;
}

/// A thread of the target did program-cache work: one call of a probed
/// function of the runtime's program cache (loading, verifying,
/// JIT-compiling or evicting programs), from its entry (uprobe) to its
/// return (uretprobe), outermost calls only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CacheWork {
    /// [`EventKind::CacheWork`].
    pub kind: u32,
    pub cpu: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// [`cache_work`]: which (the uprobe's attach cookie).
    pub what: u32,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
}

/// [`CacheWork::what`], the cookie of each program-cache uprobe.
pub mod cache_work {
    /// Parsing and relocating a program's ELF (`Executable::load`).
    pub const LOAD: u32 = 1;
    /// Verifying its bytecode (`RequisiteVerifier::verify`).
    pub const VERIFY: u32 = 2;
    /// JIT-compiling it (`Executable::jit_compile`).
    pub const JIT: u32 = 3;
    /// Evicting or pruning cache entries.
    pub const EVICT: u32 = 4;
    /// Kinds are below this (the per-thread start map's key has room).
    pub const KINDS: u32 = 5;
}

/// Where a thread's program-cache call began, and how deep it is inside
/// calls of the same kind (per thread and kind).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheWorkStart {
    pub start_ns: u64,
    pub depth: u32,
    pub _pad: u32,
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

/// Where a thread's memory stall began (per-thread map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MemStallStart {
    pub start_ns: u64,
    pub what: u32,
    pub _pad: u32,
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
    /// [`EventKind::KernelStack`].
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
    /// copy: its stack is that copy's (see [`super::OffCpuStart::copy_ip`]).
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
    /// [`EventKind::UserStack`].
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
/// [`WAKER_COPY_EVERY_NS`] before.
pub const USER_STACK_WAKER_SAMPLED_OUT: i32 = -10_004;

/// Words of a tracepoint record a [`HostEvent`] carries (after the 8-byte
/// common header): enough for every field `slotprof host` reads.
pub const HOST_RAW_WORDS: usize = 8;

/// Which tracepoint a [`HostEvent`] came from.
pub mod host_tp {
    /// kvm:kvm_unmap_hva_range (an MMU-notifier invalidation of a VM's memory).
    pub const KVM_UNMAP: u32 = 1;
    /// compaction:mm_compaction_isolate_migratepages.
    pub const COMPACT_ISOLATE: u32 = 2;
    /// compaction:mm_compaction_begin.
    pub const COMPACT_BEGIN: u32 = 3;
    /// compaction:mm_compaction_end.
    pub const COMPACT_END: u32 = 4;
    /// migrate:mm_migrate_pages.
    pub const MIGRATE: u32 = 5;
}

/// A stack walked for one thread and tracepoint is reused for this long
/// (a thread compacting or migrating does so for milliseconds at a time;
/// walking the stack at each of 100k invalidations a second would cost
/// more than everything else together).
pub const HOST_STACK_REUSE_NS: u64 = 10_000_000;

/// A host-side memory event (`slotprof host`, system-wide): which
/// tracepoint, which task was running (kcompactd, a process in direct
/// compaction, a writer of /proc/sys/vm/compact_memory), its kernel stack,
/// and the record's own words, decoded in userspace with this kernel's
/// layout from tracefs (the fields moved between kernel versions).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HostEvent {
    /// [`EventKind::Host`].
    pub kind: u32,
    pub cpu: u32,
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// [`host_tp`].
    pub tracepoint: u32,
    pub kernel_stack_id: i32,
    pub comm: [u8; COMM_LEN],
    /// Bytes 8.. of the tracepoint record.
    pub raw: [u64; HOST_RAW_WORDS],
}

/// When a thread's stack was last walked for one tracepoint, and its id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HostStackCache {
    pub ts_ns: u64,
    pub stack_id: i32,
    pub _pad: u32,
}

/// Registers of a target thread interrupted in user mode by the cpu-clock
/// sample (x86-64 `struct pt_regs` order): what lets userspace work out
/// which memory the sampled instructions touched when there is no PMU.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UserRegs {
    /// [`EventKind::UserRegs`].
    pub kind: u32,
    pub cpu: u32,
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub regs: [u64; PT_REGS_WORDS],
}

/// Words in x86-64 `struct pt_regs`.
pub const PT_REGS_WORDS: usize = 21;

/// Indices into [`UserRegs::regs`] (x86-64 `struct pt_regs`).
pub mod reg {
    pub const R15: usize = 0;
    pub const R14: usize = 1;
    pub const R13: usize = 2;
    pub const R12: usize = 3;
    pub const RBP: usize = 4;
    pub const RBX: usize = 5;
    pub const R11: usize = 6;
    pub const R10: usize = 7;
    pub const R9: usize = 8;
    pub const R8: usize = 9;
    pub const RAX: usize = 10;
    pub const RCX: usize = 11;
    pub const RDX: usize = 12;
    pub const RSI: usize = 13;
    pub const RDI: usize = 14;
    /// The system call number on a system call entry, -1 (or an error
    /// code) on interrupts and exceptions.
    pub const ORIG_RAX: usize = 15;
    pub const RIP: usize = 16;
    pub const CS: usize = 17;
    pub const RSP: usize = 19;
}

/// One madvise(2) call of a thread of the target.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MadviseCall {
    /// [`EventKind::Madvise`].
    pub kind: u32,
    pub cpu: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub len: u64,
    /// MADV_* (4 = DONTNEED, 8 = FREE).
    pub behavior: u32,
    /// User stack at the return from the call (still the caller's stack).
    pub user_stack_id: i32,
    pub ret: i64,
    /// TLB flushes this thread did itself while in the call.
    pub tlb_local: u32,
    /// Shootdown IPIs it sent to other CPUs while in the call.
    pub tlb_ipis: u32,
    pub comm: [u8; COMM_LEN],
}

/// Per-thread state while a target thread is inside madvise.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MadviseStart {
    pub start_ns: u64,
    pub len: u64,
    pub behavior: u32,
    pub tlb_local: u32,
    pub tlb_ipis: u32,
    pub _pad: u32,
}

/// A futex wait of a target thread that lasted at least the minimum
/// (shorter ones are only counted, per address, in the kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FutexWait {
    /// [`EventKind::FutexWait`].
    pub kind: u32,
    pub cpu: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub uaddr: u64,
    pub op: u32,
    /// User stack at the return (the waiter's stack).
    pub user_stack_id: i32,
    pub ret: i64,
    /// The thread that woke it last, 0 if unknown, its user stack at the
    /// wakeup and where the wakeup ran ([`waker`]).
    pub waker_tid: u32,
    pub waker_user_stack_id: i32,
    pub waker_context: i32,
    pub _pad: u32,
    /// When the waker woke it (0 if unknown): with `waker_tid`, the key of
    /// the waker's stack copy ([`USER_STACK_WAKER_COPY`]).
    pub waker_woken_ns: u64,
    pub comm: [u8; COMM_LEN],
    pub waker_comm: [u8; COMM_LEN],
}

/// Per-thread state while a target thread is inside futex(2). The entry
/// stays between calls (rewritten in place: no map insert and delete per
/// call); `start_ns` 0 means not in a futex wait.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FutexStart {
    pub start_ns: u64,
    pub uaddr: u64,
    pub op: u32,
    pub _pad: u32,
}

/// Who last woke a thread (kept from switch-in to its next syscall exit).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LastWaker {
    pub tid: u32,
    pub user_stack_id: i32,
    /// [`waker`] context of the wakeup.
    pub context: i32,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
}

/// Short futex waits, per address: count and total time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FutexTotals {
    pub waits: u64,
    pub wait_ns: u64,
}

/// The target's main loop started an iteration (uprobe on `--loop-symbol`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LoopMark {
    /// [`EventKind::LoopMark`].
    pub kind: u32,
    pub cpu: u32,
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// User page faults this thread has taken so far (from
    /// exceptions:page_fault_user): the difference between two marks is
    /// the faults of one iteration.
    pub page_faults: u64,
}

/// The target called its slot-start function (the uprobe slot source).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SlotMark {
    /// [`EventKind::SlotMark`].
    pub kind: u32,
    pub cpu: u32,
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// The function's first argument (a slot number, for some targets).
    pub arg0: u64,
}

/// One cpu-clock sample of a thread of the target, taken on `cpu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    /// [`EventKind::CpuSample`].
    pub kind: u32,
    pub cpu: u32,
    /// `bpf_ktime_get_ns`, i.e. CLOCK_MONOTONIC.
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    /// Id in the stack-trace map, or a negative errno (see [`stack_lost`]).
    pub user_stack_id: i32,
    pub kernel_stack_id: i32,
    pub comm: [u8; COMM_LEN],
}

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

/// Byte offsets of the fields the programs read that are not the kernel's
/// typed arguments. Userspace sets them at load time (from the kernel's BTF
/// and tracefs `format` files), so a kernel that moves a field is read
/// correctly instead of silently misread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracepointOffsets {
    /// Where `pid` and `comm` are in `struct task_struct` (from the
    /// kernel's BTF): sched_switch and sched_waking read them through
    /// their task pointers.
    pub task_pid: u32,
    pub task_comm: u32,
    /// `reason` of tlb:tlb_flush.
    pub tlb_reason: u32,
    /// Where `flags` (`PF_*`) is in `struct task_struct`.
    pub task_flags: u32,
    /// Where `tgid` is in `struct task_struct`.
    pub task_tgid: u32,
    pub _pad: u32,
}

/// Indices into the per-CPU `COUNTERS` array.
pub mod counter {
    /// Cpu-clock samples of the target seen by the sampling program.
    pub const SAMPLES: u32 = 0;
    /// Off-CPU intervals over the minimum sent to userspace.
    pub const OFFCPU_INTERVALS: u32 = 1;
    /// Records dropped because the ring buffer was full.
    pub const RING_FULL: u32 = 2;
    /// Stacks lost from emitted records: the stack map was full or a hash
    /// collided when the stack was walked.
    pub const STACK_LOST: u32 = 3;
    /// Off-CPU starts not recorded because the per-thread map was full.
    pub const OFFCPU_START_LOST: u32 = 4;
    /// TLB flushes the target's threads did (any reason but remote).
    pub const TLB_LOCAL: u32 = 5;
    /// Shootdown IPIs the target's threads sent.
    pub const TLB_IPIS: u32 = 6;
    /// Syscall starts (madvise, futex) not recorded: per-thread map full.
    pub const SYSCALL_START_LOST: u32 = 7;
    /// Host-side memory events sent (`slotprof host`).
    pub const HOST_EVENTS: u32 = 8;
    /// User stacks copied at a system call's exit (deferred from the
    /// switch-in of an interval that was reported).
    pub const USER_STACKS_AT_EXIT: u32 = 9;
    /// User stacks copied at a switch-out outside a system call.
    pub const USER_STACKS_AT_SWITCH_OUT: u32 = 10;
    /// User stacks copied for cpu-clock samples.
    pub const USER_STACKS_SAMPLED: u32 = 11;
    /// User stack copies that failed (nothing readable at the stack pointer).
    pub const USER_STACK_COPY_FAILED: u32 = 12;
    /// A deferred stack found the thread back in user space by another way
    /// (its registers had changed): not taken.
    pub const USER_STACK_CONTEXT_CHANGED: u32 = 13;
    /// User stack copies not made because the ring buffer was over half
    /// full: the small records (samples, intervals, registers) keep the
    /// room, the copy is replaced by an empty one.
    pub const USER_STACK_RING_BUSY: u32 = 14;
    /// System call exits whose stack repeated the thread's last copy
    /// (same registers, recent): sent as [`super::stack_for::REPEAT`].
    pub const USER_STACK_REPEATS: u32 = 15;
    /// Copies not made because a copy was already being made on this CPU
    /// (a cpu-clock sample that interrupted a system call exit's or a
    /// switch-out's copy, of the same thread): the sample's record takes
    /// that copy, the next of its thread, instead.
    pub const USER_STACK_NESTED: u32 = 16;
    /// Number of counters.
    pub const COUNT: u32 = 17;
}

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

/// The names of the object's programs, maps and globals, as the loader
/// looks them up. The eBPF side names them by its functions and statics
/// (the attribute macros take no constants); `profiler`'s no-root test
/// `probes::tests::every_name_the_loader_uses_is_in_the_object_and_no_other`
/// opens the embedded object and checks these lists against it, both ways.
pub mod names {
    /// Programs (the functions of `probes/`).
    pub mod program {
        pub const SWITCH: &str = "slotprof_switch";
        pub const WAKING: &str = "slotprof_waking";
        pub const SYS_ENTER: &str = "slotprof_sys_enter";
        pub const SYS_EXIT: &str = "slotprof_sys_exit";
        pub const HARDIRQ_ENTRY: &str = "slotprof_hardirq_entry";
        pub const HARDIRQ_EXIT: &str = "slotprof_hardirq_exit";
        pub const SOFTIRQ_ENTRY: &str = "slotprof_softirq_entry";
        pub const SOFTIRQ_EXIT: &str = "slotprof_softirq_exit";
        pub const HRTIMER_ENTRY: &str = "slotprof_hrtimer_entry";
        pub const HRTIMER_EXIT: &str = "slotprof_hrtimer_exit";
        pub const TLB_FLUSH: &str = "slotprof_tlb_flush";
        pub const PAGE_FAULT: &str = "slotprof_page_fault";
        pub const IPI_SEND: &str = "slotprof_ipi_send";
        pub const SLOT: &str = "slotprof_slot";
        pub const LOOP: &str = "slotprof_loop";
        pub const CPU: &str = "slotprof_cpu";
        pub const KVM_UNMAP: &str = "slotprof_kvm_unmap";
        pub const COMPACT_ISOLATE: &str = "slotprof_compact_isolate";
        pub const COMPACT_BEGIN: &str = "slotprof_compact_begin";
        pub const COMPACT_END: &str = "slotprof_compact_end";
        pub const MIGRATE: &str = "slotprof_migrate";
        pub const DIRECT_RECLAIM_BEGIN: &str = "slotprof_direct_reclaim_begin";
        pub const CGROUP_RECLAIM_BEGIN: &str = "slotprof_cgroup_reclaim_begin";
        pub const DIRECT_COMPACTION_BEGIN: &str = "slotprof_direct_compaction_begin";
        pub const MEM_STALL_END: &str = "slotprof_mem_stall_end";
        pub const CACHE_ENTER: &str = "slotprof_cache_enter";
        pub const CACHE_EXIT: &str = "slotprof_cache_exit";
        /// Every program of the object.
        pub const ALL: [&str; 27] = [
            SWITCH,
            WAKING,
            SYS_ENTER,
            SYS_EXIT,
            HARDIRQ_ENTRY,
            HARDIRQ_EXIT,
            SOFTIRQ_ENTRY,
            SOFTIRQ_EXIT,
            HRTIMER_ENTRY,
            HRTIMER_EXIT,
            TLB_FLUSH,
            PAGE_FAULT,
            IPI_SEND,
            SLOT,
            LOOP,
            CPU,
            KVM_UNMAP,
            COMPACT_ISOLATE,
            COMPACT_BEGIN,
            COMPACT_END,
            MIGRATE,
            DIRECT_RECLAIM_BEGIN,
            CGROUP_RECLAIM_BEGIN,
            DIRECT_COMPACTION_BEGIN,
            MEM_STALL_END,
            CACHE_ENTER,
            CACHE_EXIT,
        ];
    }

    /// Maps (the `#[map]` statics).
    pub mod map {
        pub const EVENTS: &str = "EVENTS";
        pub const COUNTERS: &str = "COUNTERS";
        pub const STACKS: &str = "STACKS";
        pub const STACKS_ODD: &str = "STACKS_ODD";
        pub const STACK_EPOCH: &str = "STACK_EPOCH";
        pub const OFFCPU_START: &str = "OFFCPU_START";
        pub const FUTEX_SHORT: &str = "FUTEX_SHORT";
        pub const USER_STACK_TOP: &str = "USER_STACK_TOP";
        pub const USER_STACK_SCRATCH: &str = "USER_STACK_SCRATCH";
        /// Used by the programs only.
        pub const KERNEL_ONLY: [&str; 10] = [
            "CACHE_WORK_START",
            "CPU_RUNS_MAP",
            "HOST_STACKS",
            "IRQ_NESTING",
            "KERNEL_STACK_SCRATCH",
            "MADVISE_START",
            "MEM_STALL_START",
            "PAGE_FAULTS",
            "URET_PENDING",
            "USER_STACK_BUSY",
        ];
        /// The maps userspace reads, resizes or writes.
        pub const USED: [&str; 9] = [
            EVENTS,
            COUNTERS,
            STACKS,
            STACKS_ODD,
            STACK_EPOCH,
            OFFCPU_START,
            FUTEX_SHORT,
            USER_STACK_TOP,
            USER_STACK_SCRATCH,
        ];
    }

    /// Read-only globals the loader sets (`.rodata`).
    pub mod global {
        pub const TARGET_TGID: &str = "TARGET_TGID";
        pub const MIN_OFFCPU_NS: &str = "MIN_OFFCPU_NS";
        pub const MIN_FUTEX_NS: &str = "MIN_FUTEX_NS";
        pub const USER_STACK_REPEAT_NS: &str = "USER_STACK_REPEAT_NS";
        pub const TP_OFFSETS: &str = "TP_OFFSETS";
        pub const ALL: [&str; 5] = [
            TARGET_TGID,
            MIN_OFFCPU_NS,
            MIN_FUTEX_NS,
            USER_STACK_REPEAT_NS,
            TP_OFFSETS,
        ];
    }
}
