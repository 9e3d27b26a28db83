//! One target followed while it lives: attached, its events taken slot by
//! slot, reloads applied in place.

use super::*;

/// Profiles one process until it exits, a signal, or the deadline.
pub(super) async fn follow(
    o: &RunOptions,
    config: &Config,
    target: Target,
    (exporter, pusher): (&mut always_on::Exporter, &mut Option<Pusher>),
    snapshot: &Arc<Mutex<Snapshot>>,
    signals: &mut Signals,
    lost_before: &mut HashMap<String, u64>,
) -> anyhow::Result<End> {
    let mut f = Follow::start(config, &target, snapshot, exporter.next_slot_number())?;
    if let Some(p) = pusher.as_mut() {
        p.follow(&target.name(), f.slot_log.clone());
    }
    // Attached until the probes are gone, however this function returns.
    let attached = AttachedMark(snapshot.clone());
    crate::sd_notify::notify(&format!(
        "READY=1\nSTATUS=profiling {} (pid {}); export in {}",
        target.comm,
        target.pid,
        config.export_dir.display()
    ));
    let topology = crate::topology::Topology::of(config.spec.detectors.topology.as_deref())?;
    let blocks = block_fetcher(config);
    let mut chunk = Chunk {
        config: config.clone(),
        target: &target,
        topology: &topology,
        exporter,
        pusher: pusher.as_mut(),
        snapshot,
        blocks: blocks.as_ref(),
    };
    let mut tick = tokio::time::interval(TICK);
    let end = loop {
        tokio::select! {
            batch = f.ring.recv() => match batch {
                Some(batch) => {
                    let began = std::time::Instant::now();
                    stream::feed(
                        &batch,
                        &mut f.stacks.user,
                        &mut RunSink { pending: &mut f.pending, slot_log: &f.slot_log },
                    );
                    f.losses.busy(began.elapsed(), f.ring.queued_bytes());
                }
                None => anyhow::bail!("the ring buffer's reader thread ended"),
            },
            e = signals.next() => match e {
                End::Hup => match reload(o, &chunk.config).await {
                    Ok(new) if needs_reattach(&chunk.config, &new.config) => break End::Reload(Box::new(new)),
                    Ok(new) if new.config.push != chunk.config.push => break End::Reload(Box::new(new)),
                    Ok(new) => {
                        let new = new.config;
                        chunk.exporter.reconfigure(&new.export_policy());
                        f.exact = crate::drivers::exact_threads::ExactThreads::new(target.pid, &new.spec.detectors);
                        chunk.config = new;
                        eprintln!("slotprof: configuration reloaded from {} (applied in place)", o.config.display());
                        crate::sd_notify::notify("READY=1");
                    }
                    Err(e) => refused(&e),
                },
                e => break e,
            },
            _ = tick.tick() => {
                signals.watchdog.ping();
                if !f.tick(&mut chunk, lost_before)? {
                    break End::TargetExited;
                }
            }
        }
    };
    f.finish(&mut chunk, lost_before)?;
    // Detached now, in /metrics too; the last blocks' outcomes are waited
    // for after that (their slots confirm seconds after they end).
    drop(attached);
    if let Some(b) = blocks {
        // A target that exited took its RPC with it, most likely: its last
        // slots are counted as not asked. Stopping waits for them.
        let within = match end {
            End::TargetExited => Duration::ZERO,
            _ => Duration::from_secs(6),
        };
        eprintln!("slotprof: {}", b.finish(within).await);
    }
    Ok(end)
}

/// The block-outcome fetcher, when the slot source has the node's RPC and
/// the configuration wants outcomes.
pub(super) fn block_fetcher(config: &Config) -> Option<crate::slot_sources::blocks::Fetcher> {
    let ep = config.spec.slot_source.as_ref()?.rpc()?;
    config
        .block_outcomes
        .then(|| crate::slot_sources::blocks::Fetcher::start(ep.clone(), config.export_dir.clone()))
}

