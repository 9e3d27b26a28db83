//! Off-CPU intervals from sched:sched_switch, and who ended them from
//! sched:sched_waking.
//!
//! Keyed by tid, not by CPU: a thread that sleeps on one CPU often wakes on
//! another, and a per-CPU key would pair unrelated switches.

use aya_ebpf::{
    bindings::task_struct,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_kernel_buf, generated::bpf_get_task_stack,
    },
    macros::{btf_tracepoint, map},
    maps::PerCpuArray,
    programs::BtfTracePointContext,
};
use profiler_ebpf::{
    counter, is_wait_syscall, ran_flags, sleeps_interruptible, stack_for, waker, CpuRuns, EventKind,
    IrqNesting, KernelStackHeader, KernelStackRecord, LastWaker, OffCpuFold, OffCpuInterval, OffCpuStart,
    COMM_LEN, CPU_RUNS, FOLD_SPAN_NS, KERNEL_STACK_AT_SWITCH_IN, KERNEL_STACK_INLINE,
    KERNEL_STACK_SYSCALL_WAIT, MAX_STACK_DEPTH, TIMER_SOFTIRQS, USER_STACK_AT_EXIT_COPY,
    USER_STACK_AT_SWITCH_OUT, USER_STACK_NEXT, USER_STACK_WAKER_COPY, USER_STACK_WAKER_SAMPLED_OUT,
    WAKER_COPY_EVERY_NS,
};

use super::{
    count, count_lost_stacks, fold_under_ns, hint_exit_work, hint_target_tid, is_target, maybe_offcpu_target,
    min_futex_ns, min_offcpu_ns, offsets, stack_id, submit_flags,
    user_stack::{send_user_stack, user_regs_now, user_regs_of, UserRegsNow},
    user_stack_repeat_ns, BPF_F_USER_STACK, EVENTS, EXACT_TIDS, OFFCPU_START, TP_OFFSETS,
};

/// A sleep must have lasted this long at its wakeup for the waker's stacks
/// to be walked: half the smaller of the two reporting minimums.
#[inline(always)]
fn waker_stack_min_ns() -> u64 {
    let a = min_offcpu_ns();
    let b = min_futex_ns();
    (if a < b { a } else { b }) / 2
}

/// sched_switch as a BTF tracepoint: its arguments are the kernel's own
/// (`preempt`, `prev`, `next`, `prev_state`), read straight from the
/// context, and `next` is a task pointer the stack and register helpers
/// take. What an interval needs from the sleeping thread (its kernel
/// stack, its user registers) is read at its switch-in, only once it is
/// known to be long enough to report: a switch whose interval is short
/// costs two map lookups and a few stores. Every switch on the machine
/// also reads the clock and logs the run that ended in its CPU's
/// [`CpuRuns`] (who had the CPU while a thread of the target waited).
#[btf_tracepoint(function = "sched_switch")]
pub fn slotprof_switch(ctx: BtfTracePointContext) -> u32 {
    // Switch-out: `current` is still the previous task.
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // Every other switch on the machine stops at the runner update and
    // the two filters.
    let prev: *mut task_struct = ctx.arg(1);
    let now = unsafe { bpf_ktime_get_ns() };
    track_runner(prev, now);
    if is_target(tgid) {
        switch_out(&ctx, prev, pid_tgid as u32, tgid, now);
    }
    let next: *mut task_struct = ctx.arg(2);

    // Switch-in: only threads we saw leave have an interval open.
    let next_pid = task_pid(next);
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
    unsafe { (*p).start_ns = 0 };
    if start.waker_tid != 0 {
        // For the futex probe: who ended this thread's wait.
        unsafe {
            (*p).last_waker = LastWaker {
                tid: start.waker_tid,
                user_stack_id: start.waker_user_stack_id,
                context: start.waker_context,
                _pad: 0,
                comm: start.waker_comm,
            };
            (*p).last_woken_ns = start.woken_ns;
        }
    }
    if now.saturating_sub(start.start_ns) < min_offcpu_ns() {
        return 0;
    }
    // A blocked thread's registers, read once: its stack pointer for the
    // copy at the system call's exit, its call for the kernel stack, and
    // whether the wait folds.
    let regs = if start.user_sp == 0
        && (start.user_stack_id == USER_STACK_NEXT || start.kernel_stack_id == KERNEL_STACK_AT_SWITCH_IN)
    {
        user_regs_of(next)
    } else {
        None
    };
    if fold_interval(next, p, tid, &start, now, &regs) {
        return 0;
    }
    // What the thread folded before goes out before this interval.
    flush_fold(p, tid, start.tgid, next);
    switch_in_reported(next, p, tid, &start, now, regs);
    0
}

