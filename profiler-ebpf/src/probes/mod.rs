//! Maps and settings shared by the probes; one file per event source.

mod cache_work;
mod cpu_sampling;
mod host;
mod mem_stall;
mod page_faults;
mod sched;
mod slot_mark;
mod syscalls;
mod tlb;
mod user_stack;

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, StackTrace},
};
use profiler_ebpf::{
    counter, FutexTotals, MadviseStart, OffCpuStart, TracepointOffsets, FUTEX_ADDR_ENTRIES,
    OFFCPU_MAP_ENTRIES, RING_BYTES, STACK_MAP_ENTRIES,
};

// Settings written by userspace before load (`EbpfLoader::set_global`).
// Read through `read_volatile` so the compiler cannot fold the defaults in.

/// Process to trace; 0 traces every process.
#[no_mangle]
static TARGET_TGID: u32 = 0;
/// Shortest off-CPU interval worth reporting.
#[no_mangle]
static MIN_OFFCPU_NS: u64 = 1_000_000;
/// Where the tracepoint fields are on this kernel.
#[no_mangle]
static TP_OFFSETS: TracepointOffsets = TracepointOffsets {
    task_pid: 0,
    task_comm: 0,
    tlb_reason: 8,
    task_flags: 0,
    task_tgid: 0,
    _pad: 0,
};
/// Futex waits shorter than this are only counted per address.
#[no_mangle]
static MIN_FUTEX_NS: u64 = 1_000_000;
/// A thread back at the same system call exit (same `ip`, `sp`, `bp`)
/// less than this after its last copy there is sent as a repeat of that
/// copy, not copied again; 0: every exit is copied.
#[no_mangle]
static USER_STACK_REPEAT_NS: u64 = 0;
/// Off-CPU intervals shorter than this may be folded (see
/// `profiler_ebpf::OffCpuFold`); 0: none are.
#[no_mangle]
static OFFCPU_FOLD_UNDER_NS: u64 = 0;

#[inline(always)]
fn target_tgid() -> u32 {
    unsafe { core::ptr::read_volatile(&TARGET_TGID) }
}

#[inline(always)]
fn min_offcpu_ns() -> u64 {
    unsafe { core::ptr::read_volatile(&MIN_OFFCPU_NS) }
}

#[inline(always)]
fn user_stack_repeat_ns() -> u64 {
    unsafe { core::ptr::read_volatile(&USER_STACK_REPEAT_NS) }
}

#[inline(always)]
fn fold_under_ns() -> u64 {
    unsafe { core::ptr::read_volatile(&OFFCPU_FOLD_UNDER_NS) }
}

#[inline(always)]
fn min_futex_ns() -> u64 {
    unsafe { core::ptr::read_volatile(&MIN_FUTEX_NS) }
}

#[inline(always)]
fn offsets() -> TracepointOffsets {
    unsafe { core::ptr::read_volatile(&TP_OFFSETS) }
}

/// Whether a task of this process is one we trace. The idle task (tgid 0) never is.
#[inline(always)]
fn is_target(tgid: u32) -> bool {
    let want = target_tgid();
    tgid != 0 && (want == 0 || want == tgid)
}

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BYTES, 0);

