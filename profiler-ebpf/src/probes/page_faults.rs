//! User page faults of the target, counted per thread in the kernel.
//!
//! The tracepoint gives the fault, not its duration (that would need
//! kprobes, which this design does without), so the count is what a
//! main-loop gap reports: the loop uprobe reads it at every iteration.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext};

use super::{is_target, PAGE_FAULTS};

#[tracepoint]
pub fn slotprof_page_fault(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let tid = pid_tgid as u32;
    match PAGE_FAULTS.get_ptr_mut(&tid) {
        // Only this thread updates its own counter.
        Some(n) => unsafe { *n += 1 },
        None => {
            let _ = PAGE_FAULTS.insert(&tid, &1, 0);
        }
    }
    0
}
