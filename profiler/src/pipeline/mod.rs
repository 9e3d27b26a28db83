//! What every mode does with a window of events once the kernel side has
//! delivered them, with no kernel in reach: [`aggregate`] (events -> logs
//! and totals, per-thread and per-slot profiles), [`intervals`] (the
//! off-CPU intervals, spilled to a file past a bound by [`spill`]), [`slot_window`]
//! (events held until their slot ends and cut at slot ends: the always-on
//! path), and here the detectors over a window with its stacks named
//! ([`detect`]) and the cache-line detector over the samples' decoded
//! memory accesses ([`cache_lines`], [`LeaderWindows`] for run's leader
//! windows). [`replay`] runs all of it on a recording.
//!
//! `session` (attach/record: one window, the session) and `run` (one
//! window per batch of finished slots) both call these. Not here: the
//! probes and the ring (`kernel`), the detectors themselves (`detectors`),
//! files (`export`); the symbolizer reads the target's files and memory.

pub mod aggregate;
pub mod futex_store;
pub mod intervals;
pub mod replay;
pub mod slot_window;
pub mod spill;

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use symbolizer::Symbolizer;

use crate::{
    detectors::memory_access::{DecodeStats, MemoryAccess},
    detectors::{self, cache_line_ping_pong::AddressNames, DetectorConfig, Finding, Inputs, NameStack},
    pipeline::aggregate::{Aggregator, StackNamer, StackTable},
    records::Interval,
    slots::Buckets,
    topology::Topology,
};
use profiler_ebpf::UserRegs;

/// The findings of every detector but the cache-line one over `agg`'s
/// events, bucketed by `buckets`; stacks are named from `table` (kernel
/// ids) and `sym`.
pub fn detect(
    agg: &Aggregator,
    pid: u32,
    short_futex: &[(u64, u64, u64)],
    config: &DetectorConfig,
    buckets: &Buckets,
    table: &StackTable,
    sym: &mut Symbolizer,
) -> std::io::Result<Vec<Finding>> {
    let mut namer = StackNamer::new(table, sym);
    detect_named(agg, pid, short_futex, config, buckets, &mut |tgid, id, kernel| {
        namer.part(tgid, id, kernel)
    })
}

/// [`detect`] with stacks named by `names` ((tgid, stack id, kernel) ->
/// frames, root first): a live session's symbolizer, or a recording's
/// names when it is replayed (`replay`).
pub fn detect_named(
    agg: &Aggregator,
    pid: u32,
    short_futex: &[(u64, u64, u64)],
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> std::io::Result<Vec<Finding>> {
    let thread_names = agg.thread_names();
    let intervals = detector_intervals(agg, config, &thread_names)?;
    let inputs = inputs(agg, pid, short_futex, &thread_names, &intervals);
    Ok(detectors::run_all(&inputs, config, buckets, names))
}

/// What the detectors read, from what `agg` counted; `intervals` are
/// those of the threads the detectors look at ([`detector_intervals`]).
pub fn inputs<'a>(
    agg: &'a Aggregator,
    pid: u32,
    short_futex: &'a [(u64, u64, u64)],
    thread_names: &'a HashMap<u32, String>,
    intervals: &'a [Interval],
) -> Inputs<'a> {
    Inputs {
        pid,
        samples: agg.samples(),
        intervals,
        madvise: &agg.madvise_log,
        mem_stalls: &agg.mem_stall_log,
        cache_work: &agg.cache_work_log,
        futex: (&agg.futex_log).into(),
        loop_marks: &agg.loop_marks,
        short_futex,
        thread_names,
    }
}

/// The off-CPU intervals the detectors read: the hot threads' (the loop
/// thread's for the gap detector, all of theirs for CPU contention; the
/// others read no intervals).
pub fn detector_intervals(
    agg: &Aggregator,
    config: &DetectorConfig,
    thread_names: &HashMap<u32, String>,
) -> std::io::Result<Vec<Interval>> {
    let tids = crate::detectors::hot_tids(thread_names, &agg.loop_marks, config);
    if tids.is_empty() {
        return Ok(Vec::new());
    }
    agg.intervals().of_threads(&tids)
}

