//! Joins the kernel's user stack copies to the records they belong to,
//! unwinds them (CFI, see `symbolizer::unwind`) and gives each distinct
//! stack an id above [`USER_STACK_ID_BASE`], so everything downstream keeps
//! working with stack ids.
//!
//! How a record finds its copy (see `profiler-ebpf/src/probes/user_stack.rs`):
//! - `USER_STACK_NEXT`: the next copy of the same thread. A sample's copy
//!   follows it at once; a futex wait's or madvise call's at its exit; an
//!   off-CPU interval that began in a system call gets the copy taken at
//!   that call's exit (the thread's user stack has not changed since it
//!   blocked). Such records wait here for it.
//! - `USER_STACK_AT_SWITCH_OUT`: the copy taken when the interval began
//!   (outside a system call), matched by the interval's start.
//!
//! A system call exit's record may carry no stack but the `REPEAT` flag:
//! the thread is back where its last exit copy was taken (same `ip`, `sp`
//! and `bp`, within `--stack-repeat`), and gets that copy's stack. Waits
//! the kernel folded (`OffCpuFold`, `USER_STACK_AT_EXIT_COPY`) get the
//! stack of the thread's exit copy taken at their registers.

// Keys come from the target (addresses, stack words): foldhash is seeded
// per process, and 3-5x cheaper than SipHash on these keys.
use foldhash::{HashMap, HashMapExt};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use profiler_ebpf::{
    is_wait_syscall, sleeps_interruptible, stack_for, EventKind, KernelStackHeader, OffCpuStart,
    UserStackHeader, KERNEL_STACK_AT_SWITCH_IN, KERNEL_STACK_INLINE, KERNEL_STACK_SYSCALL_WAIT,
    USER_STACK_AT_EXIT_COPY, USER_STACK_AT_SWITCH_OUT, USER_STACK_ID_BASE, USER_STACK_NEXT,
    USER_STACK_WAKER_COPY, USER_STACK_WAKER_SAMPLED_OUT,
};
use symbolizer::unwind::{marker, End, Unwinder};

use crate::kernel::events::{self, Event};

mod sleepers;

use sleepers::SleeperKernelStacks;
#[cfg(test)]
use sleepers::{parse_proc_stack, parse_proc_syscall, proc_syscall_regs, SyscallRegs};

/// A record waits this long for its thread's stack copy, then goes on
/// with `[user stack not taken]` (a thread that exits inside a system call
/// never comes back to user space).
const HOLD_FOR: Duration = Duration::from_secs(2);

/// Bytes kept above the highest word a complete unwind read.
const STACK_TOP_MARGIN: u64 = 64;

/// Records held at most; past this the oldest go on without a stack.
const MAX_HELD: usize = 200_000;

/// An interned stack unused for this long is forgotten (records still
/// waiting to be processed hold theirs by using it).
const FORGET_AFTER: Duration = Duration::from_secs(120);

/// Which way the user stacks of reported records were taken, for the summary.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StackSources {
    /// Off-CPU intervals whose stack was copied at their system call's exit.
    pub offcpu_at_syscall_exit: u64,
    /// Off-CPU intervals whose stack was copied at the switch-out (no system call).
    pub offcpu_at_switch_out: u64,
    /// Off-CPU intervals without a user stack (thread exited or came back
    /// another way, copy failed), and other records likewise.
    pub offcpu_not_taken: u64,
    pub samples: u64,
    pub samples_not_taken: u64,
    pub syscall_records: u64,
    pub syscall_records_not_taken: u64,
    /// Stack copies received, and their bytes.
    pub copies: u64,
    pub copy_bytes: u64,
    /// Copies taken at a switch-out that no reported interval used.
    pub switch_out_copies_unused: u64,
    /// Futex waits whose waker (a thread of the target) had its stack
    /// copied at the wakeup, and those whose copy did not come.
    pub waker_copies_used: u64,
    pub waker_copies_missing: u64,
    /// Futex waits whose waker was not copied: that thread had been copied
    /// as a waker less than `WAKER_COPY_EVERY_NS` before (a sample).
    pub waker_copies_sampled_out: u64,
    /// System call exit records that repeated the thread's last exit copy
    /// (no copy made), and those whose earlier copy was not here (its
    /// record lost, or the stack forgotten): not taken.
    pub exit_repeats: u64,
    pub exit_repeats_missing: u64,
    /// Records of waits the kernel folded, and those whose exit copy (at
    /// their registers) was not here: not taken.
    pub folds: u64,
    pub folds_missing: u64,
    /// Exit copies no record waited for (an earlier copy served them),
    /// kept for the thread's later repeats.
    pub exit_copies_unclaimed: u64,
    /// Threads still asleep at a slot's end (or the session's) given their
    /// last exit copy's stack: asleep at its instruction and stack pointer.
    pub sleepers_repeated: u64,
    /// Malformed stack records (never trusted).
    pub malformed: u64,
}

/// A thread's last stack copy at a system call exit: what a
/// `stack_for::REPEAT` of the same registers stands for.
#[derive(Clone, Copy)]
struct ExitCopy {
    ip: u64,
    sp: u64,
    bp: u64,
    id: i32,
}

/// A ring-buffer record that is not one.
#[derive(Debug)]
pub struct Malformed;

struct Held {
    since: Instant,
    event: Event,
}

/// A thread's last switch-out copy, waiting for its interval: raw,
/// unwound only if used (`used`: its interval took it; the buffer stays
/// for the thread's next copy).
struct SwitchOutCopy {
    start_ns: u64,
    header: UserStackHeader,
    used: bool,
    bytes: Vec<u8>,
}

