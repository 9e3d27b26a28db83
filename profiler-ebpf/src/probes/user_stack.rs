//! User stacks as copies: the registers and the top of the stack go to
//! userspace, which unwinds them with each module's CFI (binaries without
//! frame pointers: release builds, Rust's std, glibc, jemalloc).
//!
//! A copy is only made for what will be reported: a cpu-clock sample, a
//! futex wait or madvise call being emitted, and an off-CPU interval that
//! turned out long enough. The interval's length is known only at its
//! switch-in, when the thread is not running; but a thread that blocked in
//! a system call goes back to user space through that call's exit, with
//! the user stack it had when it blocked, so its stack is copied there
//! (`slotprof_sys_exit`), in its own context. A thread switched out
//! outside a system call (preempted, or asleep in a page fault) has no
//! such exit: its stack is copied at the switch-out.
//!
//! Most reported intervals on a validator are idle workers going back to
//! the same wait (a channel receive, a condvar) from the same frames, many
//! times a second. An exit whose `ip`, `sp` and `bp` equal the thread's
//! last exit copy, less than `USER_STACK_REPEAT_NS` after it, sends a
//! header marked `stack_for::REPEAT` instead of copying the stack again;
//! userspace gives it that copy's stack. The period bounds how long a
//! different call chain that reached the same instruction at the same
//! stack depth (possible, not seen) could be given the earlier chain.

use aya_ebpf::{
    bindings::task_struct,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel,
        generated::{bpf_get_current_task_btf, bpf_probe_read_user, bpf_task_pt_regs},
    },
    macros::map,
    maps::{Array, LruHashMap, PerCpuArray},
};
use profiler_ebpf::{
    counter, reg, stack_for, EventKind, OffCpuStart, UserStackHeader, UserStackRecord, OFFCPU_MAP_ENTRIES,
    PENDING_RETURNS, PT_REGS_WORDS, RING_BYTES, USER_STACK_BYTES,
};

use super::{count, submit_flags, user_stack_repeat_ns, EVENTS, URET_PENDING};

/// Where a record is built, one per CPU, indexed by the CPU's number (too
/// big for the BPF stack, and for a per-CPU array: the kernel caps a
/// per-CPU value at 32 KiB). Userspace sizes it to the possible CPUs; a
/// program runs with migration disabled, so
/// the entry stays this CPU's for the copy, as a per-CPU value would.
#[map]
static USER_STACK_SCRATCH: Array<UserStackRecord> = Array::with_max_entries(1, 0);

/// Set while this CPU makes a copy in the scratch record. A cpu-clock
/// sample is a hardware-interrupt-time program that can interrupt a
/// tracepoint's copy on the same CPU (BTF tracepoints do not take the
/// per-CPU BPF recursion guard the perf program checks): its own copy
/// would overwrite the record under the interrupted one, and userspace
/// would give the waiting records the sample's stack and lose the exit
/// copy (the copies' length, and a slow emulated CPU, widen that window).
#[map]
static USER_STACK_BUSY: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Where each thread's outermost frame ends (userspace writes it after a
/// complete unwind): copies stop there.
#[map]
static USER_STACK_TOP: LruHashMap<u32, u64> = LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

/// The user registers of the current thread, as saved at its last entry to
/// the kernel (system call, interrupt or exception).
#[derive(Clone, Copy)]
pub struct UserRegsNow {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Whether the thread entered the kernel by the 64-bit `syscall`
    /// instruction (it will leave through a system call exit): `orig_ax`
    /// holds a system call number and `cx` the return address, which the
    /// instruction put there. Interrupts store -1 in `orig_ax`; exceptions
    /// store an error code, but not the return address in `cx`.
    pub in_syscall: bool,
    /// The system call number when `in_syscall`.
    pub syscall_nr: i32,
}

#[inline(always)]
pub fn user_regs_now() -> Option<UserRegsNow> {
    user_regs_of(unsafe { bpf_get_current_task_btf() })
}

/// The user registers of `task` (the current one, or one that is not
/// running: they stay as saved until it runs again).
#[inline(always)]
pub fn user_regs_of(task: *mut task_struct) -> Option<UserRegsNow> {
    let regs = unsafe { bpf_task_pt_regs(task) } as *const [u64; PT_REGS_WORDS];
    if regs.is_null() {
        return None;
    }
    // One read of the whole `struct pt_regs` (168 bytes).
    let r = unsafe { bpf_probe_read_kernel(regs) }.ok()?;
    if r[reg::CS] & 3 != 3 {
        return None; // a kernel thread: no user context
    }
    Some(UserRegsNow {
        ip: r[reg::RIP],
        sp: r[reg::RSP],
        bp: r[reg::RBP],
        in_syscall: (r[reg::ORIG_RAX] as i64) >= 0 && r[reg::RCX] == r[reg::RIP],
        syscall_nr: r[reg::ORIG_RAX] as i32,
    })
}

