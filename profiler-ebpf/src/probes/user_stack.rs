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

use aya_ebpf::{
    bindings::task_struct,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel,
        generated::{bpf_get_current_task_btf, bpf_probe_read_user, bpf_task_pt_regs},
    },
    macros::map,
    maps::LruHashMap,
};
use profiler_ebpf::{
    counter, reg, stack_for, EventKind, OffCpuStart, UserStackHeader, OFFCPU_MAP_ENTRIES, PT_REGS_WORDS,
    RING_BYTES, USER_STACK_BYTES,
};

use super::{count, submit_flags, EVENTS};

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

/// A user stack record of `N` stack bytes, reserved in the ring itself: the
/// stack is read from user memory straight into it (one copy; building it
/// in per-CPU scratch first and copying that into the ring doubled the
/// kernel's memory traffic for every stack).
#[repr(C)]
struct StackRecord<const N: usize> {
    header: UserStackHeader,
    stack: [u8; N],
}

/// Copies the current thread's user stack into a record and sends it.
/// Returns whether anything was copied.
#[inline(always)]
pub fn send_user_stack(regs: &UserRegsNow, why: u32, start_ns: u64) -> bool {
    let pid_tgid = bpf_get_current_pid_tgid();
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
    // A ring over half full (a reader that cannot keep up: a slow
    // machine, a burst) gets no more big copies: the small records that
    // come with and after them keep the room.
    const BPF_RB_AVAIL_DATA: u64 = 0;
    let busy = EVENTS.query(BPF_RB_AVAIL_DATA) >= (RING_BYTES / 2) as u64;
    if busy && sp != 0 {
        count(counter::USER_STACK_RING_BUSY);
    }
    let header = UserStackHeader {
        kind: EventKind::UserStack as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: unsafe { bpf_ktime_get_ns() },
        tgid: (pid_tgid >> 32) as u32,
        tid,
        ip: regs.ip,
        sp,
        bp: regs.bp,
        len: 0,
        why: why | bounded,
        start_ns,
    };
    // The copy is `want` bytes rounded up to whole 4 KiB pieces, each at a
    // fixed offset of a record reserved for that many; a piece that runs
    // past the end of the stack mapping is read up to the end instead.
    let pages = if sp == 0 || busy { 0 } else { want.div_ceil(4096) };
    let flags = submit_flags();
    let len = match pages {
        0 => copy_and_send::<0>(sp, want, header, flags),
        1 => copy_and_send::<4096>(sp, want, header, flags),
        2 => copy_and_send::<8192>(sp, want, header, flags),
        3 => copy_and_send::<12288>(sp, want, header, flags),
        _ => copy_and_send::<USER_STACK_BYTES>(sp, want, header, flags),
    };
    if len == Some(0) && sp != 0 && !busy {
        count(counter::USER_STACK_COPY_FAILED);
    }
    len.is_some_and(|l| l > 0)
}

/// Reserves a record of `N` stack bytes, reads the stack at `sp` into it
/// (at most `want` bytes are kept) and submits it. Returns the bytes kept,
/// or None when the ring had no room.
#[inline(always)]
fn copy_and_send<const N: usize>(
    sp: u64,
    want: usize,
    mut header: UserStackHeader,
    flags: u64,
) -> Option<u32> {
    let Some(mut entry) = EVENTS.reserve::<StackRecord<N>>(0) else {
        count(counter::RING_FULL);
        return None;
    };
    let rec = entry.as_mut_ptr();
    let mut len: usize = 0;
    let base = unsafe { core::ptr::addr_of_mut!((*rec).stack) }.cast::<u8>();
    // Pieces at constant offsets (the verifier follows each one).
    let mut piece = 0;
    while piece < N / 4096 && len < want {
        let off = piece * 4096;
        let src = sp + off as u64;
        // No more than `want`: a stack bounded by its outermost frame is
        // read to there and no further (on average half a piece less).
        let left = want - len;
        let size = if left < 4096 { left as u32 } else { 4096 };
        if unsafe { bpf_probe_read_user(base.add(off).cast(), size, src as *const _) } == 0 {
            len = off + size as usize;
        } else {
            // The end of the mapping is in this piece: up to its page end.
            let rest = 4096 - (src & 4095) as u32;
            if unsafe { bpf_probe_read_user(base.add(off).cast(), rest, src as *const _) } == 0 {
                len = off + rest as usize;
            }
            break;
        }
        piece += 1;
    }
    let len = if len > want { want } else { len };
    header.len = len.min(USER_STACK_BYTES) as u32;
    unsafe { core::ptr::addr_of_mut!((*rec).header).write(header) };
    entry.submit(flags);
    Some(header.len)
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
        Some(regs) if regs.sp == want_sp => {
            if send_user_stack(&regs, stack_for::SYSCALL_EXIT, 0) {
                count(counter::USER_STACKS_AT_EXIT);
            }
        }
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
        Some(regs) => {
            if send_user_stack(&regs, stack_for::SYSCALL_EXIT, 0) {
                count(counter::USER_STACKS_AT_EXIT);
            }
        }
        None => send_no_stack(stack_for::SYSCALL_EXIT),
    }
}
