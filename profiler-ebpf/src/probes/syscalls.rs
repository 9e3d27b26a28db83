//! madvise(2) and futex(2) of the target: their entries from the syscalls
//! tracepoints, their exits (and every other system call's) from
//! raw_syscalls:sys_exit.
//!
//! Enter records the arguments per thread (a map write, no stack); exit
//! emits the call, then a copy of the user stack taken there: the thread is
//! still in its own context returning from the syscall, so its user stack
//! is the caller's, and short futex waits never pay for a stack at all.
//!
//! One program on the exit tracepoint, not one per system call: a second
//! probe on a tracepoint rewrites its call site (static call) in the
//! hottest path of every CPU, and under the test VMs' emulation (TCG) that
//! rewrite raced with the CPUs running it (an int3 oops in
//! syscall_exit_to_user_mode_prepare, twice in four 6.12 boots).

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
};
use profiler_ebpf::{
    counter, futex_op_waits, waker, EventKind, FutexStart, FutexTotals, FutexWait, MadviseCall, MadviseStart,
    COMM_LEN, USER_STACK_NEXT,
};

use super::{
    count, count_lost_stacks, is_target, min_futex_ns, offsets, submit_flags,
    user_stack::{send_stack_at_syscall_exit, take_pending_user_stack},
    EVENTS, FUTEX_SHORT, FUTEX_START, MADVISE_START, OFFCPU_START,
};

/// x86-64 system call numbers.
const SYS_MADVISE: i64 = 28;
const SYS_FUTEX: i64 = 202;

/// raw_syscalls:sys_exit: a futex wait or madvise call of the target is
/// emitted with its stack; any other exit takes a deferred user stack if
/// one is pending (see user_stack.rs). Other processes stop at the tgid.
#[tracepoint]
pub fn slotprof_sys_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let id: i64 = unsafe { ctx.read_at(offsets().sys_exit_id as usize) }.unwrap_or(-1);
    let emitted = match id {
        SYS_FUTEX => futex_exit(&ctx, pid_tgid),
        SYS_MADVISE => madvise_exit(&ctx, pid_tgid),
        _ => false,
    };
    if !emitted {
        take_pending_user_stack(pid_tgid as u32);
    }
    0
}

#[tracepoint]
pub fn slotprof_madvise_enter(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let off = offsets();
    let start = MadviseStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        len: unsafe { ctx.read_at::<u64>(off.madvise_len as usize) }.unwrap_or(0),
        behavior: unsafe { ctx.read_at::<u64>(off.madvise_behavior as usize) }.unwrap_or(0) as u32,
        tlb_local: 0,
        tlb_ipis: 0,
        _pad: 0,
    };
    if MADVISE_START.insert(&(pid_tgid as u32), &start, 0).is_err() {
        count(counter::SYSCALL_START_LOST);
    }
    0
}

#[inline(always)]
fn madvise_exit(ctx: &TracePointContext, pid_tgid: u64) -> bool {
    let tid = pid_tgid as u32;
    let Some(start) = MADVISE_START.get_ptr(&tid) else {
        return false;
    };
    let start = unsafe { *start };
    let _ = MADVISE_START.remove(&tid);
    let Some(mut entry) = EVENTS.reserve::<MadviseCall>(0) else {
        count(counter::RING_FULL);
        return false;
    };
    let user_stack_id = USER_STACK_NEXT;
    entry.write(MadviseCall {
        kind: EventKind::Madvise as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        start_ns: start.start_ns,
        end_ns: unsafe { bpf_ktime_get_ns() },
        tgid: (pid_tgid >> 32) as u32,
        tid,
        len: start.len,
        behavior: start.behavior,
        user_stack_id,
        ret: unsafe { ctx.read_at::<i64>(offsets().sys_exit_ret as usize) }.unwrap_or(0),
        tlb_local: start.tlb_local,
        tlb_ipis: start.tlb_ipis,
        comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
    });
    entry.submit(submit_flags());
    send_stack_at_syscall_exit(tid);
    true
}

#[tracepoint]
pub fn slotprof_futex_enter(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let off = offsets();
    let op = unsafe { ctx.read_at::<u64>(off.futex_op as usize) }.unwrap_or(0) as u32;
    if !futex_op_waits(op) {
        return 0;
    }
    let start = FutexStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        uaddr: unsafe { ctx.read_at::<u64>(off.futex_uaddr as usize) }.unwrap_or(0),
        op,
        _pad: 0,
    };
    // The thread's entry stays between calls: rewritten in place.
    match FUTEX_START.get_ptr_mut(&(pid_tgid as u32)) {
        Some(p) => unsafe { *p = start },
        None => {
            if FUTEX_START.insert(&(pid_tgid as u32), &start, 0).is_err() {
                count(counter::SYSCALL_START_LOST);
            }
        }
    }
    0
}

#[inline(always)]
fn futex_exit(ctx: &TracePointContext, pid_tgid: u64) -> bool {
    let tid = pid_tgid as u32;
    let Some(p) = FUTEX_START.get_ptr_mut(&tid) else {
        return false;
    };
    let start = unsafe { *p };
    if start.start_ns == 0 {
        return false; // not a wait we saw begin
    }
    unsafe { (*p).start_ns = 0 };
    let now = unsafe { bpf_ktime_get_ns() };
    let waited = now.saturating_sub(start.start_ns);
    if waited < min_futex_ns() {
        // Short: only counted, per address.
        match FUTEX_SHORT.get_ptr_mut(&start.uaddr) {
            Some(t) => unsafe {
                (*t).waits += 1;
                (*t).wait_ns += waited;
            },
            None => {
                let t = FutexTotals {
                    waits: 1,
                    wait_ns: waited,
                };
                let _ = FUTEX_SHORT.insert(&start.uaddr, &t, 0);
            }
        }
        return false;
    }
    // Who woke it: the waker of its last off-CPU interval, if that
    // wakeup came during this wait.
    let mut waker = None;
    let mut woken_ns = 0;
    if let Some(o) = OFFCPU_START.get_ptr_mut(&tid) {
        unsafe {
            if (*o).last_waker.tid != 0 && (*o).last_woken_ns >= start.start_ns {
                waker = Some((*o).last_waker);
                woken_ns = (*o).last_woken_ns;
            }
            (*o).last_waker.tid = 0;
        }
    }
    let Some(mut entry) = EVENTS.reserve::<FutexWait>(0) else {
        count(counter::RING_FULL);
        return false;
    };
    let (waker_tid, wu, wk, wcomm) = match waker {
        Some(w) => (w.tid, w.user_stack_id, w.context, w.comm),
        None => (0, -1, waker::NOT_TAKEN, [0; COMM_LEN]),
    };
    let user_stack_id = USER_STACK_NEXT;
    count_lost_stacks(&[wu]);
    entry.write(FutexWait {
        kind: EventKind::FutexWait as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        start_ns: start.start_ns,
        end_ns: now,
        tgid: (pid_tgid >> 32) as u32,
        tid,
        uaddr: start.uaddr,
        op: start.op,
        user_stack_id,
        ret: unsafe { ctx.read_at::<i64>(offsets().sys_exit_ret as usize) }.unwrap_or(0),
        waker_tid,
        waker_user_stack_id: wu,
        waker_context: wk,
        _pad: 0,
        waker_woken_ns: woken_ns,
        comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
        waker_comm: wcomm,
    });
    entry.submit(submit_flags());
    send_stack_at_syscall_exit(tid);
    true
}