/// Copies the current thread's user stack into a record and sends it.
/// Returns whether anything was copied. Nothing is sent while this CPU is
/// already making a copy (see [`USER_STACK_BUSY`]): the record waiting for
/// this copy gets that one, which is of the same thread.
#[inline(always)]
pub fn send_user_stack(regs: &UserRegsNow, why: u32, start_ns: u64) -> bool {
    let Some(busy) = USER_STACK_BUSY.get_ptr_mut(0) else {
        return false;
    };
    if unsafe { *busy } != 0 {
        count(counter::USER_STACK_NESTED);
        return false;
    }
    unsafe { *busy = 1 };
    let sent = copy_and_send(regs, why, start_ns);
    unsafe { *busy = 0 };
    sent
}

#[inline(always)]
fn copy_and_send(regs: &UserRegsNow, why: u32, start_ns: u64) -> bool {
    let Some(rec) = USER_STACK_SCRATCH.get_ptr_mut(unsafe { bpf_get_smp_processor_id() }) else {
        return false;
    };
    let pid_tgid = bpf_get_current_pid_tgid();
    let rec = unsafe { &mut *rec };
    // Read through a volatile load: with constant registers (the empty
    // record of `send_no_stack`) LLVM would zero the header's fields with
    // a call to memset on the map value, which 6.1's verifier rejects
    // ("reg type unsupported for arg#0").
    let regs = unsafe { core::ptr::read_volatile(regs) };
    let sp = regs.sp;
    let tid = pid_tgid as u32;
    // How much to copy: up to the thread's outermost frame when userspace
    // has learnt where that is (it never moves for a thread's life), else
    // the most we copy. A thread's idle stack is a few KiB; its mapping
    // (and the TLS glibc keeps at its top) goes on well past that.
    let mut want = USER_STACK_BYTES;
    let mut bounded = 0;
    if let Some(top) = USER_STACK_TOP.get_ptr(&tid) {
        let top = unsafe { *top };
        if top > sp && top - sp < USER_STACK_BYTES as u64 {
            want = (top - sp) as usize;
            bounded = stack_for::BOUNDED;
        }
    }
    // The first piece ends at the page boundary above sp, then whole pages
    // until one cannot be read (the end of the stack mapping) or `want`
    // is reached; what was read past `want` is not sent. Whole pages at
    // masked offsets: the shape 6.1's verifier can follow (a variable last
    // chunk made it lose the offset's bounds).
    let first = (4096 - (sp & 4095)) as u32;
    let mut len: usize = 0;
    let base = rec.stack.as_mut_ptr();
    // A ring over half full (a reader that cannot keep up: a slow
    // machine, a burst) gets no more big copies: the small records that
    // come with and after them keep the room.
    const BPF_RB_AVAIL_DATA: u64 = 0;
    let busy = EVENTS.query(BPF_RB_AVAIL_DATA) >= (RING_BYTES / 2) as u64;
    if busy && sp != 0 {
        count(counter::USER_STACK_RING_BUSY);
    }
    if sp != 0 && !busy && unsafe { bpf_probe_read_user(base.cast(), first, sp as *const _) } == 0 {
        len = first as usize;
        let mut page = 0;
        while page < USER_STACK_BYTES / 4096 - 1 && len < want {
            // Masked so the verifier sees the bound (the record has a
            // page of slack past USER_STACK_BYTES for exactly this).
            let off = len & (USER_STACK_BYTES - 1);
            if unsafe { bpf_probe_read_user(base.add(off).cast(), 4096, (sp + off as u64) as *const _) } != 0
            {
                break;
            }
            len = off + 4096;
            page += 1;
        }
    }
    let len = if len > want { want } else { len };
    let len = len.min(USER_STACK_BYTES) as u32;
    if len > 0 {
        mend_pending_returns(tid, sp, len as u64, base);
    }
    if len == 0 && sp != 0 && !busy {
        count(counter::USER_STACK_COPY_FAILED);
    }
    rec.header = UserStackHeader {
        kind: EventKind::UserStack as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        ip: regs.ip,
        sp,
        bp: regs.bp,
        len,
        why: why | bounded,
        start_ns,
    };
    let total = core::mem::size_of::<UserStackHeader>() + (len as usize & (USER_STACK_BYTES * 2 - 1));
    if total > core::mem::size_of::<UserStackRecord>() {
        return false;
    }
    let bytes = unsafe { core::slice::from_raw_parts((rec as *const UserStackRecord).cast::<u8>(), total) };
    if EVENTS.output::<[u8]>(bytes, submit_flags()).is_err() {
        count(counter::RING_FULL);
        return false;
    }
    len > 0
}