/// Flags for submitting a record of the target: no wakeup of the reader per
/// record (it drains the ring on its own tick: every 50 ms in `run`, 250 ms
/// in attach/record), but a forced one once an eighth of the ring waits, so
/// a burst cannot fill it between ticks. A wakeup per record woke slotprof
/// hundreds of times a second, each time on a CPU the target was using.
#[inline(always)]
fn submit_flags() -> u64 {
    const BPF_RB_NO_WAKEUP: u64 = 1;
    const BPF_RB_FORCE_WAKEUP: u64 = 2;
    const BPF_RB_AVAIL_DATA: u64 = 0;
    if EVENTS.query(BPF_RB_AVAIL_DATA) >= (RING_BYTES / 8) as u64 {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

/// Stacks, deduplicated in the kernel: a record carries only their ids.
/// Even stack epochs use this map, odd ones `STACKS_ODD`.
#[map]
static STACKS: StackTrace = StackTrace::with_max_entries(STACK_MAP_ENTRIES, 0);

/// The stack map of odd epochs (only `slotprof run` moves to a new epoch;
/// other modes load this map with a single entry).
#[map]
static STACKS_ODD: StackTrace = StackTrace::with_max_entries(STACK_MAP_ENTRIES, 0);

/// The current stack epoch, written by userspace.
#[map]
static STACK_EPOCH: Array<u32> = Array::with_max_entries(1, 0);

/// Threads of the target, by tid: their off-CPU state (see `OffCpuStart`).
#[map]
static OFFCPU_START: LruHashMap<u32, OffCpuStart> = LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// One byte per tid slot (`tid & TID_HINT_MASK`), set when a thread of the
/// target first switches out: a slot still 0 holds no `OFFCPU_START` key, so
/// the switch-ins and wakeups of every other task on the machine end with a
/// byte load instead of a hash lookup. Never cleared (a slot shared with an
/// exited target thread or another tid only costs that lookup).
static mut TID_HINT: [u8; TID_HINT_SLOTS] = [0; TID_HINT_SLOTS];

const TID_HINT_SLOTS: usize = 1 << 16;
const TID_HINT_MASK: u32 = (TID_HINT_SLOTS - 1) as u32;

/// Whether `tid` may be in `OFFCPU_START` (false: certainly not).
#[inline(always)]
fn maybe_offcpu_target(tid: u32) -> bool {
    let slot = (tid & TID_HINT_MASK) as usize;
    unsafe { core::ptr::read_volatile(core::ptr::addr_of!(TID_HINT[slot])) != 0 }
}

/// Marks `tid` as a thread of the target (before its first `OFFCPU_START` entry).
#[inline(always)]
fn hint_target_tid(tid: u32) {
    let slot = (tid & TID_HINT_MASK) as usize;
    unsafe {
        let p = core::ptr::addr_of_mut!(TID_HINT[slot]);
        if core::ptr::read_volatile(p) == 0 {
            core::ptr::write_volatile(p, 1);
        }
    }
}

/// Per tid slot (`tid & EXIT_HINT_MASK`): the tid whose system call exit
/// has work in its `OFFCPU_START` entry (a futex wait begun, or a deferred
/// user stack to copy), `EXIT_HINT_SHARED` when two tids of one slot had, 0
/// when none. Every system call exit of the target reads it first: most
/// have nothing to do and stop there instead of looking their entry up.
/// Written by a thread's own system call entry, by its switch-in (before
/// it runs), and cleared by its own exit: one tid never races with itself.
/// A slot is a cache line of its own: threads made one after another have
/// consecutive tids, and sharing a line would bounce it between their CPUs
/// at every system call.
static mut EXIT_HINT: [ExitHintSlot; EXIT_HINT_SLOTS] = [ExitHintSlot {
    tid: 0,
    _pad: [0; 15],
}; EXIT_HINT_SLOTS];

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ExitHintSlot {
    tid: u32,
    _pad: [u32; 15],
}

const EXIT_HINT_SLOTS: usize = 1 << 12;
const EXIT_HINT_MASK: u32 = (EXIT_HINT_SLOTS - 1) as u32;
const EXIT_HINT_SHARED: u32 = u32::MAX;

#[inline(always)]
fn exit_hint(tid: u32) -> *mut u32 {
    let slot = (tid & EXIT_HINT_MASK) as usize;
    unsafe { core::ptr::addr_of_mut!(EXIT_HINT[slot].tid) }
}

/// Marks that `tid`'s next system call exit has work in its entry.
#[inline(always)]
fn hint_exit_work(tid: u32) {
    let p = exit_hint(tid);
    unsafe {
        let had = core::ptr::read_volatile(p);
        if had == 0 {
            core::ptr::write_volatile(p, tid);
        } else if had != tid && had != EXIT_HINT_SHARED {
            core::ptr::write_volatile(p, EXIT_HINT_SHARED);
        }
    }
}

/// Whether `tid`'s exit may have work (false: certainly not).
#[inline(always)]
fn exit_work_hinted(tid: u32) -> bool {
    let had = unsafe { core::ptr::read_volatile(exit_hint(tid)) };
    had == tid || had == EXIT_HINT_SHARED
}

/// `tid`'s exit did its work: its slot is free again (a shared slot stays
/// shared: the other tid may still have work).
#[inline(always)]
fn clear_exit_hint(tid: u32) {
    let p = exit_hint(tid);
    unsafe {
        if core::ptr::read_volatile(p) == tid {
            core::ptr::write_volatile(p, 0);
        }
    }
}

/// Threads whose every off-CPU interval is reported, never folded: the
/// ones a detector reads interval by interval. Userspace writes the main
/// thread, the loop thread and the hot threads it knows by name; the loop
/// uprobe adds its own thread. A full map leaves a thread folding.
#[map]
static EXACT_TIDS: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);

/// Target threads inside a memory stall (reclaim, compaction), by tid.
#[map]
static MEM_STALL_START: LruHashMap<u32, profiler_ebpf::MemStallStart> =
    LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// Target threads inside a probed program-cache call, by tid and kind
/// (`tid << 8 | kind`).
#[map]
static CACHE_WORK_START: LruHashMap<u64, profiler_ebpf::CacheWorkStart> =
    LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// Target threads' pending uretprobe returns, by tid (see
/// `PendingReturns`).
#[map]
static URET_PENDING: LruHashMap<u32, profiler_ebpf::PendingReturns> =
    LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// Target threads inside madvise(2), by tid.
#[map]
static MADVISE_START: LruHashMap<u32, MadviseStart> = LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// User page faults per target thread (read by the loop uprobe).
#[map]
static PAGE_FAULTS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// Futex waits under the minimum, per address.
#[map]
static FUTEX_SHORT: LruHashMap<u64, FutexTotals> = LruHashMap::with_max_entries(FUTEX_ADDR_ENTRIES, 0);

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

#[inline(always)]
fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        // Per-CPU slot: no other CPU writes it, no atomic needed.
        unsafe { *c += 1 };
    }
}

/// `bpf_get_stackid` flag: walk the user stack instead of the kernel's.
const BPF_F_USER_STACK: u64 = 1 << 8;

/// A stack id (with its epoch), or the negative errno from the helper;
/// see [`count_lost_stacks`].
#[inline(always)]
fn stack_id<C: aya_ebpf::programs::tracing::StackIdContext>(ctx: &C, flags: u64) -> i32 {
    let epoch = STACK_EPOCH.get(0).copied().unwrap_or(0);
    let walked = if epoch & 1 == 0 {
        ctx.get_stackid(&STACKS, flags)
    } else {
        ctx.get_stackid(&STACKS_ODD, flags)
    };
    match walked {
        Ok(index) => profiler_ebpf::stack_id_with_epoch(index as u32, epoch),
        Err(e) => e,
    }
}

/// Counts the lost stacks among those of a record being emitted. Walks
/// whose record is never emitted (a switch-out whose interval turns out
/// short) are not counted: nobody misses their stacks.
#[inline(always)]
fn count_lost_stacks(ids: &[i32]) {
    for &id in ids {
        if profiler_ebpf::stack_lost(id) {
            count(counter::STACK_LOST);
        }
    }
}