/// Folds a short wait of `tid` into its entry instead of reporting it
/// (see [`OffCpuFold`]): an interruptible sleep in a wait system call,
/// shorter than the folding bound, at the registers of the thread's last
/// stack copy at a system call exit within the repeat period (the exit
/// would send a repeat of that copy), of a thread not in `EXACT_TIDS`.
/// Folded waits of another call or place, or past [`FOLD_SPAN_NS`], go
/// out first. Returns whether this one was folded.
#[inline(always)]
fn fold_interval(
    next: *mut task_struct,
    p: *mut OffCpuStart,
    tid: u32,
    start: &OffCpuStart,
    now: u64,
    regs: &Option<UserRegsNow>,
) -> bool {
    let under = fold_under_ns();
    let d = now.saturating_sub(start.start_ns);
    if under == 0 || d >= under || !sleeps_interruptible(start.state) {
        return false;
    }
    let Some(r) = regs else {
        return false;
    };
    if !r.in_syscall || !is_wait_syscall(r.syscall_nr) {
        return false;
    }
    let (ip, sp, bp, at) = unsafe { ((*p).copy_ip, (*p).copy_sp, (*p).copy_bp, (*p).copy_ns) };
    let period = user_stack_repeat_ns();
    if at == 0 || period == 0 || now.wrapping_sub(at) >= period || r.ip != ip || r.sp != sp || r.bp != bp {
        return false;
    }
    if EXACT_TIDS.get_ptr(&tid).is_some() {
        return false;
    }
    unsafe {
        let f = core::ptr::addr_of_mut!((*p).fold);
        if (*f).intervals != 0
            && ((*f).syscall_nr != r.syscall_nr
                || (*f).ip != ip
                || (*f).sp != sp
                || (*f).bp != bp
                || (*f).state != start.state
                || now.saturating_sub((*f).first_start_ns) >= FOLD_SPAN_NS)
        {
            flush_fold(p, tid, start.tgid, next);
        }
        if (*f).intervals == 0 {
            (*f).first_start_ns = start.start_ns;
            (*f).offcpu_ns = 0;
            (*f).runnable_ns = 0;
            (*f).ip = ip;
            (*f).sp = sp;
            (*f).bp = bp;
            (*f).syscall_nr = r.syscall_nr;
            (*f).state = start.state;
        }
        (*f).intervals += 1;
        (*f).offcpu_ns += d;
        (*f).last_end_ns = now;
        if start.woken_ns > start.start_ns && start.woken_ns < now {
            (*f).runnable_ns += now - start.woken_ns;
        }
    }
    count(counter::OFFCPU_FOLDED);
    true
}