/// Puts back, in a copy of `tid`'s stack from `sp` (`len` bytes at
/// `base`), the return addresses the kernel replaced with its uretprobe
/// trampoline for calls still running: unwinding then goes on to their
/// callers instead of stopping at the trampoline.
#[inline(always)]
fn mend_pending_returns(tid: u32, sp: u64, len: u64, base: *mut u8) {
    let Some(p) = URET_PENDING.get_ptr(&tid) else {
        return;
    };
    let p = unsafe { &*p };
    let n = (p.n as usize).min(PENDING_RETURNS);
    for i in 0..PENDING_RETURNS {
        // A volatile index, as in `push_return` (a moving pointer is what
        // LLVM makes of it otherwise, and the verifier cannot bound it).
        let i = unsafe { core::ptr::read_volatile(&i) } & (PENDING_RETURNS - 1);
        if i >= n {
            break;
        }
        let slot = p.slot[i];
        if slot >= sp && slot + 8 <= sp + len {
            let off = ((slot - sp) as usize) & (USER_STACK_BYTES - 1);
            unsafe { core::ptr::write_unaligned(base.add(off).cast::<u64>(), p.ret[i]) };
        }
    }
}

/// Sends an empty stack record (the copy could not be made): userspace
/// learns that the thread's waiting records get no stack.
#[inline(always)]
pub fn send_no_stack(why: u32) {
    let regs = UserRegsNow {
        ip: 0,
        sp: 0,
        bp: 0,
        in_syscall: false,
        syscall_nr: -1,
    };
    send_user_stack(&regs, why, 0);
}

/// Takes a deferred stack now if one is pending for the current thread
/// (its system call is returning; `OffCpuStart::pending_sp`, set at the
/// switch-in of a reported interval). Returns whether one was pending.
#[inline(always)]
pub fn take_pending_user_stack(p: *mut OffCpuStart) -> bool {
    let want_sp = unsafe { (*p).pending_sp };
    if want_sp == 0 {
        return false;
    }
    unsafe { (*p).pending_sp = 0 };
    match user_regs_now() {
        Some(regs) if regs.sp == want_sp => send_exit_stack(Some(p), &regs),
        _ => {
            count(counter::USER_STACK_CONTEXT_CHANGED);
            send_no_stack(stack_for::SYSCALL_EXIT);
        }
    }
    true
}

/// At a system call exit that emitted a record marked
/// [`profiler_ebpf::USER_STACK_NEXT`]: copies the stack once, for that
/// record and for a deferred interval of the same call if there is one.
#[inline(always)]
pub fn send_stack_at_syscall_exit(entry: Option<*mut OffCpuStart>) {
    if let Some(p) = entry {
        unsafe { (*p).pending_sp = 0 };
    }
    match user_regs_now() {
        Some(regs) => send_exit_stack(entry, &regs),
        None => send_no_stack(stack_for::SYSCALL_EXIT),
    }
}

/// The current thread's stack at a system call exit: a repeat of its last
/// copy here if it is back at the same place soon after (the common case
/// of an idle worker returning to its wait: no copy, a header only), else
/// a copy, remembered in its entry.
#[inline(always)]
fn send_exit_stack(entry: Option<*mut OffCpuStart>, regs: &UserRegsNow) {
    let now = unsafe { bpf_ktime_get_ns() };
    let period = user_stack_repeat_ns();
    if let Some(p) = entry {
        let (ip, sp, bp, at) = unsafe { ((*p).copy_ip, (*p).copy_sp, (*p).copy_bp, (*p).copy_ns) };
        if period != 0
            && at != 0
            && now.wrapping_sub(at) < period
            && ip == regs.ip
            && sp == regs.sp
            && bp == regs.bp
            && send_repeat(regs, now)
        {
            count(counter::USER_STACK_REPEATS);
            return;
        }
    }
    if send_user_stack(regs, stack_for::SYSCALL_EXIT, 0) {
        count(counter::USER_STACKS_AT_EXIT);
        if let Some(p) = entry {
            unsafe {
                (*p).copy_ip = regs.ip;
                (*p).copy_sp = regs.sp;
                (*p).copy_bp = regs.bp;
                (*p).copy_ns = now;
            }
        }
    }
}

/// Sends the header of a [`stack_for::REPEAT`] (no stack bytes).
#[inline(always)]
fn send_repeat(regs: &UserRegsNow, now: u64) -> bool {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(mut entry) = EVENTS.reserve::<UserStackHeader>(0) else {
        count(counter::RING_FULL);
        return false;
    };
    entry.write(UserStackHeader {
        kind: EventKind::UserStack as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: now,
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        ip: regs.ip,
        sp: regs.sp,
        bp: regs.bp,
        len: 0,
        why: stack_for::SYSCALL_EXIT | stack_for::REPEAT,
        start_ns: 0,
    });
    entry.submit(submit_flags());
    true
}
