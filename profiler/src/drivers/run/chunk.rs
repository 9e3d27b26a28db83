//! A run of finished slots: their events through a fresh aggregator, the
//! detectors and the export; what was lost, said.

use super::*;

/// Slots that ended (with the grace) after `after_ns` and before `now`.
pub(super) fn finished_slots(
    spec: &SlotSourceSpec,
    log: &SharedSlotLog,
    (origin, base): (u64, u64),
    after_ns: u64,
    now: u64,
) -> Vec<Slot> {
    let cutoff = now.saturating_sub(GRACE_NS);
    let timeline = match spec {
        // An origin given is the user's numbering; the default one goes on
        // from the export's.
        SlotSourceSpec::Clock {
            slot,
            origin_ns: Some(o),
            leader,
        } => Timeline::clock(*slot, *o, *leader, after_ns, cutoff),
        SlotSourceSpec::Clock {
            slot,
            origin_ns: None,
            leader,
        } => Timeline::clock_from(*slot, (origin, base), *leader, after_ns, cutoff),
        SlotSourceSpec::Rpc(_) => log.lock().unwrap().timeline(now),
        SlotSourceSpec::Uprobe { numbers, .. } => log.lock().unwrap().uprobe_timeline(*numbers, now),
    };
    timeline
        .slots()
        .iter()
        .filter(|s| s.start_ns >= after_ns && s.end_ns <= cutoff && s.end_ns < now)
        .cloned()
        .collect()
}

/// Returns freed heap memory to the system. Writing an hour's or a
/// window's flamegraphs takes tens of MiB for a moment, and glibc keeps
/// what is freed: without this the daemon's resident memory stays at that
/// peak (measured: 46 -> 63 MiB at the first hour change, then flat).
/// Every 10 s; it costs well under a millisecond.
pub(crate) fn give_back_freed_memory() {
    crate::sys::malloc_trim();
}

/// The guest-side phase probe over the last minute.
pub(super) struct Phase {
    pub(super) probe: crate::phase::probe::RunningProbe,
    pub(super) every: Duration,
    pub(super) cpus: Vec<u32>,
    pub(super) windows: std::collections::VecDeque<crate::phase::probe::Window>,
    pub(super) strongest: Option<crate::phase::analysis::CpuPhases>,
    pub(super) analysed: Option<Instant>,
}

impl Phase {
    /// Starts the phase probe on the configured CPUs (all online ones by
    /// default).
    pub(super) fn start(c: &crate::phase::probe::PhaseProbeConfig) -> Phase {
        let cpus = c.cpus();
        Phase {
            probe: crate::phase::probe::start(c),
            every: c.every,
            cpus,
            windows: Default::default(),
            strongest: None,
            analysed: None,
        }
    }

    pub(super) fn of(&mut self, ts: u64) -> Option<&'static str> {
        let new = self.probe.take();
        self.windows.extend(new);
        let horizon = monotonic_ns().saturating_sub(60_000_000_000);
        while self.windows.front().is_some_and(|w| w.ts_ns < horizon) {
            self.windows.pop_front();
        }
        if self
            .analysed
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(10))
        {
            self.analysed = Some(Instant::now());
            let w: Vec<_> = self.windows.iter().cloned().collect();
            self.strongest = self
                .cpus
                .iter()
                .filter_map(|&cpu| crate::phase::analysis::analyze_cpu(cpu, &w, self.every))
                .max_by(|a, b| a.slowdown.total_cmp(&b.slowdown));
        }
        let p = self.strongest.as_ref().filter(|p| p.slowdown >= 0.05)?;
        crate::phase::analysis::slow_at(p, ts).map(|slow| if slow { "slow" } else { "fast" })
    }
}

pub(super) fn meta(target: &Target, config: &Config) -> ProfileMeta {
    ProfileMeta {
        time_nanos: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as i64,
        duration_nanos: 0,
        period_type: Some(SampleType::new("cpu", "nanoseconds")),
        period: (1_000_000_000 / config.spec.frequency_hz.max(1)) as i64,
        comments: vec![format!(
            "{} (pid {}), always-on at {} Hz, slotprof {}",
            target.comm,
            target.pid,
            config.spec.frequency_hz,
            crate::VERSION
        )],
    }
}

