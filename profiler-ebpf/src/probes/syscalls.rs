//! madvise(2) and futex(2) of the target: their entries from
//! raw_syscalls:sys_enter, their exits (and every other system call's) from
//! raw_syscalls:sys_exit, both BTF tracepoints (the kernel's own arguments,
//! read by direct loads; a classic tracepoint builds a record first: on a
//! futex storm that was ~10% of these probes' cost).
//!
//! Enter records the arguments per thread (a map write, no stack); exit
//! emits the call, then a copy of the user stack taken there: the thread is
//! still in its own context returning from the syscall, so its user stack
//! is the caller's, and short futex waits never pay for a stack at all.
//!
//! A futex wait's state lives in the thread's one entry (`OFFCPU_START`,
//! with its off-CPU interval, last waker and deferred stack), so the exit
//! looks the thread up once.
//!
//! One program on each tracepoint, not one per system call: a second
//! probe on a tracepoint rewrites its call site (static call) in the
//! hottest path of every CPU, and under the test VMs' emulation (TCG) that
//! rewrite raced with the CPUs running it (an int3 oops in
//! syscall_exit_to_user_mode_prepare, twice in four 6.12 boots).

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use profiler_ebpf::{
    counter, futex_op_waits, reg, waker, EventKind, FutexStart, FutexTotals, FutexWait, MadviseCall,
    MadviseStart, OffCpuStart, COMM_LEN, PT_REGS_WORDS, USER_STACK_NEXT,
};

use super::{
    clear_exit_hint, count, count_lost_stacks, exit_work_hinted, hint_exit_work, hint_target_tid, is_target,
    min_futex_ns, submit_flags,
    user_stack::{send_stack_at_syscall_exit, take_pending_user_stack},
    EVENTS, FUTEX_SHORT, MADVISE_START, OFFCPU_START,
};

/// x86-64 system call numbers.
const SYS_MADVISE: i64 = 28;
const SYS_FUTEX: i64 = 202;

/// raw_syscalls:sys_exit: a futex wait or madvise call of the target is
/// emitted with its stack; any other exit takes a deferred user stack if
/// one is pending (see user_stack.rs). Other processes stop at the tgid.
#[btf_tracepoint(function = "sys_exit")]
pub fn slotprof_sys_exit(ctx: BtfTracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    // The tracepoint's own arguments (`struct pt_regs *regs, long ret`):
    // the system call number is `regs->orig_ax`, read by a direct load
    // the verifier checks against the kernel's BTF (no helper call, no
    // record built as for a classic tracepoint).
    let regs: *const [u64; PT_REGS_WORDS] = ctx.arg(0);
    let ret: i64 = ctx.arg(1);
    let id = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*regs)[reg::ORIG_RAX])) } as i64;
    if id == SYS_MADVISE && madvise_exit(ret, pid_tgid) {
        return 0;
    }
    // The thread's one entry: its futex wait, its last waker, its deferred
    // stack; looked up only when its entry or switch-in said there is work.
    let tid = pid_tgid as u32;
    if !exit_work_hinted(tid) {
        return 0;
    }
    clear_exit_hint(tid);
    let Some(p) = OFFCPU_START.get_ptr_mut(&tid) else {
        return 0;
    };
    if id == SYS_FUTEX && futex_exit(ret, pid_tgid, p) {
        return 0;
    }
    take_pending_user_stack(p);
    0
}

/// raw_syscalls:sys_enter, as a BTF tracepoint: a futex wait or madvise
/// call of the target records its arguments and start per thread (a map
/// write, no stack); every other call stops at the number or the tgid.
/// The arguments are the caller's registers (`regs->di`, `si`, `dx`), read
/// by direct loads the verifier checks against the kernel's BTF: no record
/// is built and no helper called, as a classic `syscalls:sys_enter_*`
/// tracepoint would.
#[btf_tracepoint(function = "sys_enter")]
pub fn slotprof_sys_enter(ctx: BtfTracePointContext) -> u32 {
    let id: i64 = ctx.arg(1);
    if id != SYS_FUTEX && id != SYS_MADVISE {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let regs: *const [u64; PT_REGS_WORDS] = ctx.arg(0);
    let arg = |i: usize| unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*regs)[i])) };
    if id == SYS_FUTEX {
        futex_enter(pid_tgid as u32, arg(reg::RDI), arg(reg::RSI) as u32);
    } else {
        madvise_enter(pid_tgid as u32, arg(reg::RSI), arg(reg::RDX) as u32);
    }
    0
}

#[inline(always)]
fn madvise_enter(tid: u32, len: u64, behavior: u32) {
    let start = MadviseStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        len,
        behavior,
        tlb_local: 0,
        tlb_ipis: 0,
        _pad: 0,
    };
    if MADVISE_START.insert(&tid, &start, 0).is_err() {
        count(counter::SYSCALL_START_LOST);
    }
}

#[inline(always)]
fn madvise_exit(ret: i64, pid_tgid: u64) -> bool {
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
        ret,
        tlb_local: start.tlb_local,
        tlb_ipis: start.tlb_ipis,
        comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
    });
    entry.submit(submit_flags());
    send_stack_at_syscall_exit(OFFCPU_START.get_ptr_mut(&tid));
    true
}

#[inline(always)]
fn futex_enter(tid: u32, uaddr: u64, op: u32) {
    if !futex_op_waits(op) {
        return;
    }
    let start = FutexStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        uaddr,
        op,
        _pad: 0,
    };
    // In the thread's entry (made here if the thread has not switched
    // out yet), rewritten in place.
    hint_exit_work(tid);
    match OFFCPU_START.get_ptr_mut(&tid) {
        Some(p) => unsafe { (*p).futex = start },
        None => {
            let entry = OffCpuStart {
                futex: start,
                ..OffCpuStart::IDLE
            };
            hint_target_tid(tid);
            if OFFCPU_START.insert(&tid, &entry, 0).is_err() {
                count(counter::SYSCALL_START_LOST);
            }
        }
    }
}

#[inline(always)]
fn futex_exit(ret: i64, pid_tgid: u64, p: *mut OffCpuStart) -> bool {
    let tid = pid_tgid as u32;
    let start = unsafe { (*p).futex };
    if start.start_ns == 0 {
        return false; // not a wait we saw begin
    }
    unsafe { (*p).futex.start_ns = 0 };
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
    unsafe {
        if (*p).last_waker.tid != 0 && (*p).last_woken_ns >= start.start_ns {
            waker = Some((*p).last_waker);
            woken_ns = (*p).last_woken_ns;
        }
        (*p).last_waker.tid = 0;
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
        ret,
        waker_tid,
        waker_user_stack_id: wu,
        waker_context: wk,
        _pad: 0,
        waker_woken_ns: woken_ns,
        comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
        waker_comm: wcomm,
    });
    entry.submit(submit_flags());
    send_stack_at_syscall_exit(Some(p));
    true
}