/// See the module doc.
pub struct UserStacks {
    pub unwinder: Unwinder,
    ids: HashMap<i32, (Arc<[u64]>, Instant)>,
    by_frames: HashMap<Arc<[u64]>, i32>,
    next: i32,
    held: HashMap<u32, Vec<Held>>,
    held_count: usize,
    switch_out: HashMap<u32, SwitchOutCopy>,
    /// (waker tid, wakeup time) -> the waker's unwound stack, until the
    /// futex record of the thread it woke comes.
    waker_copies: HashMap<(u32, u64), i32>,
    /// tid -> (start of its open interval, its user stack read from /proc).
    sleepers: HashMap<u32, (u64, (i32, i32))>,
    /// tid -> (start of the interval, kernel stack walked at its switch-in).
    kernel_inline: HashMap<u32, (u64, Vec<u64>)>,
    kallsyms: SleeperKernelStacks,
    /// tid -> where its outermost frame ends (see `unwind_copy`).
    tops: HashMap<u32, u64>,
    new_tops: Vec<(u32, Option<u64>)>,
    /// tid -> its last copy at a system call exit.
    last_exit: HashMap<u32, ExitCopy>,
    /// (tid, ip, sp, bp) -> its exit copy taken there: what a fold stands
    /// for (a thread's copy may have moved on by the time its fold comes).
    exit_copies: HashMap<(u32, u64, u64, u64), i32>,
    pub sources: StackSources,
    last_sweep: Instant,
}

impl Default for UserStacks {
    fn default() -> Self {
        Self {
            unwinder: Unwinder::new(),
            ids: HashMap::new(),
            by_frames: HashMap::new(),
            next: 0,
            held: HashMap::new(),
            held_count: 0,
            switch_out: HashMap::new(),
            waker_copies: HashMap::new(),
            sleepers: HashMap::new(),
            kernel_inline: HashMap::new(),
            kallsyms: SleeperKernelStacks::default(),
            tops: HashMap::new(),
            new_tops: Vec::new(),
            last_exit: HashMap::new(),
            exit_copies: HashMap::new(),
            sources: StackSources::default(),
            last_sweep: Instant::now(),
        }
    }
}

/// Whether `id` names a stack unwound here.
pub const fn is_unwound(id: i32) -> bool {
    id >= USER_STACK_ID_BASE
}

fn user_stack_id_mut(e: &mut Event) -> Option<&mut i32> {
    match e {
        Event::Sample(s) => Some(&mut s.user_stack_id),
        Event::OffCpu(o) => Some(&mut o.user_stack_id),
        Event::Madvise(m) => Some(&mut m.user_stack_id),
        Event::FutexWait(f) => Some(&mut f.user_stack_id),
        _ => None,
    }
}

fn tid_of(e: &Event) -> u32 {
    match e {
        Event::Sample(s) => s.tid,
        Event::OffCpu(o) => o.tid,
        Event::Madvise(m) => m.tid,
        Event::FutexWait(f) => f.tid,
        _ => 0,
    }
}

impl UserStacks {
    /// The frames of an unwound stack id (leaf first, markers included).
    pub fn get(&mut self, id: i32) -> Option<Vec<u64>> {
        let (frames, used) = self.ids.get_mut(&id)?;
        *used = Instant::now();
        Some(frames.to_vec())
    }

    /// Starts a batch of records (drops what is no longer used, now and then).
    pub fn begin_batch(&mut self) {
        self.sweep();
    }

    /// Takes one raw ring-buffer record: a stack copy is joined to the
    /// records waiting for it; any other record is decoded and goes to
    /// `out`, now or once its stack has come. `Err(Malformed)`: not a
    /// record (counted by the caller, never trusted).
    pub fn feed(&mut self, bytes: &[u8], out: &mut impl FnMut(Event)) -> Result<(), Malformed> {
        let kind = bytes.get(..4).map(|b| u32::from_ne_bytes(b.try_into().unwrap()));
        if kind == Some(EventKind::UserStack as u32) {
            return self.stack_record(bytes, out);
        }
        if kind == Some(EventKind::KernelStack as u32) {
            return self.kernel_stack_record(bytes);
        }
        let mut event = events::decode(bytes).ok_or(Malformed)?;
        if let Event::FutexWait(f) = &mut event {
            if f.waker_user_stack_id == USER_STACK_WAKER_COPY {
                f.waker_user_stack_id = match self.waker_copies.remove(&(f.waker_tid, f.waker_woken_ns)) {
                    Some(id) => {
                        self.sources.waker_copies_used += 1;
                        id
                    }
                    None => {
                        self.sources.waker_copies_missing += 1;
                        self.not_taken()
                    }
                };
            } else if f.waker_user_stack_id == USER_STACK_WAKER_SAMPLED_OUT {
                self.sources.waker_copies_sampled_out += 1;
                f.waker_user_stack_id = self.not_taken();
            }
        }
        if let Event::OffCpuFold(f) = &mut event {
            if f.user_stack_id == USER_STACK_AT_EXIT_COPY {
                f.user_stack_id = self.fold_stack(f.tid, f.ip, f.sp, f.bp);
            }
        }
        if let Event::OffCpu(o) = &mut event {
            if o.kernel_stack_id == KERNEL_STACK_INLINE {
                o.kernel_stack_id = match self.kernel_inline.remove(&o.tid) {
                    Some((start, frames)) if start == o.start_ns => self.intern(frames),
                    // Its record did not come (the ring was full): lost.
                    _ => -12,
                };
            }
        }
        let tid = tid_of(&event);
        let Some(id) = user_stack_id_mut(&mut event) else {
            out(event);
            return Ok(());
        };
        match *id {
            USER_STACK_NEXT => {
                self.held.entry(tid).or_default().push(Held {
                    since: Instant::now(),
                    event,
                });
                self.held_count += 1;
                if self.held_count > MAX_HELD {
                    self.release_oldest(out);
                }
            }
            USER_STACK_AT_SWITCH_OUT => {
                let start = match &event {
                    Event::OffCpu(o) => o.start_ns,
                    _ => 0,
                };
                let copy = self
                    .switch_out
                    .get_mut(&tid)
                    .filter(|c| !c.used && c.start_ns == start)
                    .map(|c| {
                        c.used = true;
                        (c.header, std::mem::take(&mut c.bytes))
                    });
                let new_id = match copy {
                    Some((header, bytes)) if !bytes.is_empty() => {
                        self.sources.offcpu_at_switch_out += 1;
                        let id = self.unwind_copy(&header, &bytes);
                        // The buffer goes back for the thread's next copy.
                        if let Some(c) = self.switch_out.get_mut(&tid) {
                            c.bytes = bytes;
                        }
                        id
                    }
                    _ => {
                        self.sources.offcpu_not_taken += 1;
                        self.not_taken()
                    }
                };
                if let Some(id) = user_stack_id_mut(&mut event) {
                    *id = new_id;
                }
                out(event);
            }
            _ => out(event),
        }
        Ok(())
    }