/// What the cache-line detector saw and found.
pub struct CacheLines {
    /// Memory accesses decoded from the samples.
    pub accesses: Vec<MemoryAccess>,
    /// Why the other samples gave none.
    pub decoding: DecodeStats,
    pub findings: Vec<Finding>,
}

/// Decodes the user-mode samples with registers (`regs`) into memory
/// accesses and ranks the cache lines two threads share across CPUs;
/// `log` keeps every name the detector asked for (`--save-replay`).
pub fn cache_lines(
    regs: &[UserRegs],
    pid: u32,
    thread_names: &HashMap<u32, String>,
    topology: &Topology,
    threshold: f64,
    sym: &mut Symbolizer,
    log: Option<&mut AddressLog>,
) -> CacheLines {
    let (accesses, decoding) = crate::detectors::memory_access::decode(regs, sym);
    let mut names = Logged {
        inner: &mut SymNames { sym, pid },
        log,
    };
    let sampled = regs.iter().map(|r| r.tid);
    let findings = cache_line_findings(
        &accesses,
        sampled,
        pid,
        thread_names,
        topology,
        threshold,
        &mut names,
    );
    CacheLines {
        accesses,
        decoding,
        findings,
    }
}

/// The cache-line detector over decoded `accesses`; `sampled` holds the
/// thread of every user-mode sample with registers (each thread's share's
/// denominator). What a live session and a replay both run.
pub fn cache_line_findings(
    accesses: &[MemoryAccess],
    sampled: impl IntoIterator<Item = u32>,
    pid: u32,
    thread_names: &HashMap<u32, String>,
    topology: &Topology,
    threshold: f64,
    names: &mut dyn AddressNames,
) -> Vec<Finding> {
    let mut per_thread = BTreeMap::new();
    for tid in sampled {
        *per_thread.entry(tid).or_insert(0u64) += 1;
    }
    // The detector reads only the pid and the thread names of its inputs.
    let inputs = Inputs::empty(pid, thread_names);
    detectors::cache_line_ping_pong::detect(&inputs, accesses, &per_thread, topology, threshold, names)
}

/// The code and data names the cache-line detector asked for, as they
/// were resolved: what a recording keeps for its replay.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AddressLog {
    pub code: BTreeMap<u64, String>,
    pub data: BTreeMap<u64, String>,
}

impl AddressNames for AddressLog {
    /// A name the live session resolved (empty when it was never asked).
    fn code(&mut self, addr: u64) -> String {
        self.code.get(&addr).cloned().unwrap_or_default()
    }

    fn data(&mut self, addr: u64) -> String {
        self.data.get(&addr).cloned().unwrap_or_default()
    }
}

/// Names from `inner`, noted in `log` when there is one.
struct Logged<'a> {
    inner: &'a mut dyn AddressNames,
    log: Option<&'a mut AddressLog>,
}

impl AddressNames for Logged<'_> {
    fn code(&mut self, addr: u64) -> String {
        let name = self.inner.code(addr);
        if let Some(log) = self.log.as_mut() {
            log.code.insert(addr, name.clone());
        }
        name
    }

    fn data(&mut self, addr: u64) -> String {
        let name = self.inner.data(addr);
        if let Some(log) = self.log.as_mut() {
            log.data.insert(addr, name.clone());
        }
        name
    }
}

/// Code and data names for the cache-line detector.
struct SymNames<'a> {
    sym: &'a mut Symbolizer,
    pid: u32,
}

impl AddressNames for SymNames<'_> {
    fn code(&mut self, addr: u64) -> String {
        let name = self
            .sym
            .user_frame(self.pid, addr, false)
            .last()
            .cloned()
            .unwrap_or_default();
        match self.sym.function_start(self.pid, addr) {
            Some(start) => format!("{name}+{:#x}", addr - start),
            None => name,
        }
    }

    fn data(&mut self, addr: u64) -> String {
        self.sym.data_name(self.pid, addr)
    }
}

/// The samples with registers of each leader window, gathered over the
/// batches its slots come in (`run` processes finished slots as they
/// end), for the cache-line detector: one slot's samples at 49 Hz are too
/// few for it (its 95% lower bound on a line's share of a thread's samples
/// needs tens), a window's four slots give it ~4x more. A window is
/// analysed when its last slot is in; one whose slots do not all arrive (it
/// began before slotprof did, or a slot was missed) is dropped unanalysed.
#[derive(Default)]
pub struct LeaderWindows {
    /// First slot -> (slots seen, samples).
    open: BTreeMap<u64, (u64, Vec<UserRegs>)>,
}

