//! The records slotprof's eBPF programs write and its userspace reads.
//!
//! Everything here is `#[repr(C)]`, `Copy` and free of pointers, so the same
//! definition compiles for `bpfel-unknown-none` and for the host, and a
//! ring-buffer record can be read with one unaligned copy.
#![no_std]

pub mod names;
mod offcpu;
mod stacks;

pub use offcpu::*;
pub use stacks::*;

/// Length of a kernel task name (`comm`), NUL padding included.
pub const COMM_LEN: usize = 16;

/// Distinct futex addresses whose short waits are counted in the kernel.
pub const FUTEX_ADDR_ENTRIES: u32 = 4096;

/// Futex ops that wait (low bits of `op`, flags masked off).
pub const fn futex_op_waits(op: u32) -> bool {
    // FUTEX_WAIT 0, FUTEX_LOCK_PI 6, FUTEX_WAIT_BITSET 9,
    // FUTEX_WAIT_REQUEUE_PI 11, FUTEX_LOCK_PI2 13.
    matches!(op & 0x7f, 0 | 6 | 9 | 11 | 13)
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
    /// [`OffCpuFold`].
    OffCpuFold = 13,
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

/// Where a thread's memory stall began (per-thread map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MemStallStart {
    pub start_ns: u64,
    pub what: u32,
    pub _pad: u32,
}

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
    /// Short off-CPU intervals folded into their thread's
    /// [`super::OffCpuFold`] instead of reported one by one.
    pub const OFFCPU_FOLDED: u32 = 17;
    /// Folded records sent.
    pub const OFFCPU_FOLDS: u32 = 18;
    /// Number of counters.
    pub const COUNT: u32 = 19;
}
