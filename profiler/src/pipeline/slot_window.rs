//! The slot window: events wait here until their slot has ended, and are
//! cut at slot ends into per-slot aggregators (an off-CPU interval across
//! an end is split there; a thread asleep over several slots is counted in
//! each). What `slotprof run` does slot by slot, and what `replay` does
//! with a recording. Not here: when a slot has ended (the slot sources and
//! `run`'s grace) and what is done with a slot once aggregated (`pipeline`).

use std::collections::HashMap;

use profiler_ebpf::{OffCpuInterval, OffCpuStart};

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
            e => self.events.push(e),
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
                Event::SlotMark(_) | Event::Host(_) => continue,
            };
            if end >= b {
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
        let mut o: OffCpuInterval = unsafe { std::mem::zeroed() };
        o.kind = profiler_ebpf::EventKind::OffCpu as u32;
        (o.tgid, o.tid, o.start_ns, o.end_ns, o.state) = (7, tid, start_ns, end_ns, 1);
        Event::OffCpu(o)
    }

    fn asleep(start_ns: u64) -> OffCpuStart {
        let mut s: OffCpuStart = unsafe { std::mem::zeroed() };
        (s.tgid, s.start_ns, s.state) = (7, start_ns, 1);
        s
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