impl LeaderWindows {
    /// Adds `slots` (consecutive, in order) and the samples of `regs` that
    /// fall in their leader slots; returns each window this completed, as
    /// (its last slot, its samples).
    pub fn add(&mut self, slots: &[crate::slots::Slot], regs: &[UserRegs]) -> Vec<(u64, Vec<UserRegs>)> {
        let mut done = Vec::new();
        for s in slots {
            // A window's slots are consecutive: one this slot is not in is over.
            self.open.retain(|w, _| Some(*w) == s.window);
            let Some(w) = s.window else { continue };
            let e = self.open.entry(w).or_default();
            e.0 += 1;
            e.1.extend(
                regs.iter()
                    .filter(|r| r.ts_ns >= s.start_ns && r.ts_ns < s.end_ns)
                    .copied(),
            );
            if e.0 == crate::slots::SLOTS_PER_WINDOW {
                let (_, samples) = self.open.remove(&w).unwrap_or_default();
                done.push((s.number, samples));
            }
        }
        done
    }

    /// [`add`](Self::add), then the cache-line findings of each completed
    /// window, placed in its last slot.
    pub fn findings(
        &mut self,
        slots: &[crate::slots::Slot],
        agg: &Aggregator,
        pid: u32,
        topology: &Topology,
        threshold: f64,
        sym: &mut Symbolizer,
    ) -> Vec<Finding> {
        let mut out = Vec::new();
        let thread_names = agg.thread_names();
        for (last, samples) in self.add(slots, &agg.user_regs) {
            let found = cache_lines(&samples, pid, &thread_names, topology, threshold, sym, None);
            out.extend(found.findings.into_iter().map(|mut f| {
                f.slot = Some(last);
                f
            }));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::LeaderWindows;
    use crate::slots::Slot;
    use profiler_ebpf::UserRegs;

    fn slot(number: u64, window: Option<u64>) -> Slot {
        Slot {
            number,
            start_ns: number * 400,
            end_ns: number * 400 + 400,
            leader: window.is_some(),
            window,
            aligned: true,
        }
    }

    fn regs(ts_ns: u64) -> UserRegs {
        // SAFETY: a plain-data record (integers): all zeros is a valid value.
        let mut r: UserRegs = unsafe { std::mem::zeroed() };
        r.ts_ns = ts_ns;
        r
    }

    #[test]
    fn a_window_is_analysed_once_its_fourth_slot_is_in_across_batches_with_its_own_samples() {
        let mut w = LeaderWindows::default();
        let samples: Vec<UserRegs> = (0..12u64).map(|i| regs(i * 200 + 100)).collect();
        // Slots 0-1 not leader, 2-5 a window, split over two batches.
        assert!(w
            .add(&[slot(0, None), slot(1, None), slot(2, Some(2))], &samples)
            .is_empty());
        let done = w.add(&[slot(3, Some(2)), slot(4, Some(2)), slot(5, Some(2))], &samples);
        assert_eq!(done.len(), 1);
        let (last, got) = &done[0];
        assert_eq!(*last, 5);
        // Two samples per 400 ns slot, slots 2..=5 span 800..2400.
        let ts: Vec<u64> = got.iter().map(|r| r.ts_ns).collect();
        assert_eq!(ts, vec![900, 1100, 1300, 1500, 1700, 1900, 2100, 2300]);
    }

    #[test]
    fn a_window_cut_short_is_dropped_not_analysed_later() {
        let mut w = LeaderWindows::default();
        // Slots 2-3 of window 0 (it began before slotprof), then a
        // follower slot: window 0 is over, with two slots.
        assert!(w
            .add(&[slot(2, Some(0)), slot(3, Some(0)), slot(4, None)], &[])
            .is_empty());
        assert!(w.open.is_empty());
        // A later window completes on its own.
        let done = w.add(
            &[
                slot(8, Some(8)),
                slot(9, Some(8)),
                slot(10, Some(8)),
                slot(11, Some(8)),
            ],
            &[],
        );
        assert_eq!(done.iter().map(|d| d.0).collect::<Vec<_>>(), vec![11]);
    }
}