    /// A kernel stack walked at a switch-in: kept for the interval record
    /// right after it.
    fn kernel_stack_record(&mut self, bytes: &[u8]) -> Result<(), Malformed> {
        let hsize = std::mem::size_of::<KernelStackHeader>();
        let Some(h) = bytes.get(..hsize) else {
            self.sources.malformed += 1;
            return Err(Malformed);
        };
        // SAFETY: plain-data repr(C) record, length checked, unaligned read.
        let header: KernelStackHeader = unsafe { std::ptr::read_unaligned(h.as_ptr().cast()) };
        let len = header.len as usize;
        let Some(ips) = bytes
            .get(hsize..hsize + len)
            .filter(|_| len.is_multiple_of(8) && len / 8 <= profiler_ebpf::MAX_STACK_DEPTH)
        else {
            self.sources.malformed += 1;
            return Err(Malformed);
        };
        let frames: Vec<u64> = ips
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .filter(|&ip| ip != 0)
            .collect();
        if self.kernel_inline.len() >= 65_536 {
            self.kernel_inline.clear();
        }
        self.kernel_inline.insert(header.tid, (header.start_ns, frames));
        Ok(())
    }

    fn stack_record(&mut self, bytes: &[u8], out: &mut impl FnMut(Event)) -> Result<(), Malformed> {
        let hsize = std::mem::size_of::<UserStackHeader>();
        let Some(h) = bytes.get(..hsize) else {
            self.sources.malformed += 1;
            return Err(Malformed);
        };
        // SAFETY: plain-data repr(C) record, length checked, unaligned read.
        let header: UserStackHeader = unsafe { std::ptr::read_unaligned(h.as_ptr().cast()) };
        let Some(stack) = bytes.get(hsize..hsize + header.len as usize) else {
            self.sources.malformed += 1;
            return Err(Malformed);
        };
        if header.why & stack_for::REPEAT == 0 {
            self.sources.copies += 1;
            self.sources.copy_bytes += stack.len() as u64;
        }
        if header.why & stack_for::MASK == stack_for::WAKER {
            // Before the record of the thread it woke (that thread had to
            // run first): kept for it.
            let id = if stack.is_empty() {
                self.not_taken()
            } else {
                self.unwind_copy(&header, stack)
            };
            if self.waker_copies.len() >= 65_536 {
                self.waker_copies.clear();
            }
            self.waker_copies.insert((header.tid, header.start_ns), id);
            return Ok(());
        }
        if header.why & stack_for::MASK == stack_for::SWITCH_OUT {
            // Most are never used (the thread got its CPU back within the
            // reporting minimum): each thread's buffer is reused rather
            // than one allocated and freed per copy.
            match self.switch_out.get_mut(&header.tid) {
                Some(c) => {
                    if !c.used {
                        self.sources.switch_out_copies_unused += 1;
                    }
                    c.start_ns = header.start_ns;
                    c.header = header;
                    c.used = false;
                    c.bytes.clear();
                    c.bytes.extend_from_slice(stack);
                }
                None => {
                    let copy = SwitchOutCopy {
                        start_ns: header.start_ns,
                        header,
                        used: false,
                        bytes: stack.to_vec(),
                    };
                    self.switch_out.insert(header.tid, copy);
                }
            }
            return Ok(());
        }
        let exit_copy = header.why & stack_for::MASK == stack_for::SYSCALL_EXIT
            && header.why & stack_for::REPEAT == 0
            && !stack.is_empty();
        let Some(waiting) = self.held.remove(&header.tid) else {
            // Nobody waits for it: its records took an earlier copy of the
            // same stack (a cpu-clock sample between the switch-in and the
            // system call's exit). The kernel still remembers this copy as
            // the thread's last exit copy, and its later repeats stand for
            // it: kept for them (exit_repeats_missing otherwise).
            if exit_copy {
                let id = self.unwind_copy(&header, stack);
                self.remember_exit_copy(&header, id);
                self.sources.exit_copies_unclaimed += 1;
            }
            return Ok(());
        };
        self.held_count -= waiting.len();
        let (id, taken) = if header.why & stack_for::REPEAT != 0 {
            self.repeat(&header)
        } else if stack.is_empty() {
            (self.not_taken(), false)
        } else {
            let id = self.unwind_copy(&header, stack);
            // What the kernel compares a later exit with: its exit copies
            // only (a sample's copy is not one).
            if exit_copy {
                self.remember_exit_copy(&header, id);
            }
            (id, true)
        };
        for mut h in waiting {
            match &h.event {
                Event::OffCpu(_) if taken => self.sources.offcpu_at_syscall_exit += 1,
                Event::OffCpu(_) => self.sources.offcpu_not_taken += 1,
                Event::Sample(_) if taken => self.sources.samples += 1,
                Event::Sample(_) => self.sources.samples_not_taken += 1,
                _ if taken => self.sources.syscall_records += 1,
                _ => self.sources.syscall_records_not_taken += 1,
            }
            if let Some(slot) = user_stack_id_mut(&mut h.event) {
                *slot = id;
            }
            out(h.event);
        }
        Ok(())
    }

