//! Off-CPU intervals from sched:sched_switch, and who ended them from
//! sched:sched_waking.
//!
//! Keyed by tid, not by CPU: a thread that sleeps on one CPU often wakes on
//! another, and a per-CPU key would pair unrelated switches.

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
};
use profiler_ebpf::{
    counter, stack_for, EventKind, LastWaker, OffCpuInterval, OffCpuStart, COMM_LEN, KERNEL_STACK_FUTEX_WAIT,
    TASK_INTERRUPTIBLE, USER_STACK_AT_SWITCH_OUT, USER_STACK_NEXT,
};

use super::{
    count, count_lost_stacks, hint_target_tid, is_target, maybe_offcpu_target, min_futex_ns, min_offcpu_ns,
    offsets, stack_id, submit_flags,
    user_stack::{send_user_stack, user_regs_now},
    BPF_F_USER_STACK, EVENTS, FUTEX_START, OFFCPU_START,
};

/// A sleep must have lasted this long at its wakeup for the waker's stacks
/// to be walked: half the smaller of the two reporting minimums.
#[inline(always)]
fn waker_stack_min_ns() -> u64 {
    let a = min_offcpu_ns();
    let b = min_futex_ns();
    (if a < b { a } else { b }) / 2
}

#[tracepoint]
pub fn slotprof_switch(ctx: TracePointContext) -> u32 {
    let off = offsets();

    // Switch-out: `current` is still the previous task.
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // The clock is read only for a switch of the target's threads: every
    // other switch on the machine stops at the two filters.
    let mut now = 0;
    if is_target(tgid) {
        now = unsafe { bpf_ktime_get_ns() };
        let prev_pid: i32 = unsafe { ctx.read_at(off.switch_prev_pid as usize) }.unwrap_or(0);
        let state: i64 = unsafe { ctx.read_at(off.switch_prev_state as usize) }.unwrap_or(0);
        if prev_pid > 0 {
            // Inside a futex wait (the futex probe saw it enter) the kernel
            // stack is always the syscall's wait path: not walked.
            let tid = prev_pid as u32;
            let in_futex_wait = state as u32 == TASK_INTERRUPTIBLE
                && FUTEX_START
                    .get_ptr(&tid)
                    .is_some_and(|f| unsafe { (*f).start_ns } != 0);
            let kernel_stack_id = if in_futex_wait {
                KERNEL_STACK_FUTEX_WAIT
            } else {
                stack_id(&ctx, 0)
            };
            // The user stack: copied at the system call's exit if this
            // interval is reported (deferred, see user_stack.rs), or now
            // when the thread left outside a system call.
            let regs = user_regs_now();
            let user_stack_id = match &regs {
                Some(r) if r.in_syscall => USER_STACK_NEXT,
                Some(r) => {
                    if send_user_stack(r, stack_for::SWITCH_OUT, now) {
                        count(counter::USER_STACKS_AT_SWITCH_OUT);
                    }
                    USER_STACK_AT_SWITCH_OUT
                }
                None => -14,
            };
            let (user_ip, user_sp, user_bp) = regs.map_or((0, 0, 0), |r| (r.ip, r.sp, r.bp));
            match OFFCPU_START.get_ptr_mut(&tid) {
                // The thread's entry from its earlier intervals: rewritten
                // in place, field by field (its deferred stack and last
                // waker stay for the system call exit that reads them).
                Some(p) => unsafe {
                    (*p).user_ip = user_ip;
                    (*p).user_sp = user_sp;
                    (*p).user_bp = user_bp;
                    (*p).user_stack_id = user_stack_id;
                    (*p).kernel_stack_id = kernel_stack_id;
                    (*p).state = state as u32;
                    (*p).waker_tid = 0;
                    (*p).waker_tgid = 0;
                    (*p).tgid = tgid;
                    (*p).waker_kernel_stack_id = -1;
                    (*p).waker_user_stack_id = -1;
                    (*p).woken_ns = 0;
                    // Last: a wakeup on another CPU looks at this first.
                    (*p).start_ns = now;
                },
                None => {
                    let start = OffCpuStart {
                        start_ns: now,
                        user_ip,
                        user_sp,
                        user_bp,
                        user_stack_id,
                        kernel_stack_id,
                        state: state as u32,
                        waker_tid: 0,
                        waker_tgid: 0,
                        tgid,
                        waker_kernel_stack_id: -1,
                        waker_user_stack_id: -1,
                        woken_ns: 0,
                        waker_comm: [0; COMM_LEN],
                        pending_sp: 0,
                        last_waker: LastWaker {
                            tid: 0,
                            user_stack_id: -1,
                            kernel_stack_id: -1,
                            _pad: 0,
                            comm: [0; COMM_LEN],
                        },
                        last_woken_ns: 0,
                    };
                    hint_target_tid(tid);
                    if OFFCPU_START.insert(&tid, &start, 0).is_err() {
                        count(counter::OFFCPU_START_LOST);
                    }
                }
            }
        }
    }

    // Switch-in: only threads we saw leave are in the map.
    let next_pid: i32 = unsafe { ctx.read_at(off.switch_next_pid as usize) }.unwrap_or(0);
    if next_pid <= 0 {
        return 0;
    }
    let tid = next_pid as u32;
    if !maybe_offcpu_target(tid) {
        return 0;
    }
    let Some(p) = OFFCPU_START.get_ptr_mut(&tid) else {
        return 0;
    };
    let start = unsafe { *p };
    if start.start_ns == 0 {
        return 0; // not seen leaving (it was already off-CPU at attach)
    }
    if now == 0 {
        now = unsafe { bpf_ktime_get_ns() };
    }
    unsafe { (*p).start_ns = 0 };
    if start.waker_tid != 0 {
        // For the futex probe: who ended this thread's wait.
        unsafe {
            (*p).last_waker = LastWaker {
                tid: start.waker_tid,
                user_stack_id: start.waker_user_stack_id,
                kernel_stack_id: start.waker_kernel_stack_id,
                _pad: 0,
                comm: start.waker_comm,
            };
            (*p).last_woken_ns = start.woken_ns;
        }
    }
    if now.saturating_sub(start.start_ns) < min_offcpu_ns() {
        return 0;
    }
    if start.user_stack_id == USER_STACK_NEXT {
        // Copied at this system call's exit (user_stack.rs).
        unsafe { (*p).pending_sp = start.user_sp };
    }
    let Some(mut entry) = EVENTS.reserve::<OffCpuInterval>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    let comm: [u8; COMM_LEN] = unsafe { ctx.read_at(off.switch_next_comm as usize) }.unwrap_or([0; COMM_LEN]);
    entry.write(OffCpuInterval {
        kind: EventKind::OffCpu as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        start_ns: start.start_ns,
        end_ns: now,
        tgid: start.tgid,
        tid,
        user_stack_id: start.user_stack_id,
        kernel_stack_id: start.kernel_stack_id,
        state: start.state,
        waker_tid: start.waker_tid,
        waker_tgid: start.waker_tgid,
        waker_kernel_stack_id: start.waker_kernel_stack_id,
        comm,
        waker_comm: start.waker_comm,
        woken_ns: start.woken_ns,
    });
    entry.submit(submit_flags());
    count(counter::OFFCPU_INTERVALS);
    count_lost_stacks(&[start.kernel_stack_id, start.waker_kernel_stack_id]);
    0
}