/// One target followed by `slotprof run`: its probes and event stream,
/// the events waiting for their slot to end, and how far slots are done.
pub(super) struct Follow {
    pub(super) slot_source: SlotSourceSpec,
    pub(super) probes: Probes,
    pub(super) ring: crate::kernel::ring_reader::RingReader,
    pub(super) slot_log: SharedSlotLog,
    pub(super) source_task: Option<crate::background::Background>,
    /// When following began (CLOCK_MONOTONIC ns): a clock source's origin,
    /// and the number its first slot takes there (issue 42, case 11: the
    /// numbers already in the export are never taken again, across
    /// restarts of slotprof and of the target).
    pub(super) origin: (u64, u64),
    pub(super) sym: Symbolizer,
    pub(super) maps_errors: crate::kernel::target::MapsErrors,
    pub(super) phase: Option<Phase>,
    pub(super) psi: Option<crate::kernel::psi::PsiSampler>,
    pub(super) pending: Pending,
    pub(super) stacks: StackCache,
    /// Slots are processed up to here.
    pub(super) processed_until: u64,
    pub(super) ticks: u64,
    pub(super) losses: LossReport,
    /// The threads the kernel never folds waits of.
    pub(super) exact: crate::drivers::exact_threads::ExactThreads,
}

impl Follow {
    /// Attaches to `target`, starts its slot source and the phase probe.
    pub(super) fn start(
        config: &Config,
        target: &Target,
        snapshot: &Arc<Mutex<Snapshot>>,
        next_number: u64,
    ) -> anyhow::Result<Follow> {
        let slot_source = config.spec.slot_source.clone().unwrap_or(SlotSourceSpec::Clock {
            slot: Duration::from_millis(400),
            origin_ns: None,
            leader: None,
        });
        let mut exact = crate::drivers::exact_threads::ExactThreads::new(target.pid, &config.spec.detectors);
        let crate::kernel::attach::Attached {
            probes,
            ring,
            slot_log,
            source_task,
            not_attached,
            program_cache,
            psi,
        } = crate::drivers::attach_spec(
            target,
            &config.spec,
            Some(&slot_source),
            crate::drivers::AttachAs {
                loop_symbol: "detectors.loop_symbol",
                program_cache: "detectors.program_cache",
                exe: None,
                probe_stats: false,
                detector_probes: true,
                exact_tids: exact.initial(),
            },
        )?;
        if let Some(line) = program_cache {
            eprintln!("slotprof: {line}");
        }
        for w in &not_attached {
            eprintln!("slotprof: warning: {w}");
        }
        // Said at the first attach, not again at each target restart.
        static KALLSYMS_SAID: std::sync::Once = std::sync::Once::new();
        KALLSYMS_SAID.call_once(|| {
            if let Some(w) = crate::kernel::privileges::kernel_symbols_warning() {
                eprintln!("slotprof: warning: {w}");
            }
        });
        let origin = (monotonic_ns(), next_number);
        eprintln!(
            "slotprof: profiling {} (pid {}) at {} Hz; per-slot export in {}",
            target.comm,
            target.pid,
            config.spec.frequency_hz,
            config.export_dir.display()
        );
        let f = Follow {
            slot_source,
            probes,
            ring,
            slot_log,
            source_task,
            origin,
            sym: crate::kernel::target::symbolizer_for(target.pid)?,
            maps_errors: crate::kernel::target::MapsErrors::default(),
            phase: config.spec.phase_probe.as_ref().map(Phase::start),
            psi,
            pending: Pending::default(),
            stacks: StackCache::default(),
            processed_until: origin.0,
            ticks: 0,
            losses: LossReport::default(),
            exact,
        };
        let mut s = snapshot.lock().unwrap();
        s.slot_source = match &f.slot_source {
            SlotSourceSpec::Rpc(_) => "rpc",
            SlotSourceSpec::Uprobe { .. } => "uprobe",
            _ => "clock",
        };
        s.slot_source_healthy = f.source_healthy();
        s.target_attached = true;
        drop(s);
        Ok(f)
    }

    /// Whether the slot source is giving slots (a clock always is).
    pub(super) fn source_healthy(&self) -> bool {
        self.slot_source.rpc().is_none() || self.slot_log.lock().unwrap().healthy
    }