/// Sends `tid`'s folded waits, if it has any, as one [`OffCpuFold`]
/// (`task`: the thread, for its name), and empties its fold.
#[inline(always)]
fn flush_fold(p: *mut OffCpuStart, tid: u32, tgid: u32, task: *mut task_struct) {
    let f = unsafe { core::ptr::addr_of_mut!((*p).fold) };
    if unsafe { (*f).intervals } == 0 {
        return;
    }
    let Some(mut entry) = EVENTS.reserve::<OffCpuFold>(0) else {
        // Not lost from the totals: the fold stays, for the next try or
        // for userspace to read from the entry.
        count(counter::RING_FULL);
        return;
    };
    let e: *mut OffCpuFold = entry.as_mut_ptr();
    let off = offsets();
    unsafe {
        (*e).kind = EventKind::OffCpuFold as u32;
        (*e).cpu = bpf_get_smp_processor_id();
        (*e).first_start_ns = (*f).first_start_ns;
        (*e).last_end_ns = (*f).last_end_ns;
        (*e).tgid = tgid;
        (*e).tid = tid;
        (*e).offcpu_ns = (*f).offcpu_ns;
        (*e).runnable_ns = (*f).runnable_ns;
        (*e).intervals = (*f).intervals;
        (*e).kernel_stack_id = KERNEL_STACK_SYSCALL_WAIT - (*f).syscall_nr;
        (*e).user_stack_id = USER_STACK_AT_EXIT_COPY;
        (*e).state = (*f).state;
        (*e).ip = (*f).ip;
        (*e).sp = (*f).sp;
        (*e).bp = (*f).bp;
        read_comm(task, off.task_comm, &mut (*e).comm);
        (*f).intervals = 0;
    }
    entry.submit(submit_flags());
    count(counter::OFFCPU_FOLDS);
}

/// Logs in this CPU's [`CpuRuns`] that `prev` ran from the last switch to
/// `now`. Every switch on the machine does this (the clock, one per-CPU
/// array entry, three stores).
#[inline(always)]
fn track_runner(prev: *mut task_struct, now: u64) {
    let Some(c) = CPU_RUNS_MAP.get_ptr_mut(0) else {
        return;
    };
    let c = unsafe { &mut *c };
    if c.since_ns != 0 {
        let i = (c.count as usize) & (CPU_RUNS - 1);
        c.task[i] = prev as u64;
        c.from_ns[i] = c.since_ns;
        c.to_ns[i] = now;
        c.count += 1;
    }
    c.since_ns = now;
}

/// The last runs on each CPU.
#[map]
static CPU_RUNS_MAP: PerCpuArray<CpuRuns> = PerCpuArray::with_max_entries(1, 0);

/// Writes into `e`'s `ran_*` the task whose run on this CPU overlapped
/// `[from, to)` the most (not `me`, the thread that waited), read now: it
/// is among the last few to run here. tid 0: none found.
#[inline(always)]
unsafe fn write_runner(
    e: *mut OffCpuInterval,
    off: &profiler_ebpf::TracepointOffsets,
    me: *mut task_struct,
    from: u64,
    to: u64,
) {
    (*e).ran_tid = 0;
    (*e).ran_tgid = 0;
    (*e).ran_flags = 0;
    (*e).ran_comm = [0; COMM_LEN];
    let Some(c) = CPU_RUNS_MAP.get_ptr(0) else {
        return;
    };
    let (mut task, mut most) = (0u64, 0u64);
    for i in 0..CPU_RUNS {
        let t = (*c).task[i];
        let a = if (*c).from_ns[i] > from {
            (*c).from_ns[i]
        } else {
            from
        };
        let b = if (*c).to_ns[i] < to { (*c).to_ns[i] } else { to };
        if t != 0 && t != me as u64 && b > a && b - a > most {
            most = b - a;
            task = t;
        }
    }
    if task == 0 {
        return;
    }
    let task = task as *const u8;
    let read_u32 = |o: u32| bpf_probe_read_kernel(task.add(o as usize) as *const u32).unwrap_or(0);
    (*e).ran_tid = read_u32(off.task_pid);
    (*e).ran_tgid = read_u32(off.task_tgid);
    if read_u32(off.task_flags) & ran_flags::PF_KTHREAD != 0 {
        (*e).ran_flags = ran_flags::KTHREAD;
    }
    read_comm(task as *const task_struct, off.task_comm, &mut (*e).ran_comm);
}

