//! Program-cache work of the target's threads: a uprobe at the entry and a
//! uretprobe at the return of each of the runtime's program-cache functions
//! (loading, verifying, JIT-compiling, evicting programs), attached at
//! every address that function has in the binary (one per
//! monomorphization), the attach cookie saying which kind of work it is.
//! Only the outermost call of a kind is timed (a kind's function calling
//! itself, or two of its monomorphizations nesting, is one piece of work).

use aya_ebpf::{
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id,
        bpf_ktime_get_ns, bpf_probe_read_user,
    },
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use profiler_ebpf::{
    cache_work, counter, CacheWork, CacheWorkStart, EventKind, PendingReturns, COMM_LEN, PENDING_RETURNS,
};

use super::{
    count, is_target, submit_flags, user_stack::user_regs_now, CACHE_WORK_START, EVENTS, URET_PENDING,
};

/// Keeps the return address the kernel is about to replace with its
/// uretprobe trampoline (this program runs before it does), with where it
/// is on the stack: every call, nested or not, gets a trampoline. Entries
/// at or below the new one's stack address are of calls that are gone
/// (a panic unwound through them): dropped, as the kernel drops its own.
#[inline(always)]
fn push_return(tid: u32) {
    let Some(regs) = user_regs_now() else { return };
    let Ok(ret) = (unsafe { bpf_probe_read_user(regs.sp as *const u64) }) else {
        return;
    };
    let p = match URET_PENDING.get_ptr_mut(&tid) {
        Some(p) => p,
        None => {
            if URET_PENDING.insert(&tid, &PendingReturns::default(), 0).is_err() {
                return;
            }
            match URET_PENDING.get_ptr_mut(&tid) {
                Some(p) => p,
                None => return,
            }
        }
    };
    let p = unsafe { &mut *p };
    // Every index is read back through a volatile load and masked: LLVM
    // would otherwise drop a mask it can prove redundant (or walk the
    // array with a moving pointer), and the verifiers (6.1's above all)
    // cannot follow what it leaves.
    let volatile = |n: &u32| unsafe { core::ptr::read_volatile(n) };
    let mut n = p.n.min(PENDING_RETURNS as u32);
    for _ in 0..PENDING_RETURNS {
        let top = volatile(&n);
        if top == 0 || p.slot[((top - 1) & (PENDING_RETURNS as u32 - 1)) as usize] > regs.sp {
            break;
        }
        n = top - 1;
    }
    if volatile(&n) < PENDING_RETURNS as u32 {
        let i = (volatile(&n) & (PENDING_RETURNS as u32 - 1)) as usize;
        p.slot[i] = regs.sp;
        p.ret[i] = ret;
        n = i as u32 + 1;
    }
    // Deeper than the list holds: the innermost calls are not mended.
    p.n = n;
}

/// The innermost pending call returned (its uretprobe ran).
#[inline(always)]
fn pop_return(tid: u32) {
    if let Some(p) = URET_PENDING.get_ptr_mut(&tid) {
        unsafe {
            if (*p).n > 0 {
                (*p).n -= 1;
            }
        }
    }
}

/// The kind this attachment was made for, and the thread's key for it.
#[inline(always)]
fn key_of<C: EbpfContext>(ctx: &C, tid: u32) -> Option<(u32, u64)> {
    let what = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    (what > 0 && what < cache_work::KINDS).then(|| (what, (u64::from(tid) << 8) | u64::from(what)))
}

#[uprobe]
pub fn slotprof_cache_enter(ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !is_target((pid_tgid >> 32) as u32) {
        return 0;
    }
    let Some((_, key)) = key_of(&ctx, pid_tgid as u32) else {
        return 0;
    };
    push_return(pid_tgid as u32);
    if let Some(open) = CACHE_WORK_START.get_ptr_mut(&key) {
        // Inside a call of the same kind already: only deeper.
        unsafe { (*open).depth += 1 };
        return 0;
    }
    let start = CacheWorkStart {
        start_ns: unsafe { bpf_ktime_get_ns() },
        depth: 1,
        _pad: 0,
    };
    if CACHE_WORK_START.insert(&key, &start, 0).is_err() {
        count(counter::SYSCALL_START_LOST);
    }
    0
}

#[uretprobe]
pub fn slotprof_cache_exit(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !is_target(tgid) {
        return 0;
    }
    let tid = pid_tgid as u32;
    let Some((what, key)) = key_of(&ctx, tid) else {
        return 0;
    };
    pop_return(tid);
    let Some(open) = CACHE_WORK_START.get_ptr_mut(&key) else {
        // The call began before the probes were attached.
        return 0;
    };
    let start = unsafe {
        if (*open).depth > 1 {
            (*open).depth -= 1;
            return 0;
        }
        (*open).start_ns
    };
    let _ = CACHE_WORK_START.remove(&key);
    let Some(mut entry) = EVENTS.reserve::<CacheWork>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    entry.write(CacheWork {
        kind: EventKind::CacheWork as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        start_ns: start,
        end_ns: unsafe { bpf_ktime_get_ns() },
        tgid,
        tid,
        what,
        _pad: 0,
        comm: bpf_get_current_comm().unwrap_or([0; COMM_LEN]),
    });
    entry.submit(submit_flags());
    0
}