    /// Every tick: the queue drained, finished slots processed and
    /// exported, now and then the maps, the losses and the metrics'
    /// gauges. False once the target is gone.
    pub(super) fn tick(
        &mut self,
        chunk: &mut Chunk,
        lost_before: &mut HashMap<String, u64>,
    ) -> anyhow::Result<bool> {
        // Everything this tick does counts as busy (the maps re-read, the
        // drain and the slots' processing alike).
        let began = std::time::Instant::now();
        self.ticks += 1;
        let (ticks, pid, snapshot) = (self.ticks, chunk.target.pid, chunk.snapshot);
        // Twice a second: whether the target lives (a /proc read) and the
        // kernel's loss counters (a map read per CPU); at 20 ticks a second
        // these were ~5% of slotprof's own CPU.
        let now_and_then = ticks.is_multiple_of(10);
        let alive = !now_and_then || chunk.target.is_alive();
        if ticks.is_multiple_of(20) {
            if let Err(e) = self.sym.track_process(pid) {
                self.maps_errors.note(pid, &e);
            }
        }
        if ticks.is_multiple_of(200) {
            give_back_freed_memory();
        }
        if ticks.is_multiple_of(20) && self.sym.release_idle(SYMBOLS_IDLE) {
            snapshot.lock().unwrap().symbol_releases += 1;
        }
        // What the reader has read up to, taken before the queue is
        // drained: a slot ending after it may still have records in the
        // kernel's ring (the reader drains it every 25 ms).
        let synced = self.ring.synced_ns();
        let (pending, slot_log) = (&mut self.pending, &self.slot_log);
        stream::drain(
            &mut self.ring,
            &mut self.stacks.user,
            &mut RunSink { pending, slot_log },
        );
        self.stacks.user.expire(&mut |e| pending.push(slot_log, e));
        self.probes.set_stack_tops(&self.stacks.user.take_stack_tops());
        self.exact.refresh(&mut self.probes);
        // A slot is cut once every record that began in it is here: one
        // still waiting for its thread's stack copy (a system call that
        // slept more than once exits late; at most 2 s) holds its slot back
        // instead of arriving after it and being dropped as late.
        let now = monotonic_ns().min(synced);
        let mut ready = self
            .stacks
            .user
            .oldest_held_start_ns()
            .map_or(now, |t| now.min(t + GRACE_NS));
        if chunk.config.spec.offcpu == crate::spec::OffCpuMode::Folded {
            // Folded waits go out once the first is a span old, at the
            // thread's next switch: the slots wait for them (a thread
            // asleep since has its fold read from its entry).
            ready = ready.min(now.saturating_sub(profiler_ebpf::FOLD_SPAN_NS + FOLD_GRACE_NS));
        }
        let done = finished_slots(
            &self.slot_source,
            &self.slot_log,
            self.origin,
            self.processed_until,
            ready,
        );
        if !done.is_empty() {
            self.process(chunk, &done)?;
            self.slot_log
                .lock()
                .unwrap()
                .forget_before(self.processed_until.saturating_sub(20_000_000_000), 64);
        }
        chunk.exporter.refresh(false);
        self.losses.busy(began.elapsed(), self.ring.queued_bytes());
        if now_and_then {
            {
                let mut s = snapshot.lock().unwrap();
                s.slot_source_healthy = self.source_healthy();
                s.export_paused = chunk.exporter.paused();
            }
            let now = update_lost(
                snapshot,
                &self.probes,
                &self.pending,
                self.ring.dropped(),
                lost_before,
                false,
            );
            if let Some(line) = now.and_then(|now| self.losses.check(&now, done.first().map(|s| s.number))) {
                eprintln!("{line}");
            }
        }
        Ok(alive)
    }