/// Lost events so far: earlier attachments' plus this one's. Returns this
/// attachment's counts by cause (None when the kernel's counters cannot be
/// read: the totals keep their last known values). `last`: this
/// attachment ends; its counts (the last read) carry over to the next.
pub(super) fn update_lost(
    snapshot: &Arc<Mutex<Snapshot>>,
    probes: &Probes,
    pending: &Pending,
    backlog_full: u64,
    before: &mut HashMap<String, u64>,
    last: bool,
) -> Option<[(&'static str, u64); 7]> {
    let now = probes.counters().ok().map(|c| {
        [
            ("ring_buffer_full", c.ring_full),
            ("backlog_full", backlog_full),
            ("stacks", c.stack_lost),
            ("offcpu_map_full", c.offcpu_start_lost),
            ("syscall_map_full", c.syscall_start_lost),
            ("malformed", pending.malformed),
            ("late", pending.late),
        ]
    });
    let mut s = snapshot.lock().unwrap();
    for (k, v) in now.into_iter().flatten() {
        s.lost
            .insert(k.to_string(), before.get(k).copied().unwrap_or(0) + v);
    }
    if last {
        // The totals shown so far become the next attachment's base (a
        // failed last read keeps the counts read before it).
        *before = s.lost.iter().map(|(k, v)| (k.clone(), *v)).collect();
    }
    now
}

/// Says when events are lost, by cause, at most once a minute, with the
/// longest stretch slotprof's own loop was busy and the most it had
/// queued since the last report: a loss is never silent, and the line
/// says whether slotprof (busy for seconds) or the event rate was why.
#[derive(Default)]
pub(super) struct LossReport {
    pub(super) said: HashMap<&'static str, u64>,
    pub(super) last: Option<std::time::Instant>,
    pub(super) busiest: Duration,
    pub(super) most_queued: usize,
}

impl LossReport {
    pub(super) fn busy(&mut self, took: Duration, queued: usize) {
        self.busiest = self.busiest.max(took);
        self.most_queued = self.most_queued.max(queued);
    }

    /// The line to print, when something was lost since the last one (a
    /// minute ago or more).
    pub(super) fn check(&mut self, now: &[(&'static str, u64)], slot: Option<u64>) -> Option<String> {
        if self.last.is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            return None;
        }
        let new: Vec<String> = now
            .iter()
            .filter(|&&(_, v)| v > 0)
            .filter_map(|&(k, v)| {
                let d = v - self.said.get(k).copied().unwrap_or(0).min(v);
                (d > 0).then(|| format!("{d} {k}"))
            })
            .collect();
        if new.is_empty() {
            return None;
        }
        let line = format!(
            "slotprof: warning: events lost{}: {}; slotprof's loop was busy up to {:.0} ms at a time and held up to {:.1} MiB \
             queued (the slotprof_lost_events_total metric counts them)",
            slot.map(|s| format!(" (near slot {s})")).unwrap_or_default(),
            new.join(", "),
            self.busiest.as_secs_f64() * 1e3,
            self.most_queued as f64 / (1 << 20) as f64
        );
        self.said = now.iter().copied().collect();
        self.last = Some(std::time::Instant::now());
        self.busiest = Duration::ZERO;
        self.most_queued = 0;
        Some(line)
    }
}

/// `run`'s side of the event stream: events wait in `pending` until their
/// slot ends; slot marks go to the slot log.
pub(super) struct RunSink<'a> {
    pub(super) pending: &'a mut Pending,
    pub(super) slot_log: &'a SharedSlotLog,
}

impl stream::Sink for RunSink<'_> {
    fn event(&mut self, event: Event) {
        self.pending.push(self.slot_log, event);
    }

    fn malformed(&mut self) {
        self.pending.malformed += 1;
    }
}

/// What processing a run of finished slots needs.
pub(super) struct Chunk<'a> {
    pub(super) config: Config,
    pub(super) target: &'a Target,
    pub(super) topology: &'a crate::topology::Topology,
    pub(super) exporter: &'a mut always_on::Exporter,
    /// Pushes each slot to a profiling backend (`[push]`).
    pub(super) pusher: Option<&'a mut Pusher>,
    pub(super) snapshot: &'a Arc<Mutex<Snapshot>>,
    /// Asks for each exported leader slot's block.
    pub(super) blocks: Option<&'a crate::slot_sources::blocks::Fetcher>,
}