    /// Keeps an exit copy as the thread's last (what its repeats mean).
    fn remember_exit_copy(&mut self, header: &UserStackHeader, id: i32) {
        if self.last_exit.len() >= 65_536 {
            self.last_exit.clear();
        }
        let copy = ExitCopy {
            ip: header.ip,
            sp: header.sp,
            bp: header.bp,
            id,
        };
        self.last_exit.insert(header.tid, copy);
        if self.exit_copies.len() >= 65_536 {
            self.exit_copies.clear();
        }
        self.exit_copies
            .insert((header.tid, header.ip, header.sp, header.bp), id);
    }

    /// The stack of waits `tid` folded at these registers: its exit copy
    /// taken there (see `profiler_ebpf::OffCpuFold`), if still kept.
    pub fn fold_stack(&mut self, tid: u32, ip: u64, sp: u64, bp: u64) -> i32 {
        self.sources.folds += 1;
        let known = self.exit_copies.get(&(tid, ip, sp, bp)).copied();
        match known.and_then(|id| self.ids.get_mut(&id).map(|e| (id, e))) {
            Some((id, entry)) => {
                entry.1 = Instant::now();
                id
            }
            None => {
                self.sources.folds_missing += 1;
                self.not_taken()
            }
        }
    }

    /// The stack a [`stack_for::REPEAT`] stands for: the thread's last exit
    /// copy, if it was taken at the same registers and is still known.
    fn repeat(&mut self, h: &UserStackHeader) -> (i32, bool) {
        let known = self.last_exit_copy(h.tid, h.ip, h.sp, Some(h.bp));
        match known.and_then(|id| self.ids.get_mut(&id).map(|e| (id, e))) {
            Some((id, entry)) => {
                entry.1 = Instant::now();
                self.sources.exit_repeats += 1;
                (id, true)
            }
            None => {
                self.sources.exit_repeats_missing += 1;
                (self.not_taken(), false)
            }
        }
    }

    /// The stack id of `tid`'s last exit copy if it was taken at these
    /// registers (`bp` when known) and is still kept.
    fn last_exit_copy(&self, tid: u32, ip: u64, sp: u64, bp: Option<u64>) -> Option<i32> {
        self.last_exit
            .get(&tid)
            .filter(|c| sp != 0 && (c.ip, c.sp) == (ip, sp) && bp.is_none_or(|bp| bp == c.bp))
            .map(|c| c.id)
            .filter(|id| self.ids.contains_key(id))
    }

    fn unwind(&mut self, pid: u32, ip: u64, sp: u64, bp: u64, stack: &[u8]) -> (i32, End, u64) {
        let (frames, end, reach) = self.unwinder.unwind(pid, ip, sp, bp, stack);
        (self.intern(frames), end, reach)
    }

    /// Unwinds a kernel copy, and learns from it where the thread's
    /// outermost frame ends: the kernel copies no further from then on (a
    /// thread's idle stack is a few KiB; without the bound every copy ran
    /// to the end of its mapping or the 32 KiB limit).
    fn unwind_copy(&mut self, h: &UserStackHeader, stack: &[u8]) -> i32 {
        let (id, end, reach) = self.unwind(h.tgid, h.ip, h.sp, h.bp, stack);
        let bounded = h.why & stack_for::BOUNDED != 0;
        match end {
            End::Complete => {
                let top = (reach + STACK_TOP_MARGIN + 15) & !15;
                if self.tops.get(&h.tid) != Some(&top) {
                    if self.tops.len() >= 65_536 {
                        self.tops.clear();
                    }
                    self.tops.insert(h.tid, top);
                    self.new_tops.push((h.tid, Some(top)));
                }
            }
            // The bound was wrong (a new thread with a reused tid, a
            // thread on another stack): back to whole copies.
            End::StackCopyEnd if bounded => {
                self.tops.remove(&h.tid);
                self.new_tops.push((h.tid, None));
            }
            _ => {}
        }
        id
    }

    /// Where threads' outermost frames end, learnt since the last call:
    /// for the kernel's `USER_STACK_TOP` map (`None`: forget the bound).
    pub fn take_stack_tops(&mut self) -> Vec<(u32, Option<u64>)> {
        std::mem::take(&mut self.new_tops)
    }

    fn not_taken(&mut self) -> i32 {
        self.intern(vec![marker::NOT_TAKEN])
    }

    fn intern(&mut self, frames: Vec<u64>) -> i32 {
        let now = Instant::now();
        // Most stacks are known: looked up as they are, shared only when new.
        if let Some(&id) = self.by_frames.get(frames.as_slice()) {
            if let Some(e) = self.ids.get_mut(&id) {
                e.1 = now;
            }
            return id;
        }
        let frames: Arc<[u64]> = frames.into();
        // Ids count up from the base and wrap (after 2^30 distinct stacks)
        // skipping ones still in use.
        let mut id;
        loop {
            id = USER_STACK_ID_BASE + self.next;
            self.next = (self.next + 1) & (USER_STACK_ID_BASE - 1);
            if !self.ids.contains_key(&id) {
                break;
            }
        }
        self.ids.insert(id, (frames.clone(), now));
        self.by_frames.insert(frames, id);
        id
    }

    /// Releases records that waited too long (their stack will not come).
    pub fn expire(&mut self, out: &mut impl FnMut(Event)) {
        let now = Instant::now();
        let stale: Vec<u32> = self
            .held
            .iter()
            .filter(|(_, v)| v.first().is_some_and(|h| now.duration_since(h.since) > HOLD_FOR))
            .map(|(&tid, _)| tid)
            .collect();
        for tid in stale {
            self.release(tid, out);
        }
    }

    /// Releases everything held (the session ends).
    pub fn flush(&mut self, out: &mut impl FnMut(Event)) {
        let all: Vec<u32> = self.held.keys().copied().collect();
        for tid in all {
            self.release(tid, out);
        }
    }