    /// Aggregates `done` (finished, consecutive) with what only the kernel
    /// knows (threads asleep now, the stack maps, short futex waits), then
    /// hands it to the kernel-free [`Chunk::analyze_and_export`].
    pub(super) fn process(&mut self, chunk: &mut Chunk, done: &[Slot]) -> anyhow::Result<()> {
        // Events between `processed_until` and the first slot (before the
        // slot source gave one) fall outside every slot: aggregated, never
        // exported.
        let c = self.processed_until;
        let b = done.last().unwrap().end_ns;
        let pid = chunk.target.pid;
        let mut agg = Aggregator::new();
        let in_flight = self.probes.in_flight_offcpu();
        let user = &mut self.stacks.user;
        self.pending.take_sleeping_folds(
            &in_flight,
            pid,
            &mut |tid| crate::kernel::target::comm_of(pid, tid),
            &mut |tid, f| user.fold_stack(tid, f.ip, f.sp, f.bp),
        );
        self.pending.take_until(c, b, &mut agg);
        self.pending.count_open(
            &in_flight,
            pid,
            c,
            b,
            chunk.config.spec.min_offcpu.as_nanos() as u64,
            &mut agg,
            &mut |tid, start| user.of_sleeper(pid, tid, start),
        );
        let table = self.stacks.table(&self.probes, agg.stack_ids()?);
        // Stacks of events still pending and of threads asleep now are
        // copied before their map is emptied.
        let still_needed = self
            .pending
            .events
            .iter()
            .flat_map(Event::stack_ids)
            .chain(in_flight.iter().flat_map(|(_, s)| s.stack_ids()));
        let emptied = self.stacks.rotate(&mut self.probes, still_needed)?;
        {
            let mut snap = chunk.snapshot.lock().unwrap();
            snap.stacks_emptied += emptied as u64;
            let t = &self.stacks.user.unwinder.totals;
            snap.user_stacks = std::collections::BTreeMap::from([
                ("complete", t.complete),
                ("truncated", t.truncated),
                ("stack_copy_ended", t.stack_copy_end),
                ("no_unwind_info", t.no_unwind_info),
                ("unwind_error", t.errors),
            ]);
            snap.unwind_table_bytes = self.stacks.user.unwinder.table_bytes() as u64;
        }
        let short_futex = self.probes.short_futex_waits();
        let window = Window {
            slots: done,
            from: c,
            agg: &agg,
            table: &table,
            short_futex: &short_futex,
            psi: self.psi.as_ref(),
        };
        chunk.analyze_and_export(
            &window,
            &mut self.pending.cache_windows,
            &mut self.sym,
            self.phase.as_mut(),
        )?;
        // Pressure readings before the last slot done are not asked again.
        if let (Some(psi), Some(last)) = (&self.psi, done.last()) {
            psi.log.lock().unwrap().forget_before(last.end_ns);
        }
        self.processed_until = b;
        Ok(())
    }

    /// What ended before now is written; the slot in progress is not (it
    /// would be a partial slot). Then the probes are detached and the
    /// export flushed.
    pub(super) fn finish(
        mut self,
        chunk: &mut Chunk,
        lost_before: &mut HashMap<String, u64>,
    ) -> anyhow::Result<()> {
        let kernel_ring = self.ring.finish();
        let (pending, slot_log) = (&mut self.pending, &self.slot_log);
        stream::drain(
            &mut self.ring,
            &mut self.stacks.user,
            &mut RunSink { pending, slot_log },
        );
        self.stacks.user.flush(&mut |e| pending.push(slot_log, e));
        let now = monotonic_ns() + GRACE_NS;
        let done = finished_slots(
            &self.slot_source,
            &self.slot_log,
            self.origin,
            self.processed_until,
            now,
        );
        if !done.is_empty() {
            self.process(chunk, &done)?;
        }
        update_lost(
            chunk.snapshot,
            &self.probes,
            &self.pending,
            self.ring.dropped(),
            lost_before,
            true,
        );
        if let Some(mut t) = self.source_task.take() {
            t.abort();
        }
        if let Some(p) = self.phase.take() {
            p.probe.stop();
        }
        drop(self.ring);
        drop(kernel_ring);
        drop(self.probes);
        let meta = meta(chunk.target, &chunk.config);
        if let Some(p) = chunk.pusher.as_deref_mut() {
            p.finish(&meta)?;
        }
        chunk.exporter.finish(&meta)
    }
}

/// Marks the target attached in /metrics while alive; detached when
/// dropped (every way out of [`follow`]).
struct AttachedMark(Arc<Mutex<Snapshot>>);

impl Drop for AttachedMark {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.lock() {
            s.target_attached = false;
            s.slot_source_healthy = false;
        }
    }
}
