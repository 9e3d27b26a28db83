//! The slot window: events wait here until their slot has ended, and are
//! cut at slot ends into per-slot aggregators (an off-CPU interval across
//! an end is split there; a thread asleep over several slots is counted in
//! each). What `slotprof run` does slot by slot, and what `replay` does
//! with a recording. Not here: when a slot has ended (the slot sources and
//! `run`'s grace) and what is done with a slot once aggregated (`pipeline`).

use std::collections::HashMap;

use profiler_ebpf::{FoldState, OffCpuFold, OffCpuInterval, OffCpuStart};

use crate::{
    detectors::Finding,
    kernel::events::Event,
    pipeline::aggregate::Aggregator,
    slot_sources::SharedSlotLog,
    slots::{Slot, Timeline},
};

/// Events waiting for their slot to end, and what was already counted of
/// intervals still open.
#[derive(Default)]
pub(crate) struct Pending {
    pub(crate) events: Vec<Event>,
    /// tid -> (start of its open off-CPU interval, counted up to).
    pub(crate) carried: HashMap<u32, (u64, u64)>,
    /// tid -> what of its kernel-side fold was already taken from its
    /// entry (it slept past a chunk with folded waits not sent yet), and
    /// since when it slept then: its record, when it comes, counts only
    /// the rest, which began after that.
    pub(crate) folds_taken: HashMap<u32, (FoldState, u64)>,
    /// The last main-loop mark processed (a gap spanning slots needs it).
    pub(crate) last_loop_mark: Option<profiler_ebpf::LoopMark>,
    /// Events that came after their slot was processed (dropped, counted).
    pub(crate) late: u64,
    pub(crate) malformed: u64,
    /// Whether a chunk was taken yet: before the first, nothing was
    /// processed, so nothing can be late. (Events of the moments between
    /// the probes' attach and the session's origin end before the first
    /// chunk's start: they were counted as late, ~150 at every start.)
    pub(crate) took_any: bool,
    /// Leader windows' samples with registers, for the cache-line detector.
    pub(crate) cache_windows: crate::pipeline::LeaderWindows,
}

impl Pending {
    pub(crate) fn push(&mut self, slot_log: &SharedSlotLog, e: Event) {
        match e {
            Event::SlotMark(m) => slot_log.lock().unwrap().marks.push((m.ts_ns, m.arg0)),
            Event::OffCpuFold(f) => {
                if let Some(rest) = self.rest_of_fold(f) {
                    self.events.push(Event::OffCpuFold(rest));
                }
            }
            e => self.events.push(e),
        }
    }

    /// A fold record less what was taken of it from its thread's entry.
    fn rest_of_fold(&mut self, mut f: OffCpuFold) -> Option<OffCpuFold> {
        let Some((t, asleep_since)) = self.folds_taken.remove(&f.tid) else {
            return Some(f);
        };
        if t.first_start_ns != f.first_start_ns {
            // Another fold: the one taken was sent before (or is lost).
            return Some(f);
        }
        if f.intervals <= t.intervals || f.last_end_ns <= t.last_end_ns {
            return None;
        }
        f.intervals -= t.intervals;
        f.offcpu_ns = f.offcpu_ns.saturating_sub(t.offcpu_ns);
        f.runnable_ns = f.runnable_ns.saturating_sub(t.runnable_ns);
        f.first_start_ns = t.last_end_ns.max(asleep_since).min(f.last_end_ns - 1);
        Some(f)
    }