/// `task->comm` into `out` (zeros if unreadable).
#[inline(always)]
unsafe fn read_comm(task: *const task_struct, at: u32, out: &mut [u8; COMM_LEN]) {
    if bpf_probe_read_kernel_buf((task as *const u8).add(at as usize), out).is_err() {
        *out = [0; COMM_LEN];
    }
}

/// A thread of the target leaves its CPU at `now`: its entry records when
/// and how. `prev_state` 0 (runnable: preempted, or yielded) is reported
/// as state 0; blocked states as the kernel's `prev_state`.
#[inline(always)]
fn switch_out(ctx: &BtfTracePointContext, prev: *mut task_struct, tid: u32, tgid: u32, now: u64) {
    let preempt: u64 = ctx.arg(0);
    let prev_state: u64 = ctx.arg(3);
    let state = if preempt & 0xff != 0 { 0 } else { prev_state as u32 };
    // The kernel stack is decided at the switch-in, if the interval is
    // reported (the task's kernel stack stays as it is now): named by its
    // waiting system call, or walked.
    let kernel_stack_id = KERNEL_STACK_AT_SWITCH_IN;
    // The user stack. A thread that blocked went to sleep inside a system
    // call (or, rarely, a page fault): its registers are read at the
    // switch-in if reported, and its stack copied at the call's exit. A
    // runnable one was preempted, maybe in user mode, where nothing in its
    // context comes before it runs user code again: copied now unless it
    // is inside a system call.
    let (mut user_ip, mut user_sp, mut user_bp) = (0, 0, 0);
    let mut user_stack_id = USER_STACK_NEXT;
    if state == 0 {
        match user_regs_now() {
            Some(r) => {
                (user_ip, user_sp, user_bp) = (r.ip, r.sp, r.bp);
                if !r.in_syscall {
                    if send_user_stack(&r, stack_for::SWITCH_OUT, now) {
                        count(counter::USER_STACKS_AT_SWITCH_OUT);
                    }
                    user_stack_id = USER_STACK_AT_SWITCH_OUT;
                }
            }
            None => user_stack_id = -14,
        }
    }
    match OFFCPU_START.get_ptr_mut(&tid) {
        // The thread's entry from its earlier intervals: rewritten in
        // place, field by field (its deferred stack and last waker stay
        // for the system call exit that reads them).
        Some(p) => unsafe {
            // Folded waits go out once the first is a span old (a thread
            // that stops folding sends its last ones at its next
            // reported interval, or userspace reads them from here).
            if (*p).fold.intervals != 0 && now.saturating_sub((*p).fold.first_start_ns) >= FOLD_SPAN_NS {
                flush_fold(p, tid, tgid, prev);
            }
            (*p).user_ip = user_ip;
            (*p).user_sp = user_sp;
            (*p).user_bp = user_bp;
            (*p).user_stack_id = user_stack_id;
            (*p).kernel_stack_id = kernel_stack_id;
            (*p).state = state;
            (*p).waker_tid = 0;
            (*p).waker_tgid = 0;
            (*p).tgid = tgid;
            (*p).waker_context = waker::NOT_TAKEN;
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
                state,
                tgid,
                ..OffCpuStart::IDLE
            };
            hint_target_tid(tid);
            if OFFCPU_START.insert(&tid, &start, 0).is_err() {
                count(counter::OFFCPU_START_LOST);
            }
        }
    }
}