    fn release(&mut self, tid: u32, out: &mut impl FnMut(Event)) {
        let Some(waiting) = self.held.remove(&tid) else {
            return;
        };
        self.held_count -= waiting.len();
        let id = self.not_taken();
        for mut h in waiting {
            match &h.event {
                Event::OffCpu(_) => self.sources.offcpu_not_taken += 1,
                Event::Sample(_) => self.sources.samples_not_taken += 1,
                _ => self.sources.syscall_records_not_taken += 1,
            }
            if let Some(slot) = user_stack_id_mut(&mut h.event) {
                *slot = id;
            }
            out(h.event);
        }
    }

    fn release_oldest(&mut self, out: &mut impl FnMut(Event)) {
        if let Some(tid) = self
            .held
            .iter()
            .min_by_key(|(_, v)| v.first().map(|h| h.since))
            .map(|(&t, _)| t)
        {
            self.release(tid, out);
        }
    }

    fn sweep(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < Duration::from_secs(10) {
            return;
        }
        self.last_sweep = now;
        self.ids
            .retain(|_, (_, used)| now.duration_since(*used) < FORGET_AFTER);
        let ids = &self.ids;
        self.by_frames.retain(|_, id| ids.contains_key(id));
        if self.switch_out.len() > 4096 {
            self.switch_out.clear();
        }
        // A copy whose record never came (its thread was woken again, or
        // the record was lost) goes with its stack.
        self.waker_copies.retain(|_, id| ids.contains_key(id));
        self.exit_copies.retain(|_, id| ids.contains_key(id));
    }

    /// Records waiting for a stack now.
    pub fn held(&self) -> usize {
        self.held_count
    }

    /// The earliest start of a record still waiting for its stack (at most
    /// [`HOLD_FOR`]): what `slotprof run` may not yet cut into slots.
    pub fn oldest_held_start_ns(&self) -> Option<u64> {
        self.held
            .values()
            .flatten()
            .filter_map(|h| match &h.event {
                Event::OffCpu(o) => Some(o.start_ns),
                Event::Sample(s) => Some(s.ts_ns),
                Event::FutexWait(f) => Some(f.start_ns),
                Event::Madvise(m) => Some(m.start_ns),
                _ => None,
            })
            .min()
    }

    /// Distinct unwound stacks kept now.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_ebpf::{CpuSample, OffCpuInterval, COMM_LEN};

    fn stack_rec(tid: u32, why: u32, start_ns: u64, bytes: &[u8]) -> Vec<u8> {
        let h = UserStackHeader {
            kind: EventKind::UserStack as u32,
            cpu: 0,
            ts_ns: 1,
            tgid: 999_999_999,
            tid,
            ip: 0x1000,
            sp: 0x7000_0000,
            bp: 0,
            len: bytes.len() as u32,
            why,
            start_ns,
        };
        let mut v = crate::kernel::events::bytes_of(&h);
        v.extend_from_slice(bytes);
        v
    }

    fn offcpu(tid: u32, start: u64, user: i32) -> Vec<u8> {
        crate::kernel::events::bytes_of(&OffCpuInterval {
            kind: EventKind::OffCpu as u32,
            cpu: 0,
            start_ns: start,
            end_ns: start + 5_000_000,
            tgid: 999_999_999,
            tid,
            user_stack_id: user,
            kernel_stack_id: -14,
            state: 1,
            waker_tid: 0,
            waker_tgid: 0,
            waker_context: -1,
            comm: [0; COMM_LEN],
            waker_comm: [0; COMM_LEN],
            woken_ns: 0,
            ran_tid: 0,
            ran_tgid: 0,
            ran_flags: 0,
            _pad: 0,
            ran_comm: [0; COMM_LEN],
        })
    }

    fn user_id(e: &Event) -> i32 {
        match e {
            Event::OffCpu(o) => o.user_stack_id,
            Event::Sample(s) => s.user_stack_id,
            _ => 0,
        }
    }

    fn kernel_rec(tid: u32, start_ns: u64, ips: &[u64]) -> Vec<u8> {
        let h = KernelStackHeader {
            kind: EventKind::KernelStack as u32,
            tid,
            start_ns,
            len: (ips.len() * 8) as u32,
            _pad: 0,
        };
        let mut v = crate::kernel::events::bytes_of(&h);
        ips.iter().for_each(|ip| v.extend_from_slice(&ip.to_ne_bytes()));
        v
    }

    fn kernel_id(e: &Event) -> i32 {
        match e {
            Event::OffCpu(o) => o.kernel_stack_id,
            _ => 0,
        }
    }