    /// Takes the folded waits not sent yet of threads asleep now (their
    /// entries in `open`), as far as they are not taken already: a thread
    /// that folded a few waits and then went to sleep for long sends them
    /// only when it next runs, after their slots were cut. `user_stack`
    /// gives a fold its stack (the thread's exit copy at its registers).
    pub(crate) fn take_sleeping_folds(
        &mut self,
        open: &[(u32, OffCpuStart)],
        pid: u32,
        comm_of: &mut dyn FnMut(u32) -> [u8; profiler_ebpf::COMM_LEN],
        user_stack: &mut dyn FnMut(u32, &FoldState) -> i32,
    ) {
        for (tid, s) in open {
            let f = s.fold;
            if s.tgid != pid || f.intervals == 0 {
                continue;
            }
            // Its name and stack only for what is new (most chunks find
            // nothing new: the thread still asleep).
            let rec = fold_record(*tid, s.tgid, &f, [0; profiler_ebpf::COMM_LEN]);
            if let Some(mut rest) = self.rest_of_fold(rec) {
                rest.comm = comm_of(*tid);
                rest.user_stack_id = user_stack(*tid, &f);
                self.events.push(Event::OffCpuFold(rest));
            }
            self.folds_taken.insert(*tid, (f, s.start_ns));
        }
    }

    /// Moves every event that ended before `b` (clipped at `c`, the end of
    /// the previous chunk) into `agg`; splits off-CPU intervals at `b`.
    pub(crate) fn take_until(&mut self, c: u64, b: u64, agg: &mut Aggregator) {
        let mut keep = Vec::new();
        if let Some(m) = self.last_loop_mark {
            agg.seed_loop_mark(m);
        }
        for ev in std::mem::take(&mut self.events) {
            let (start, end) = match &ev {
                Event::Sample(s) => (s.ts_ns, s.ts_ns),
                Event::UserRegs(r) => (r.ts_ns, r.ts_ns),
                Event::LoopMark(m) => (m.ts_ns, m.ts_ns),
                Event::Madvise(m) => (m.start_ns, m.end_ns),
                Event::MemStall(m) => (m.start_ns, m.end_ns),
                Event::CacheWork(w) => (w.start_ns, w.end_ns),
                Event::FutexWait(f) => (f.start_ns, f.end_ns),
                Event::OffCpu(o) => (o.start_ns, o.end_ns),
                Event::OffCpuFold(f) => (f.first_start_ns, f.last_end_ns),
                Event::SlotMark(_) | Event::Host(_) => continue,
            };
            if end >= b {
                if let Event::OffCpuFold(f) = ev {
                    if start < b {
                        let (before, after) = split_fold(&f, b);
                        count_fold(before, c, agg);
                        keep.push(Event::OffCpuFold(after));
                        continue;
                    }
                }
                if let Event::OffCpu(o) = ev {
                    if o.start_ns < b {
                        let (mut before, mut after) = (o, o);
                        before.end_ns = b;
                        after.start_ns = b;
                        self.count_interval(before, c, agg);
                        keep.push(Event::OffCpu(after));
                        continue;
                    }
                }
                keep.push(ev);
                continue;
            }
            if end < c && start < c && self.took_any {
                self.late += 1;
                continue;
            }
            match ev {
                Event::OffCpu(o) => self.count_interval(o, c, agg),
                Event::OffCpuFold(f) => count_fold(f, c, agg),
                Event::LoopMark(m) => {
                    self.last_loop_mark = Some(m);
                    agg.ingest(&ev);
                }
                _ => agg.ingest(&ev),
            }
        }
        self.events = keep;
        self.took_any = true;
    }

    /// Counts an interval from where it was not yet counted.
    fn count_interval(&mut self, mut o: OffCpuInterval, c: u64, agg: &mut Aggregator) {
        if let Some(&(start, until)) = self.carried.get(&o.tid) {
            if start == o.start_ns {
                o.start_ns = o.start_ns.max(until);
                if o.end_ns <= until {
                    return;
                }
            }
        }
        o.start_ns = o.start_ns.max(c);
        if o.end_ns > o.start_ns {
            agg.interval(&o, false);
        }
    }

