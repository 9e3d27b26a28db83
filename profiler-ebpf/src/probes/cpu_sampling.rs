//! cpu-clock sampling: one software perf event per CPU calls this program.
//!
//! Each sample of the target goes to the ring buffer with its time and its
//! kernel stack id, followed by a copy of its user stack (unwound in
//! userspace). Streaming beats aggregating in the kernel here: at 99 Hz on
//! every CPU it is a few hundred 48-byte records a second, and each sample's
//! timestamp is what lets userspace place it in a slot.

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::perf_event,
    programs::PerfEventContext,
};
use profiler_ebpf::{
    counter, reg, stack_for, CpuSample, EventKind, UserRegs, PT_REGS_WORDS, USER_STACK_NEXT,
};

use super::{
    count, count_lost_stacks, is_target, stack_id, submit_flags,
    user_stack::{send_no_stack, send_user_stack, user_regs_now},
    EVENTS,
};

#[perf_event]
pub fn slotprof_cpu(ctx: PerfEventContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    count(counter::SAMPLES);
    // The user stack is the copy sent right after this record.
    let user_stack_id = USER_STACK_NEXT;
    let kernel_stack_id = stack_id(&ctx, 0);
    count_lost_stacks(&[kernel_stack_id]);
    let Some(mut entry) = EVENTS.reserve::<CpuSample>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    entry.write(CpuSample {
        kind: EventKind::CpuSample as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tgid,
        tid: pid_tgid as u32,
        user_stack_id,
        kernel_stack_id,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    });
    entry.submit(submit_flags());
    // The registers (small, for the cache-line detector) before the copy
    // (large): a ring short of room drops the copy, not them.
    user_regs(&ctx, tgid, pid_tgid as u32);
    match user_regs_now() {
        Some(regs) => {
            if send_user_stack(&regs, stack_for::SAMPLE, 0) {
                count(counter::USER_STACKS_SAMPLED);
            }
        }
        None => send_no_stack(stack_for::SAMPLE),
    }
    0
}

/// Sends the registers of a sample taken in user mode (cache-line
/// detector, VM path). x86-64 only: the layout is `struct pt_regs`.
#[inline(always)]
fn user_regs(ctx: &PerfEventContext, tgid: u32, tid: u32) {
    #[cfg(bpf_target_arch = "x86_64")]
    {
        use aya_ebpf::EbpfContext;
        // bpf_perf_event_data starts with the interrupted registers. The
        // verifier only allows loads at constant offsets from the context
        // pointer itself, so each word is its own volatile load.
        let base = ctx.as_ptr() as *const u64;
        let mut regs = [0u64; PT_REGS_WORDS];
        let mut i = 0;
        while i < PT_REGS_WORDS {
            regs[i] = unsafe { core::ptr::read_volatile(base.add(i)) };
            i += 1;
        }
        if regs[reg::CS] & 3 != 3 {
            return; // interrupted in the kernel: these are not user registers
        }
        let Some(mut entry) = EVENTS.reserve::<UserRegs>(0) else {
            count(counter::RING_FULL);
            return;
        };
        entry.write(UserRegs {
            kind: EventKind::UserRegs as u32,
            cpu: unsafe { bpf_get_smp_processor_id() },
            ts_ns: unsafe { bpf_ktime_get_ns() },
            tgid,
            tid,
            regs,
        });
        entry.submit(submit_flags());
    }
    #[cfg(not(bpf_target_arch = "x86_64"))]
    let _ = (ctx, tgid, tid);
}
