//! Marks from uprobes on the target's own functions.
//!
//! Slot starts from a uprobe on the target's own "new bank" function
//! (e.g. `PohRecorder::set_bank` in Agave): the most precise slot boundary
//! there is, taken in the thread that starts the slot.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::uprobe,
    programs::ProbeContext,
};
use profiler_ebpf::{counter, EventKind, LoopMark, SlotMark};

use super::{count, is_target, submit_flags, EVENTS, EXACT_TIDS, PAGE_FAULTS};

#[uprobe]
pub fn slotprof_slot(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<SlotMark>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    entry.write(SlotMark {
        kind: EventKind::SlotMark as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tgid,
        tid: pid_tgid as u32,
        arg0: ctx.arg::<u64>(0).unwrap_or(0),
    });
    entry.submit(submit_flags());
    0
}

/// An iteration of the target's main loop starts (`--loop-symbol`).
#[uprobe]
pub fn slotprof_loop(_ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    // The gap detector reads this thread's off-CPU intervals one by one:
    // none of them is folded.
    let tid = pid_tgid as u32;
    if EXACT_TIDS.get_ptr(&tid).is_none() {
        let _ = EXACT_TIDS.insert(&tid, &1, 0);
    }
    let Some(mut entry) = EVENTS.reserve::<LoopMark>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    entry.write(LoopMark {
        kind: EventKind::LoopMark as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tgid,
        tid: pid_tgid as u32,
        page_faults: PAGE_FAULTS
            .get_ptr(&(pid_tgid as u32))
            .map_or(0, |n| unsafe { *n }),
    });
    entry.submit(submit_flags());
    0
}