    /// Counts threads still off-CPU at `b` up to `b`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn count_open(
        &mut self,
        open: &[(u32, OffCpuStart)],
        pid: u32,
        c: u64,
        b: u64,
        min_ns: u64,
        agg: &mut Aggregator,
        stacks_of: &mut dyn FnMut(u32, &OffCpuStart) -> (i32, i32),
    ) {
        let open_tids: std::collections::HashSet<u32> = open.iter().map(|(t, _)| *t).collect();
        self.carried.retain(|tid, _| open_tids.contains(tid));
        for (tid, s) in open {
            if s.tgid != pid || s.start_ns >= b || b - s.start_ns < min_ns {
                continue;
            }
            let from = match self.carried.get(tid) {
                Some(&(start, until)) if start == s.start_ns => until,
                _ => s.start_ns,
            }
            .max(c);
            if b > from {
                let comm =
                    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap_or_default();
                let mut part = *s;
                part.start_ns = from;
                (part.user_stack_id, part.kernel_stack_id) = stacks_of(*tid, s);
                agg.still_off_cpu(*tid, &part, b, comm.trim_end());
            }
            self.carried.insert(*tid, (s.start_ns, b));
        }
    }
}

/// A kernel-side fold as the record it would go out as (its user stack
/// still to be given).
pub(crate) fn fold_record(
    tid: u32,
    tgid: u32,
    f: &FoldState,
    comm: [u8; profiler_ebpf::COMM_LEN],
) -> OffCpuFold {
    OffCpuFold {
        kind: profiler_ebpf::EventKind::OffCpuFold as u32,
        cpu: 0,
        first_start_ns: f.first_start_ns,
        last_end_ns: f.last_end_ns,
        tgid,
        tid,
        offcpu_ns: f.offcpu_ns,
        runnable_ns: f.runnable_ns,
        intervals: f.intervals,
        kernel_stack_id: profiler_ebpf::KERNEL_STACK_SYSCALL_WAIT - f.syscall_nr,
        user_stack_id: profiler_ebpf::USER_STACK_AT_EXIT_COPY,
        state: f.state,
        ip: f.ip,
        sp: f.sp,
        bp: f.bp,
        comm,
    }
}

/// A fold cut at `b`: its time and waits shared between the parts by
/// their share of its span (the waits' own order within it is not known).
fn split_fold(f: &OffCpuFold, b: u64) -> (OffCpuFold, OffCpuFold) {
    let span = (f.last_end_ns - f.first_start_ns) as u128;
    let part = |x: u64| (x as u128 * (b - f.first_start_ns) as u128 / span) as u64;
    let (mut before, mut after) = (*f, *f);
    before.last_end_ns = b;
    before.offcpu_ns = part(f.offcpu_ns);
    before.runnable_ns = part(f.runnable_ns);
    before.intervals = part(u64::from(f.intervals)) as u32;
    after.first_start_ns = b;
    after.offcpu_ns = f.offcpu_ns - before.offcpu_ns;
    after.runnable_ns = f.runnable_ns - before.runnable_ns;
    after.intervals = f.intervals - before.intervals;
    (before, after)
}

/// Counts a fold from `c` on (what came before it was in a chunk already
/// processed: its share is left out, as a late interval's is).
fn count_fold(f: OffCpuFold, c: u64, agg: &mut Aggregator) {
    if f.last_end_ns <= c {
        return;
    }
    let f = if f.first_start_ns < c {
        split_fold(&f, c).1
    } else {
        f
    };
    agg.fold(&f);
}