/// The switch-in of an interval long enough to report: its stacks are
/// taken from the sleeping task `next` (not running yet), then the
/// interval goes out.
#[inline(always)]
fn switch_in_reported(
    next: *mut task_struct,
    p: *mut OffCpuStart,
    tid: u32,
    start: &OffCpuStart,
    now: u64,
    regs: Option<UserRegsNow>,
) {
    let mut user_stack_id = start.user_stack_id;
    let mut kernel_stack_id = start.kernel_stack_id;
    if user_stack_id == USER_STACK_NEXT {
        // Its stack is copied at its system call's exit, where its stack
        // pointer must still be the one saved when it entered the kernel.
        let sp = if start.user_sp != 0 {
            start.user_sp
        } else {
            match regs {
                Some(r) if r.in_syscall => r.sp,
                // Asleep outside a system call (a page fault): no exit to
                // copy it at.
                _ => 0,
            }
        };
        if sp != 0 {
            unsafe { (*p).pending_sp = sp };
            hint_exit_work(tid);
        } else {
            user_stack_id = -14;
        }
    }
    if kernel_stack_id == KERNEL_STACK_AT_SWITCH_IN {
        kernel_stack_id = match regs {
            Some(r) if sleeps_interruptible(start.state) && r.in_syscall && is_wait_syscall(r.syscall_nr) => {
                KERNEL_STACK_SYSCALL_WAIT - r.syscall_nr
            }
            _ => send_kernel_stack(next, tid, start.start_ns),
        };
    }
    let Some(mut entry) = EVENTS.reserve::<OffCpuInterval>(0) else {
        count(counter::RING_FULL);
        return;
    };
    // Written in place, field by field: the record (and the task names
    // read into it) never sits on the BPF stack, whose 512 bytes the
    // switch program and its calls share (6.1's verifier counts them).
    let e: *mut OffCpuInterval = entry.as_mut_ptr();
    let off = offsets();
    unsafe {
        (*e).kind = EventKind::OffCpu as u32;
        (*e).cpu = bpf_get_smp_processor_id();
        (*e).start_ns = start.start_ns;
        (*e).end_ns = now;
        (*e).tgid = start.tgid;
        (*e).tid = tid;
        (*e).user_stack_id = user_stack_id;
        (*e).kernel_stack_id = kernel_stack_id;
        (*e).state = start.state;
        (*e).waker_tid = start.waker_tid;
        (*e).waker_tgid = start.waker_tgid;
        (*e).waker_context = start.waker_context;
        (*e).waker_comm = start.waker_comm;
        (*e).woken_ns = start.woken_ns;
        (*e)._pad = 0;
        read_comm(next, off.task_comm, &mut (*e).comm);
        // Who had the CPU while it waited: from its preemption, or its
        // wakeup (from its sleep's start if the wakeup was not seen).
        let from = if start.state != 0 && start.woken_ns != 0 {
            start.woken_ns
        } else {
            start.start_ns
        };
        write_runner(e, &off, next, from, now);
    }
    entry.submit(submit_flags());
    count(counter::OFFCPU_INTERVALS);
    count_lost_stacks(&[kernel_stack_id]);
}

/// Walks the kernel stack of `task` (asleep) and sends it as the record
/// before its interval. Returns the interval's kernel stack id:
/// [`KERNEL_STACK_INLINE`], or the walk's negative errno.
#[inline(always)]
fn send_kernel_stack(task: *mut task_struct, tid: u32, start_ns: u64) -> i32 {
    let Some(rec) = KERNEL_STACK_SCRATCH.get_ptr_mut(0) else {
        return -12;
    };
    let rec = unsafe { &mut *rec };
    let size = (MAX_STACK_DEPTH * 8) as u32;
    let n = unsafe { bpf_get_task_stack(task, rec.ips.as_mut_ptr().cast(), size, 0) };
    if n <= 0 {
        return if n < 0 { n as i32 } else { -14 };
    }
    let len = (n as usize) & (MAX_STACK_DEPTH * 8 * 2 - 1);
    rec.header = KernelStackHeader {
        kind: EventKind::KernelStack as u32,
        tid,
        start_ns,
        len: len as u32,
        _pad: 0,
    };
    let total = core::mem::size_of::<KernelStackHeader>() + len;
    if total > core::mem::size_of::<KernelStackRecord>() {
        return -7;
    }
    let bytes = unsafe { core::slice::from_raw_parts((rec as *const KernelStackRecord).cast::<u8>(), total) };
    if EVENTS.output::<[u8]>(bytes, submit_flags()).is_err() {
        count(counter::RING_FULL);
        return -28;
    }
    KERNEL_STACK_INLINE
}