#[tracepoint]
pub fn slotprof_waking(ctx: TracePointContext) -> u32 {
    let pid: i32 = unsafe { ctx.read_at(offsets().waking_pid as usize) }.unwrap_or(0);
    if pid <= 0 {
        return 0;
    }
    if !maybe_offcpu_target(pid as u32) {
        return 0;
    }
    let Some(start) = OFFCPU_START.get_ptr_mut(&(pid as u32)) else {
        return 0;
    };
    if unsafe { (*start).start_ns } == 0 {
        return 0; // on a CPU (or about to leave it): no interval to end
    }
    // `current` is the waker when the wakeup comes from a task; in a timer
    // or device interrupt it is whoever was interrupted. The kernel stack
    // tells which (userspace reads it only for the intervals it reports).
    // Only a sleep already long enough to be reported, or nearly (half the
    // smaller minimum: the wait for a CPU after the wakeup can make up the
    // rest), gets the waker's stacks: most wakeups end short sleeps, and
    // two stack walks were most of what this program cost.
    let pid_tgid = bpf_get_current_pid_tgid();
    let now = unsafe { bpf_ktime_get_ns() };
    let asleep = now.saturating_sub(unsafe { (*start).start_ns });
    let (waker_kernel_stack_id, waker_user_stack_id) = if asleep >= waker_stack_min_ns() {
        (stack_id(&ctx, 0), stack_id(&ctx, BPF_F_USER_STACK))
    } else {
        (-1, -1)
    };
    unsafe {
        (*start).woken_ns = now;
        (*start).waker_kernel_stack_id = waker_kernel_stack_id;
        (*start).waker_user_stack_id = waker_user_stack_id;
        (*start).waker_tid = pid_tgid as u32;
        (*start).waker_tgid = (pid_tgid >> 32) as u32;
        (*start).waker_comm = bpf_get_current_comm().unwrap_or([0; COMM_LEN]);
    }
    0
}