/// A batch of finished slots, aggregated, with what the kernel told of
/// them: all that [`Chunk::analyze_and_export`] reads.
pub(super) struct Window<'a> {
    /// Consecutive, finished.
    pub(super) slots: &'a [Slot],
    /// Where the batch's events begin (the end of the previous batch).
    pub(super) from: u64,
    pub(super) agg: &'a Aggregator,
    pub(super) table: &'a crate::pipeline::aggregate::StackTable,
    pub(super) short_futex: &'a [(u64, u64, u64)],
    /// The kernel's memory pressure readings.
    pub(super) psi: Option<&'a crate::kernel::psi::PsiSampler>,
}

impl Chunk<'_> {
    /// Names the stacks of a batch of slots, runs the detectors on it
    /// (and the cache-line one on leader windows it completes), and exports
    /// each slot; no kernel access.
    pub(super) fn analyze_and_export(
        &mut self,
        w: &Window,
        cache_windows: &mut crate::pipeline::LeaderWindows,
        sym: &mut Symbolizer,
        mut phase: Option<&mut Phase>,
    ) -> anyhow::Result<()> {
        let (slots, c, agg, table) = (w.slots, w.from, w.agg, w.table);
        let timeline = Timeline::new(slots.to_vec());
        let per_slot = agg.resolve_slots(&timeline, table, sym)?;
        let buckets = crate::slots::Buckets::new(Some(&timeline), c);
        let mut findings = crate::pipeline::detect(
            agg,
            self.target.pid,
            w.short_futex,
            &self.config.spec.detectors,
            &buckets,
            table,
            sym,
        )?;
        findings.extend(cache_windows.findings(
            slots,
            agg,
            self.target.pid,
            self.topology,
            self.config.spec.detectors.pingpong_threshold,
            sym,
        ));
        place_in_slots(&mut findings, &timeline, slots);
        let meta = meta(self.target, &self.config);
        let period_ns = 1_000_000_000 / self.config.spec.frequency_hz.max(1);
        self.snapshot.lock().unwrap().samples += agg.samples;
        for (slot, p) in slots.iter().zip(&per_slot) {
            let phase = phase
                .as_deref_mut()
                .and_then(|ph| ph.of(slot.start_ns + slot.duration_ns() / 2));
            let result = SlotResult {
                slot,
                profiles: p,
                findings: &findings,
                phase,
                memory_pressure: w.psi.and_then(|psi| psi.over(slot.start_ns, slot.end_ns)),
                meta: &meta,
                period_ns,
            };
            self.exporter.slot(&result)?;
            if let Some(p) = self.pusher.as_deref_mut() {
                p.slot(&result)?;
            }
            metrics::SlotMetrics(self.snapshot).slot(&result)?;
            match self.blocks.filter(|_| slot.leader) {
                Some(b) if slot.aligned => b.ended(slot.number),
                Some(b) => b.not_asked(),
                None => {}
            }
            self.snapshot.lock().unwrap().exported(self.exporter);
        }
        Ok(())
    }
}

#[cfg(test)]
mod loss_report_tests {
    use super::*;

    #[test]
    fn a_loss_is_said_once_with_what_is_new_then_not_again_within_a_minute() {
        let mut r = LossReport::default();
        assert_eq!(r.check(&[("ring_buffer_full", 0), ("late", 0)], Some(5)), None);
        r.busy(Duration::from_millis(1500), 3 << 20);
        r.busy(Duration::from_millis(20), 1 << 20);
        let line = r.check(&[("ring_buffer_full", 7), ("late", 0)], Some(9)).unwrap();
        assert!(line.contains("near slot 9"), "{line}");
        assert!(line.contains("7 ring_buffer_full"), "{line}");
        assert!(!line.contains("late"), "{line}");
        assert!(line.contains("1500 ms") && line.contains("3.0 MiB"), "{line}");
        // More lost within the minute: not said yet.
        assert_eq!(r.check(&[("ring_buffer_full", 9), ("late", 1)], None), None);
        // A minute later, only what is new since the last line.
        r.last = Some(std::time::Instant::now() - Duration::from_secs(61));
        let line = r.check(&[("ring_buffer_full", 9), ("late", 1)], None).unwrap();
        assert!(line.contains("2 ring_buffer_full, 1 late"), "{line}");
        r.last = Some(std::time::Instant::now() - Duration::from_secs(61));
        assert_eq!(r.check(&[("ring_buffer_full", 9), ("late", 1)], None), None);
    }
}