/// Where a kernel stack record is built (1 KiB: too big for the BPF stack).
#[map]
static KERNEL_STACK_SCRATCH: PerCpuArray<KernelStackRecord> = PerCpuArray::with_max_entries(1, 0);

/// `task->pid`, by a direct load the verifier checks against the kernel's
/// BTF (the offset is a constant of the read-only data, set from that BTF
/// at load time): no helper call at every switch and wakeup.
#[inline(always)]
fn task_pid(task: *const task_struct) -> i32 {
    let off = unsafe { core::ptr::read_volatile(core::ptr::addr_of!(TP_OFFSETS.task_pid)) };
    unsafe { core::ptr::read_volatile((task as *const u8).add(off as usize) as *const i32) }
}

/// sched_waking as a BTF tracepoint (`p`, the task being woken): it runs
/// in the waker's context.
#[btf_tracepoint(function = "sched_waking")]
pub fn slotprof_waking(ctx: BtfTracePointContext) -> u32 {
    let woken: *const task_struct = ctx.arg(0);
    let pid = task_pid(woken);
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
    // or device interrupt it is whoever was interrupted. The per-CPU
    // interrupt nesting tells which, and the task's saved registers which
    // system call it was in. Only a sleep already long enough to be
    // reported, or nearly (half the smaller minimum: the wait for a CPU
    // after the wakeup can make up the rest), gets its waker described:
    // most wakeups end short sleeps.
    let pid_tgid = bpf_get_current_pid_tgid();
    let now = unsafe { bpf_ktime_get_ns() };
    let asleep = now.saturating_sub(unsafe { (*start).start_ns });
    // The waker's user stack only for a thread in a futex wait: only the
    // futex record (lock contention: who held the lock) carries it.
    let (waker_context, waker_user_stack_id) = if asleep >= waker_stack_min_ns() {
        let context = wakeup_context();
        let in_futex = unsafe { (*start).futex.start_ns } != 0;
        // The waker's user stack only from a task (in an interrupt it is
        // whoever was interrupted). A thread of the target gets its stack
        // copied here, in its own context, and unwound with CFI like every
        // other stack (no frame pointers needed); another process's waker
        // gets the kernel's frame-pointer walk.
        let user = if in_futex && waker::is_task(context) {
            if is_target((pid_tgid >> 32) as u32) {
                if waker_copy_due(pid_tgid as u32, now) {
                    match user_regs_now() {
                        Some(regs) if send_user_stack(&regs, stack_for::WAKER, now) => USER_STACK_WAKER_COPY,
                        _ => -1,
                    }
                } else {
                    USER_STACK_WAKER_SAMPLED_OUT
                }
            } else {
                stack_id(&ctx, BPF_F_USER_STACK)
            }
        } else {
            -1
        };
        (context, user)
    } else {
        (waker::NOT_TAKEN, -1)
    };
    unsafe {
        (*start).woken_ns = now;
        (*start).waker_context = waker_context;
        (*start).waker_user_stack_id = waker_user_stack_id;
        (*start).waker_tid = pid_tgid as u32;
        (*start).waker_tgid = (pid_tgid >> 32) as u32;
        (*start).waker_comm = bpf_get_current_comm().unwrap_or([0; COMM_LEN]);
    }
    0
}