/// Gives each finding without a slot the slot it began in, or the first of
/// `slots` when it began before them (a gap across the boundary).
pub(crate) fn place_in_slots(findings: &mut [Finding], timeline: &Timeline, slots: &[Slot]) {
    for f in findings.iter_mut().filter(|f| f.slot.is_none()) {
        f.slot = Some(
            timeline
                .slot_at(f.start_ns)
                .map_or(slots[0].number, |i| slots[i].number),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::aggregate::tests::sample_at;

    fn sample(ts: u64) -> Event {
        sample_at(ts, -1)
    }

    #[test]
    fn events_before_the_first_chunk_are_not_late_and_after_a_chunk_they_are() {
        let log = SharedSlotLog::default();
        let mut p = Pending::default();
        // Taken between the attach and the origin (100), before any chunk.
        p.push(&log, sample(90));
        p.push(&log, sample(150));
        p.push(&log, sample(250));
        let mut agg = Aggregator::new();
        p.take_until(100, 200, &mut agg);
        assert_eq!(p.late, 0);
        assert_eq!(agg.samples, 2, "both before 200 are aggregated");
        assert_eq!(p.events.len(), 1, "the one after 200 waits");
        // Now a sample of the processed chunk comes: late.
        p.push(&log, sample(180));
        let mut agg = Aggregator::new();
        p.take_until(200, 300, &mut agg);
        assert_eq!(p.late, 1);
        assert_eq!(agg.samples, 1);
    }

    fn off_cpu(tid: u32, start_ns: u64, end_ns: u64) -> Event {
        // SAFETY: a plain-data record (integers and byte arrays): all zeros is a valid value.
        let mut o: OffCpuInterval = unsafe { std::mem::zeroed() };
        o.kind = profiler_ebpf::EventKind::OffCpu as u32;
        (o.tgid, o.tid, o.start_ns, o.end_ns, o.state) = (7, tid, start_ns, end_ns, 1);
        Event::OffCpu(o)
    }

    fn asleep(start_ns: u64) -> OffCpuStart {
        // SAFETY: a plain-data record (integers and byte arrays): all zeros is a valid value.
        let mut s: OffCpuStart = unsafe { std::mem::zeroed() };
        (s.tgid, s.start_ns, s.state) = (7, start_ns, 1);
        s
    }

    fn fold(tid: u32, first: u64, last: u64, waits: u32, ns: u64) -> FoldState {
        FoldState {
            first_start_ns: first,
            last_end_ns: last,
            offcpu_ns: ns,
            intervals: waits,
            syscall_nr: 202,
            state: 1,
            ip: 0x40,
            sp: 0x7f00 + u64::from(tid),
            ..FoldState::EMPTY
        }
    }

    /// A fold across a boundary is split there by its span: its time and
    /// waits shared out, none counted twice or lost.
    #[test]
    fn a_fold_across_a_boundary_is_shared_by_its_span() {
        let log = SharedSlotLog::default();
        let mut p = Pending::default();
        p.push(
            &log,
            Event::OffCpuFold(fold_record(3, 7, &fold(3, 150, 250, 10, 40), [0; 16])),
        );
        let mut agg = Aggregator::new();
        p.take_until(100, 200, &mut agg);
        assert_eq!(
            (agg.offcpu_intervals, agg.offcpu_ns),
            (5, 20),
            "half its span, half its time"
        );
        assert_eq!(agg.offcpu_folded, 5);
        let mut agg2 = Aggregator::new();
        p.take_until(200, 300, &mut agg2);
        assert_eq!((agg2.offcpu_intervals, agg2.offcpu_ns), (5, 20));
        assert!(p.events.is_empty());
        assert_eq!(p.late, 0);
    }

    /// A thread asleep past a chunk with folded waits not sent: they are
    /// taken from its entry; when its record comes, only what was folded
    /// since counts; a record of another fold counts whole.
    #[test]
    fn folds_taken_from_a_sleepers_entry_are_not_counted_again() {
        let log = SharedSlotLog::default();
        let mut p = Pending::default();
        let mut s = asleep(180);
        s.fold = fold(3, 100, 170, 7, 35);
        let open = [(3, s)];
        let mut user = |_: u32, _: &FoldState| 99;
        p.take_sleeping_folds(&open, 7, &mut |_| [b'w'; 16], &mut user);
        // Asleep still at the next chunk: nothing new.
        p.take_sleeping_folds(&open, 7, &mut |_| [b'w'; 16], &mut user);
        let mut agg = Aggregator::new();
        p.take_until(100, 180, &mut agg);
        assert_eq!((agg.offcpu_intervals, agg.offcpu_ns), (7, 35));
        // It woke, folded three more (after it fell asleep at 180: the
        // last of them its sleep then), and sent the fold: the three
        // count, from 180 on.
        let mut rec = fold_record(3, 7, &fold(3, 100, 260, 10, 50), [b'w'; 16]);
        rec.user_stack_id = 99;
        p.push(&log, Event::OffCpuFold(rec));
        match &p.events[..] {
            [Event::OffCpuFold(f)] => {
                assert_eq!(
                    (f.first_start_ns, f.last_end_ns, f.intervals, f.offcpu_ns),
                    (180, 260, 3, 15)
                )
            }
            other => panic!("{other:?}"),
        }
        let mut agg = Aggregator::new();
        p.take_until(180, 300, &mut agg);
        assert_eq!((agg.offcpu_intervals, agg.offcpu_ns), (3, 15));
        // A later fold of the same thread counts whole.
        p.push(
            &log,
            Event::OffCpuFold(fold_record(3, 7, &fold(3, 310, 390, 4, 30), [0; 16])),
        );
        let mut agg = Aggregator::new();
        p.take_until(300, 400, &mut agg);
        assert_eq!((agg.offcpu_intervals, agg.offcpu_ns), (4, 30));
        // Another process's entry is not ours.
        let mut other = asleep(180);
        other.tgid = 8;
        other.fold = fold(4, 100, 170, 7, 35);
        p.take_sleeping_folds(&[(4, other)], 7, &mut |_| [0; 16], &mut user);
        assert!(p.events.is_empty());
    }

    /// An interval across a boundary is split there: the part before in
    /// the chunk that ends there, the rest in the next; nothing counted
    /// twice or lost.
    #[test]
    fn an_interval_across_a_boundary_is_split_at_it() {
        let log = SharedSlotLog::default();
        let mut p = Pending::default();
        p.push(&log, off_cpu(3, 150, 260));
        let mut agg = Aggregator::new();
        p.take_until(100, 200, &mut agg);
        assert_eq!((agg.offcpu_intervals, agg.offcpu_ns), (1, 50));
        assert_eq!(p.events.len(), 1, "the part after 200 waits");
        let mut agg = Aggregator::new();
        p.take_until(200, 300, &mut agg);
        assert_eq!((agg.offcpu_intervals, agg.offcpu_ns), (1, 60));
        assert!(p.events.is_empty());
        assert_eq!(p.late, 0);
    }

    /// A thread asleep over several chunks is counted in each up to its
    /// boundary (from the kernel's start record), and when its interval
    /// finally ends only the part after the last boundary is added.
    #[test]
    fn a_thread_asleep_over_chunks_is_counted_once_per_stretch() {
        let log = SharedSlotLog::default();
        let mut p = Pending::default();
        let mut no_stacks = |_: u32, _: &OffCpuStart| (-1, -1);
        let open = [(3u32, asleep(150))];
        let mut agg = Aggregator::new();
        p.take_until(100, 200, &mut agg);
        p.count_open(&open, 7, 100, 200, 10, &mut agg, &mut no_stacks);
        assert_eq!(agg.offcpu_ns, 50, "150..200");
        let mut agg = Aggregator::new();
        p.take_until(200, 300, &mut agg);
        p.count_open(&open, 7, 200, 300, 10, &mut agg, &mut no_stacks);
        assert_eq!(agg.offcpu_ns, 100, "200..300");
        // It wakes at 340: the interval 150..340 arrives whole.
        p.push(&log, off_cpu(3, 150, 340));
        let mut agg = Aggregator::new();
        p.take_until(300, 400, &mut agg);
        p.count_open(&[], 7, 300, 400, 10, &mut agg, &mut no_stacks);
        assert_eq!((agg.offcpu_intervals, agg.offcpu_ns), (1, 40), "300..340 only");
        assert!(p.carried.is_empty(), "a thread no longer asleep is forgotten");
    }

    /// Threads of another process, sleeps that began after the boundary,
    /// and sleeps shorter than the minimum so far are not counted yet.
    #[test]
    fn open_sleeps_of_others_after_the_boundary_or_too_short_are_not_counted() {
        let mut p = Pending::default();
        let mut other = asleep(120);
        other.tgid = 8;
        let open = [(3u32, other), (4, asleep(250)), (5, asleep(195))];
        let mut agg = Aggregator::new();
        p.count_open(&open, 7, 100, 200, 10, &mut agg, &mut |_, _| (-1, -1));
        assert_eq!(agg.offcpu_intervals, 0);
    }
}