    #[test]
    fn a_kernel_stack_walked_at_switch_in_goes_to_its_interval_only() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        let inline = |tid, start| {
            let mut b = offcpu(tid, start, -14);
            let off = std::mem::offset_of!(OffCpuInterval, kernel_stack_id);
            b[off..off + 4].copy_from_slice(&KERNEL_STACK_INLINE.to_ne_bytes());
            b
        };
        u.feed(
            &kernel_rec(7, 100, &[0xffff_ffff_8100_0010, 0xffff_ffff_8100_0020]),
            &mut |_| {},
        )
        .unwrap();
        u.feed(&inline(7, 100), &mut |e| out.push(e)).unwrap();
        let id = kernel_id(&out[0]);
        assert!(is_unwound(id), "{id}");
        assert_eq!(u.get(id).unwrap(), [0xffff_ffff_8100_0010, 0xffff_ffff_8100_0020]);
        // Used once: the next interval of that thread without its record
        // (the ring was full) has a lost stack, as has one whose record
        // was for another start.
        u.feed(&inline(7, 200), &mut |e| out.push(e)).unwrap();
        assert_eq!(kernel_id(&out[1]), -12);
        u.feed(&kernel_rec(7, 300, &[1]), &mut |_| {}).unwrap();
        u.feed(&inline(7, 301), &mut |e| out.push(e)).unwrap();
        assert_eq!(kernel_id(&out[2]), -12);
        // Bad records: too long, not whole addresses, truncated.
        let mut long = kernel_rec(7, 1, &[1; 128]);
        assert!(u.kernel_stack_record(&long).is_err());
        long.truncate(std::mem::size_of::<KernelStackHeader>() + 3);
        assert!(u.kernel_stack_record(&long).is_err());
        let mut odd = kernel_rec(7, 1, &[1]);
        odd[16..20].copy_from_slice(&3u32.to_ne_bytes());
        assert!(u.kernel_stack_record(&odd).is_err());
        assert!(u.kernel_stack_record(&odd[..10]).is_err());
    }

    #[test]
    fn a_sleeper_in_a_wait_gets_the_calls_frame_and_its_last_exit_copy_without_proc_walks() {
        // A thread of this process asleep in a futex wait (a Condvar).
        let pair = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let p2 = pair.clone();
        let waiter = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let (m, c) = &*p2;
            let mut done = m.lock().unwrap();
            while !*done {
                done = c.wait(done).unwrap();
            }
        });
        let tid = rx.recv().unwrap();
        let pid = std::process::id();
        let mut regs = None;
        for _ in 0..200 {
            regs = proc_syscall_regs(pid, tid).filter(|r| r.nr == 202);
            if regs.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // A process may always read its own threads' /proc files.
        let regs = regs.expect("the waiter never showed in a futex wait in /proc/self/task/TID/syscall");
        let mut u = UserStacks::default();
        let copy = u.intern(vec![0x1234, 0x5678]);
        u.last_exit.insert(
            tid,
            ExitCopy {
                ip: regs.ip,
                sp: regs.sp,
                bp: 0,
                id: copy,
            },
        );
        let start = OffCpuStart {
            start_ns: 1,
            state: 1, // TASK_INTERRUPTIBLE
            kernel_stack_id: KERNEL_STACK_AT_SWITCH_IN,
            user_stack_id: USER_STACK_NEXT,
            ..OffCpuStart::IDLE
        };
        let (user, kernel) = u.of_sleeper(pid, tid, &start);
        assert_eq!(
            kernel,
            KERNEL_STACK_SYSCALL_WAIT - 202,
            "the futex wait's one frame"
        );
        assert_eq!(user, copy, "its last exit copy at the same registers");
        assert_eq!(u.sources.sleepers_repeated, 1);
        // At other registers it is read and unwound, not given the copy.
        u.last_exit.get_mut(&tid).unwrap().sp += 16;
        let later = OffCpuStart { start_ns: 2, ..start };
        let (user, _) = u.of_sleeper(pid, tid, &later);
        assert_ne!(user, copy);
        assert_eq!(u.sources.sleepers_repeated, 1);
        let (m, c) = &*pair;
        *m.lock().unwrap() = true;
        c.notify_one();
        waiter.join().unwrap();
    }

    #[test]
    fn proc_files_of_a_sleeping_thread_parse() {
        assert_eq!(
            parse_proc_syscall("202 0x7f1 0x80 0x0 0x0 0x0 0x0 0x7ffc0010 0x7f5500aa\n"),
            Some(SyscallRegs {
                nr: 202,
                ip: 0x7f55_00aa,
                sp: 0x7ffc_0010
            })
        );
        assert_eq!(parse_proc_syscall("running\n"), None);
        assert_eq!(parse_proc_syscall("-1 0x7ffc0010 0x7f5500aa\n"), None);
        assert_eq!(parse_proc_syscall("202 0xzz"), None);
        assert_eq!(
            parse_proc_stack("[<0>] futex_wait_queue+0x60/0x90\n[<0>] do_thing+0x1a/0x100 [kvm]\nbogus\n"),
            [
                ("futex_wait_queue".to_string(), 0x60),
                ("do_thing".to_string(), 0x1a)
            ]
        );
    }

    #[test]
    fn a_deferred_interval_waits_for_its_threads_next_copy_and_no_other() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        u.feed(&offcpu(7, 100, USER_STACK_NEXT), &mut |e| out.push(e))
            .unwrap();
        assert!(out.is_empty(), "held until its stack comes");
        // Another thread's copy does not release it.
        u.feed(&stack_rec(8, stack_for::SYSCALL_EXIT, 0, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        assert!(out.is_empty());
        u.feed(&stack_rec(7, stack_for::SYSCALL_EXIT, 0, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        assert_eq!(out.len(), 1);
        assert!(is_unwound(user_id(&out[0])));
        assert_eq!(u.sources.offcpu_at_syscall_exit, 1);
    }

    /// A repeat record of `tid` at `stack_rec`'s registers, or at stack
    /// pointer `sp`.
    fn repeat_rec(tid: u32, sp: Option<u64>) -> Vec<u8> {
        let mut rec = stack_rec(tid, stack_for::SYSCALL_EXIT | stack_for::REPEAT, 0, &[]);
        if let Some(sp) = sp {
            rec[32..40].copy_from_slice(&sp.to_ne_bytes()); // UserStackHeader.sp
        }
        rec
    }

    /// An interval of `tid` beginning at `start`, then the stack record
    /// `rec` (the one it waits for, or not).
    fn interval_then(u: &mut UserStacks, tid: u32, start: u64, rec: Vec<u8>, out: &mut Vec<Event>) {
        u.feed(&offcpu(tid, start, USER_STACK_NEXT), &mut |e| out.push(e))
            .unwrap();
        u.feed(&rec, &mut |e| out.push(e)).unwrap();
    }

    #[test]
    fn a_repeat_gets_the_threads_last_exit_copy_only_at_the_same_registers() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        // A copy, then a repeat of it: the same stack id.
        interval_then(
            &mut u,
            7,
            100,
            stack_rec(7, stack_for::SYSCALL_EXIT, 0, &[0; 64]),
            &mut out,
        );
        interval_then(&mut u, 7, 200, repeat_rec(7, None), &mut out);
        assert_eq!(out.len(), 2);
        assert!(is_unwound(user_id(&out[0])));
        assert_eq!(user_id(&out[0]), user_id(&out[1]));
        assert_eq!((u.sources.exit_repeats, u.sources.offcpu_at_syscall_exit), (1, 2));
        assert_eq!(u.sources.copies, 1, "a repeat is not a copy");
        // A sample's copy in between is not what the kernel compares with.
        let mut sample = stack_rec(7, stack_for::SAMPLE, 0, &[1; 64]);
        sample[32..40].copy_from_slice(&0x7000_2000u64.to_ne_bytes());
        interval_then(&mut u, 7, 250, sample, &mut out);
        interval_then(&mut u, 7, 260, repeat_rec(7, None), &mut out);
        assert_eq!(user_id(&out[3]), user_id(&out[0]));
        out.truncate(2);
        // A repeat at other registers, or of another thread with no copy
        // yet, is not given a stack it was not taken at.
        interval_then(&mut u, 7, 300, repeat_rec(7, Some(0x7000_1000)), &mut out);
        interval_then(&mut u, 8, 300, repeat_rec(8, None), &mut out);
        assert_eq!(out.len(), 4);
        let not_taken = u.not_taken();
        assert_eq!((user_id(&out[2]), user_id(&out[3])), (not_taken, not_taken));
        assert_eq!(u.sources.exit_repeats_missing, 2);
        assert_eq!(u.sources.offcpu_not_taken, 2);
    }

    /// A fold record of `tid` at the registers `(ip, sp, bp)`.
    fn fold_rec(tid: u32, ip: u64, sp: u64, bp: u64) -> Vec<u8> {
        crate::kernel::events::bytes_of(&profiler_ebpf::OffCpuFold {
            kind: EventKind::OffCpuFold as u32,
            cpu: 0,
            first_start_ns: 10,
            last_end_ns: 90,
            tgid: 999_999_999,
            tid,
            offcpu_ns: 50,
            runnable_ns: 0,
            intervals: 5,
            kernel_stack_id: KERNEL_STACK_SYSCALL_WAIT - 202,
            user_stack_id: USER_STACK_AT_EXIT_COPY,
            state: 1,
            ip,
            sp,
            bp,
            comm: [0; COMM_LEN],
        })
    }

    /// Folded waits get the stack of the thread's exit copy taken at
    /// their registers, even after a later copy elsewhere; at registers
    /// with no copy, or of a thread with none, no stack (counted).
    #[test]
    fn a_fold_gets_the_exit_copy_taken_at_its_registers() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        interval_then(
            &mut u,
            7,
            100,
            stack_rec(7, stack_for::SYSCALL_EXIT, 0, &[0; 64]),
            &mut out,
        );
        let copy = user_id(&out[0]);
        assert!(is_unwound(copy));
        // A later exit copy at another stack pointer.
        let mut other = stack_rec(7, stack_for::SYSCALL_EXIT, 0, &[2; 64]);
        other[32..40].copy_from_slice(&0x7000_4000u64.to_ne_bytes());
        interval_then(&mut u, 7, 200, other, &mut out);
        let folded = |u: &mut UserStacks, rec: Vec<u8>| {
            let mut got = Vec::new();
            u.feed(&rec, &mut |e| got.push(e)).unwrap();
            match got[..] {
                [Event::OffCpuFold(f)] => f.user_stack_id,
                _ => panic!("{got:?}"),
            }
        };
        assert_eq!(folded(&mut u, fold_rec(7, 0x1000, 0x7000_0000, 0)), copy);
        let not_taken = u.not_taken();
        assert_eq!(folded(&mut u, fold_rec(7, 0x1000, 0x7000_8000, 0)), not_taken);
        assert_eq!(folded(&mut u, fold_rec(8, 0x1000, 0x7000_0000, 0)), not_taken);
        assert_eq!((u.sources.folds, u.sources.folds_missing), (3, 2));
        assert_eq!(u.held(), 0, "a fold waits for nothing");
    }

    #[test]
    fn an_exit_copy_nobody_waited_for_is_what_the_next_repeat_means() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        // The interval takes a sample's copy (a sample between the
        // switch-in and the exit), at other registers than the exit's.
        let mut sample = stack_rec(7, stack_for::SAMPLE, 0, &[1; 64]);
        sample[24..32].copy_from_slice(&0x5555_1234u64.to_ne_bytes()); // ip
        sample[32..40].copy_from_slice(&0x7000_2000u64.to_ne_bytes()); // sp
        interval_then(&mut u, 7, 100, sample, &mut out);
        // Then the exit's own copy, which nobody waits for any more; the
        // kernel remembers it, and the next exit at its registers repeats.
        u.feed(&stack_rec(7, stack_for::SYSCALL_EXIT, 0, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(u.sources.exit_copies_unclaimed, 1);
        interval_then(&mut u, 7, 200, repeat_rec(7, None), &mut out);
        assert_eq!(out.len(), 2);
        assert!(is_unwound(user_id(&out[1])));
        assert_ne!(
            user_id(&out[1]),
            user_id(&out[0]),
            "the exit's stack, not the sample's"
        );
        assert_eq!((u.sources.exit_repeats, u.sources.exit_repeats_missing), (1, 0));
    }

    #[test]
    fn an_empty_copy_and_a_session_end_give_not_taken() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        u.feed(&offcpu(7, 100, USER_STACK_NEXT), &mut |e| out.push(e))
            .unwrap();
        u.feed(&stack_rec(7, stack_for::SYSCALL_EXIT, 0, &[]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        u.feed(&offcpu(9, 100, USER_STACK_NEXT), &mut |e| out.push(e))
            .unwrap();
        u.flush(&mut |e| out.push(e));
        assert_eq!(out.len(), 2);
        for e in &out {
            assert_eq!(u.get(user_id(e)), Some(vec![marker::NOT_TAKEN]));
        }
        assert_eq!(u.sources.offcpu_not_taken, 2);
        assert_eq!(u.held(), 0);
    }

    #[test]
    fn the_oldest_held_record_holds_back_its_slot() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        assert_eq!(u.oldest_held_start_ns(), None);
        u.feed(&offcpu(7, 300, USER_STACK_NEXT), &mut |e| out.push(e))
            .unwrap();
        u.feed(&offcpu(9, 100, USER_STACK_NEXT), &mut |e| out.push(e))
            .unwrap();
        assert_eq!(u.oldest_held_start_ns(), Some(100));
        u.feed(&stack_rec(9, stack_for::SYSCALL_EXIT, 0, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        assert_eq!(u.oldest_held_start_ns(), Some(300));
        u.flush(&mut |e| out.push(e));
        assert_eq!(u.oldest_held_start_ns(), None);
    }

    #[test]
    fn a_switch_out_copy_is_used_only_by_the_interval_that_began_there() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        u.feed(&stack_rec(7, stack_for::SWITCH_OUT, 100, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        u.feed(&offcpu(7, 200, USER_STACK_AT_SWITCH_OUT), &mut |e| out.push(e))
            .unwrap();
        assert_eq!(
            u.get(user_id(&out[0])),
            Some(vec![marker::NOT_TAKEN]),
            "start differs"
        );
        u.feed(&stack_rec(7, stack_for::SWITCH_OUT, 300, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        u.feed(&offcpu(7, 300, USER_STACK_AT_SWITCH_OUT), &mut |e| out.push(e))
            .unwrap();
        assert_ne!(u.get(user_id(&out[1])), Some(vec![marker::NOT_TAKEN]));
        assert!(is_unwound(user_id(&out[1])));
        assert_eq!(u.sources.switch_out_copies_unused, 1, "the copy at 100");
        // A copy is used once; the thread's next copy reuses its buffer.
        u.feed(&offcpu(7, 300, USER_STACK_AT_SWITCH_OUT), &mut |e| out.push(e))
            .unwrap();
        assert_eq!(
            u.get(user_id(&out[2])),
            Some(vec![marker::NOT_TAKEN]),
            "used twice"
        );
        u.feed(&stack_rec(7, stack_for::SWITCH_OUT, 400, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        assert_eq!(u.sources.switch_out_copies_unused, 1, "the copy at 300 was used");
        u.feed(&offcpu(7, 400, USER_STACK_AT_SWITCH_OUT), &mut |e| out.push(e))
            .unwrap();
        assert_eq!(
            user_id(&out[3]),
            user_id(&out[1]),
            "the same bytes, the same stack"
        );
        assert_eq!(u.sources.offcpu_at_switch_out, 2);
    }

    fn futex_waking(tid: u32, waker: u32, woken_ns: u64) -> Vec<u8> {
        crate::kernel::events::bytes_of(&profiler_ebpf::FutexWait {
            kind: EventKind::FutexWait as u32,
            cpu: 0,
            start_ns: 10,
            end_ns: woken_ns + 1000,
            tgid: 999_999_999,
            tid,
            uaddr: 0x1234,
            op: 128,
            user_stack_id: -1,
            ret: 0,
            waker_tid: waker,
            waker_user_stack_id: USER_STACK_WAKER_COPY,
            waker_context: 202,
            _pad: 0,
            waker_woken_ns: woken_ns,
            comm: [0; COMM_LEN],
            waker_comm: [0; COMM_LEN],
        })
    }

    fn waker_id(e: &Event) -> i32 {
        match e {
            Event::FutexWait(f) => f.waker_user_stack_id,
            _ => 0,
        }
    }

    #[test]
    fn a_wakers_copy_goes_to_the_wait_it_ended_and_no_other() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        // Waker 8 woke 7 at 500: its copy comes first.
        u.feed(&stack_rec(8, stack_for::WAKER, 500, &[0; 64]), &mut |e| {
            out.push(e)
        })
        .unwrap();
        // A wait woken by 8 at another time does not take it.
        u.feed(&futex_waking(9, 8, 499), &mut |e| out.push(e)).unwrap();
        assert_eq!(u.get(waker_id(&out[0])), Some(vec![marker::NOT_TAKEN]));
        u.feed(&futex_waking(7, 8, 500), &mut |e| out.push(e)).unwrap();
        assert!(is_unwound(waker_id(&out[1])));
        assert_ne!(u.get(waker_id(&out[1])), Some(vec![marker::NOT_TAKEN]));
        // Used once: a second record with the same key finds nothing.
        u.feed(&futex_waking(7, 8, 500), &mut |e| out.push(e)).unwrap();
        assert_eq!(u.get(waker_id(&out[2])), Some(vec![marker::NOT_TAKEN]));
        assert_eq!(
            (u.sources.waker_copies_used, u.sources.waker_copies_missing),
            (1, 2)
        );
    }

    #[test]
    fn a_sample_gets_the_copy_right_after_it_and_identical_stacks_share_an_id() {
        let mut u = UserStacks::default();
        let mut out = Vec::new();
        for _ in 0..2 {
            let s = CpuSample {
                kind: EventKind::CpuSample as u32,
                cpu: 0,
                ts_ns: 5,
                tgid: 999_999_999,
                tid: 3,
                user_stack_id: USER_STACK_NEXT,
                kernel_stack_id: -14,
                comm: [0; COMM_LEN],
            };
            u.feed(&crate::kernel::events::bytes_of(&s), &mut |e| out.push(e))
                .unwrap();
            u.feed(&stack_rec(3, stack_for::SAMPLE, 0, &[0; 64]), &mut |e| {
                out.push(e)
            })
            .unwrap();
        }
        assert_eq!(out.len(), 2);
        assert_eq!(user_id(&out[0]), user_id(&out[1]));
        assert!(u
            .feed(&stack_rec(3, stack_for::SAMPLE, 0, &[0; 64])[..20], &mut |_| {})
            .is_err());
    }
}
