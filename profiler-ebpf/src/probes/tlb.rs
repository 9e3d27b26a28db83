//! TLB flushes and shootdown IPIs caused by the target's threads.
//!
//! tlb:tlb_flush fires on the CPU doing the flush; for the flushes a
//! thread does for itself (reasons other than a remote shootdown) `current`
//! is that thread. The IPIs that make other CPUs flush are seen on the
//! sending side (ipi:ipi_send_cpumask / ipi_send_cpu), where `current` is
//! the thread that caused them. Both are counted per thread inside madvise
//! and in total.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext};
use profiler_ebpf::counter;

use super::{count, is_target, offsets, MADVISE_START};

/// `enum tlb_flush_reason`: TLB_REMOTE_SHOOTDOWN, the flush a remote CPU
/// asked for (its `current` is unrelated).
const TLB_REMOTE_SHOOTDOWN: i32 = 1;

#[tracepoint]
pub fn slotprof_tlb_flush(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let reason: i32 = unsafe { ctx.read_at(offsets().tlb_reason as usize) }.unwrap_or(-1);
    if reason == TLB_REMOTE_SHOOTDOWN {
        return 0;
    }
    count(counter::TLB_LOCAL);
    if let Some(m) = MADVISE_START.get_ptr_mut(&(pid_tgid as u32)) {
        unsafe { (*m).tlb_local += 1 };
    }
    0
}

#[tracepoint]
pub fn slotprof_ipi_send(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    count(counter::TLB_IPIS);
    if let Some(m) = MADVISE_START.get_ptr_mut(&(pid_tgid as u32)) {
        unsafe { (*m).tlb_ipis += 1 };
    }
    0
}