/// Whether the waking thread `tid` (the current one) is due a copy of its
/// stack as a waker (at most one per [`WAKER_COPY_EVERY_NS`]); marks it
/// taken. A thread without an entry (it never slept) is always due.
#[inline(always)]
fn waker_copy_due(tid: u32, now: u64) -> bool {
    let Some(me) = OFFCPU_START.get_ptr_mut(&tid) else {
        return true;
    };
    unsafe {
        if (*me).waker_copy_ns != 0 && now.saturating_sub((*me).waker_copy_ns) < WAKER_COPY_EVERY_NS {
            return false;
        }
        (*me).waker_copy_ns = now;
    }
    true
}

/// Interrupt nesting of each CPU: the wakeup probe reads it to tell a
/// wakeup from a timer, a device or a softirq (where `current` is only the
/// interrupted task) from a task's own.
#[map]
static IRQ_NESTING: PerCpuArray<IrqNesting> = PerCpuArray::with_max_entries(1, 0);

/// `field` of this CPU's nesting, changed by `f` (saturating: a probe
/// attached mid-interrupt sees an exit without its entry).
#[inline(always)]
fn nesting(f: impl FnOnce(&mut IrqNesting)) -> u32 {
    if let Some(n) = IRQ_NESTING.get_ptr_mut(0) {
        f(unsafe { &mut *n });
    }
    0
}

#[btf_tracepoint(function = "irq_handler_entry")]
pub fn slotprof_hardirq_entry(_ctx: BtfTracePointContext) -> u32 {
    nesting(|n| n.hardirq += 1)
}

#[btf_tracepoint(function = "irq_handler_exit")]
pub fn slotprof_hardirq_exit(_ctx: BtfTracePointContext) -> u32 {
    nesting(|n| n.hardirq = n.hardirq.saturating_sub(1))
}

#[btf_tracepoint(function = "hrtimer_expire_entry")]
pub fn slotprof_hrtimer_entry(_ctx: BtfTracePointContext) -> u32 {
    nesting(|n| n.hrtimer += 1)
}

#[btf_tracepoint(function = "hrtimer_expire_exit")]
pub fn slotprof_hrtimer_exit(_ctx: BtfTracePointContext) -> u32 {
    nesting(|n| n.hrtimer = n.hrtimer.saturating_sub(1))
}

#[btf_tracepoint(function = "softirq_entry")]
pub fn slotprof_softirq_entry(ctx: BtfTracePointContext) -> u32 {
    softirq(&ctx, true)
}

#[btf_tracepoint(function = "softirq_exit")]
pub fn slotprof_softirq_exit(ctx: BtfTracePointContext) -> u32 {
    softirq(&ctx, false)
}

/// A softirq vector (the tracepoints' one argument) starts or ends.
#[inline(always)]
fn softirq(ctx: &BtfTracePointContext, entry: bool) -> u32 {
    let vec: u32 = ctx.arg(0);
    let bit = 1u32.wrapping_shl(vec & 31);
    nesting(|n| {
        if entry {
            n.softirq += 1;
            n.softirq_vecs |= bit;
        } else {
            n.softirq = n.softirq.saturating_sub(1);
            n.softirq_vecs &= !bit;
        }
    })
}

/// Where the running wakeup is ([`waker`]): an interrupt from this CPU's
/// nesting, else the current task's system call from its saved registers.
#[inline(always)]
fn wakeup_context() -> i32 {
    if let Some(n) = IRQ_NESTING.get_ptr(0) {
        let n = unsafe { *n };
        if n.hrtimer > 0 {
            return waker::TIMER;
        }
        if n.hardirq > 0 {
            return waker::HARDIRQ;
        }
        if n.softirq > 0 {
            return if n.softirq_vecs & TIMER_SOFTIRQS != 0 {
                waker::TIMER
            } else {
                waker::SOFTIRQ
            };
        }
    }
    match user_regs_now() {
        None => waker::KERNEL_THREAD,
        Some(r) if r.in_syscall && r.syscall_nr >= 0 => r.syscall_nr,
        Some(_) => waker::TASK,
    }
}
