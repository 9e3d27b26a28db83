//! Memory stalls of the target's threads: direct reclaim, their cgroup's
//! reclaim and direct compaction, timed from the tracepoints' begin to
//! end in the thread's own context (kswapd's and kcompactd's work is
//! theirs, not the target's: it shows as CPU contention when it takes a
//! hot thread's core).

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
};
use profiler_ebpf::{counter, mem_stall, EventKind, MemStall, MemStallStart, COMM_LEN};

use super::{count, is_target, submit_flags, EVENTS, MEM_STALL_START};

#[inline(always)]
fn begin(what: u32) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let start = MemStallStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        what,
        _pad: 0,
    };
    let _ = MEM_STALL_START.insert(&(pid_tgid as u32), &start, 0);
    0
}

#[tracepoint]
pub fn slotprof_direct_reclaim_begin(_ctx: TracePointContext) -> u32 {
    begin(mem_stall::DIRECT_RECLAIM)
}

#[tracepoint]
pub fn slotprof_cgroup_reclaim_begin(_ctx: TracePointContext) -> u32 {
    begin(mem_stall::CGROUP_RECLAIM)
}

#[tracepoint]
pub fn slotprof_direct_compaction_begin(_ctx: TracePointContext) -> u32 {
    begin(mem_stall::DIRECT_COMPACTION)
}

/// Attached to every end tracepoint: the kind was kept at its begin.
#[tracepoint]
pub fn slotprof_mem_stall_end(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    let tid = pid_tgid as u32;
    let Some(start) = (unsafe { MEM_STALL_START.get(&tid) }).copied() else {
        return 0;
    };
    let _ = MEM_STALL_START.remove(&tid);
    // Both reclaim ends have `nr_reclaimed` right after the common fields.
    let nr_reclaimed = if start.what == mem_stall::DIRECT_COMPACTION {
        0
    } else {
        unsafe { ctx.read_at::<u64>(8) }.unwrap_or(0)
    };
    let Some(mut entry) = EVENTS.reserve::<MemStall>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    entry.write(MemStall {
        kind: EventKind::MemStall as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        start_ns: start.start_ns,
        end_ns: unsafe { bpf_ktime_get_ns() },
        tgid,
        tid,
        what: start.what,
        _pad: 0,
        nr_reclaimed,
        comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
    });
    entry.submit(submit_flags());
    0
}
