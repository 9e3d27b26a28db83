//! The live part of a session: attaching, the event loop, stopping.

use super::*;

/// A session while it runs: the probes, the event stream and everything
/// counted from it.
pub(super) struct Live {
    pub(super) sigterm: tokio::signal::unix::Signal,
    pub(super) sigint: tokio::signal::unix::Signal,
    /// What the slot source saw (and the slot uprobe's marks).
    pub(super) slot_log: SharedSlotLog,
    pub(super) source_task: Option<crate::background::Background>,
    pub(super) probes: Probes,
    pub(super) ring: crate::kernel::ring_reader::RingReader,
    pub(super) target: Target,
    pub(super) held: Option<HeldChild>,
    pub(super) kernel_thread: bool,
    /// Said when they happened, and kept for the summary.
    pub(super) attach_warnings: Vec<String>,
    pub(super) started: Instant,
    pub(super) started_mono: u64,
    pub(super) started_unix: Duration,
    pub(super) sym: Symbolizer,
    pub(super) execs: Vec<report::ExecSummary>,
    pub(super) fp_scan: Option<tokio::task::JoinHandle<Option<symbolizer::frame_pointers::FramePointerScan>>>,
    pub(super) phase_probe: Option<crate::phase::probe::RunningProbe>,
    /// The kernel's memory pressure, read for the slots.
    pub(super) psi: Option<crate::kernel::psi::PsiSampler>,
    pub(super) saved: Option<std::io::BufWriter<std::fs::File>>,
    pub(super) progress: bool,
    pub(super) agg: Aggregator,
    pub(super) exited_after: Option<Duration>,
    /// `record`: how the command ended (when it ended the session).
    pub(super) command_status: Option<std::process::ExitStatus>,
    pub(super) maps_errors: MapsErrors,
    pub(super) stacks: StackCache,
    /// Stack ids seen since the last stack epoch began, and in the one
    /// before: what a new epoch may empty from the kernel.
    pub(super) recent_ids: [Vec<i32>; 2],
    /// The threads the kernel never folds waits of.
    pub(super) exact: crate::drivers::exact_threads::ExactThreads,
}

impl Live {
    /// Loads and attaches the probes, says what did not attach, starts the
    /// event stream (and, for `record`, the held command).
    pub(super) async fn start(
        opts: &SessionOptions,
        mut target: Target,
        held: Option<HeldChild>,
    ) -> anyhow::Result<Live> {
        // First: a Ctrl-C or SIGTERM while the probes load (seconds in an
        // emulated VM, most of a second on a validator's 77 MB executable)
        // ends the session at its first turn, with its outputs; a listener
        // made later would not see it.
        let sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
        let sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
        let attaching = Instant::now();
        let mut exact = crate::drivers::exact_threads::ExactThreads::new(target.pid, &opts.spec.detectors);
        let crate::kernel::attach::Attached {
            probes,
            ring,
            slot_log,
            source_task,
            not_attached,
            program_cache,
            psi,
        } = crate::drivers::attach_spec(
            &target,
            &opts.spec,
            opts.spec.slot_source.as_ref(),
            crate::drivers::AttachAs {
                loop_symbol: "--loop-symbol",
                program_cache: "--program-cache",
                exe: opts.exe.as_deref(),
                probe_stats: opts.probe_stats,
                detector_probes: opts.detector_probes,
                exact_tids: exact.initial(),
            },
        )?;
        if let Some(line) = program_cache {
            eprintln!("slotprof: {line}");
        }
        // Said now, when it matters, and kept for the summary (not said twice).
        let mut attach_warnings = not_attached;
        attach_warnings.extend(crate::kernel::privileges::kernel_symbols_warning());
        let kernel_thread = target.is_kernel_thread();
        if kernel_thread {
            attach_warnings.push(format!(
                "pid {} ({}) is a kernel thread: it has no user space, so there are no user stacks and \
                 nothing for the slot, allocator or lock detectors; only its kernel stacks and off-CPU \
                 time are profiled (to profile the validator, give its pid: `pgrep -f agave-validator`)",
                target.pid, target.comm
            ));
        }
        for w in &attach_warnings {
            eprintln!("slotprof: warning: {w}");
        }
        // The session's time counts from here (a validator's symbols and
        // unwind tables take seconds to load).
        eprintln!(
            "slotprof: attached in {:.1} s; profiling",
            attaching.elapsed().as_secs_f64()
        );
        let started = Instant::now();
        let started_mono = monotonic_ns();
        let started_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();

        if let Some(h) = &held {
            if let Err(e) = crate::sys::write_byte(h.release.as_fd(), 1) {
                anyhow::bail!("could not start the command: {e}");
            }
            target = wait_for_exec(&target).await;
        }
        let sym = symbolizer_for(target.pid)?;
        // The prologue scan reads the whole executable (a validator's is 77
        // MB: most of a second): beside the loop, which must drain the ring
        // from the first moment (it filled while the scan ran first).
        let fp_scan = target
            .exe
            .clone()
            .map(|exe| tokio::task::spawn_blocking(move || symbolizer::frame_pointers::scan(&exe).ok()));

        let phase_probe = opts.spec.phase_probe.as_ref().map(crate::phase::probe::start);
        let saved = match &opts.save_events {
            Some(p) => Some(std::io::BufWriter::new(
                std::fs::File::create(p)
                    .with_context(|| format!("--save-events: cannot create {}", p.display()))?,
            )),
            None => None,
        };
        Ok(Live {
            sigterm,
            sigint,
            slot_log,
            source_task,
            probes,
            ring,
            target,
            held,
            kernel_thread,
            attach_warnings,
            started,
            started_mono,
            started_unix,
            sym,
            execs: Vec::new(),
            fp_scan,
            phase_probe,
            psi,
            saved,
            progress: std::io::stderr().is_terminal(),
            agg: if opts.save_replay.is_some() {
                Aggregator::recording()
            } else {
                Aggregator::new()
            },
            exited_after: None,
            command_status: None,
            maps_errors: MapsErrors::default(),
            stacks: StackCache::default(),
            recent_ids: Default::default(),
            exact,
        })
    }

    /// Feeds the event stream into the aggregator until the duration ends,
    /// a signal comes or the target exits; every 250 ms the maintenance of
    /// [`Self::tick`].
    pub(super) async fn pump(&mut self, opts: &SessionOptions) -> anyhow::Result<Stop> {
        let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let mut ticks = 0u64;
        loop {
            tokio::select! {
                batch = self.ring.recv() => match batch {
                    Some(batch) => stream::feed(
                        &batch,
                        &mut self.stacks.user,
                        &mut SessionSink {
                            agg: &mut self.agg,
                            slot_log: &self.slot_log,
                            saved: self.saved.as_mut(),
                            stack_ids: &mut self.recent_ids[0],
                        },
                    ),
                    None => anyhow::bail!("the ring buffer's reader thread ended"),
                },
                _ = sleep_until(deadline) => return Ok(Stop::Duration),
                _ = self.sigint.recv() => return Ok(Stop::Interrupted),
                _ = self.sigterm.recv() => return Ok(Stop::Interrupted),
                status = wait_child(&mut self.held) => {
                    self.command_status = status.ok();
                    self.exited_after = Some(self.started.elapsed());
                    return Ok(Stop::TargetExited);
                }
                _ = tick.tick() => {
                    ticks += 1;
                    if self.held.is_none() && !self.target.is_alive() {
                        self.exited_after = Some(self.started.elapsed());
                        return Ok(Stop::TargetExited);
                    }
                    self.tick(opts, ticks)?;
                }
            }
        }
    }

    /// Every 250 ms: an exec of the target noticed, new mappings read,
    /// the queue drained, user stacks due handed over, a stack epoch
    /// rotated, the progress line.
    pub(super) fn tick(&mut self, opts: &SessionOptions, ticks: u64) -> anyhow::Result<()> {
        let target = &mut self.target;
        if ticks.is_multiple_of(4) {
            if let Some((comm, exe)) = target.exec_since() {
                let seen = report::ExecSummary {
                    seen_after_s: self.started.elapsed().as_secs_f64(),
                    from_comm: target.comm.clone(),
                    from_exe: target.exe.clone(),
                    comm,
                    exe,
                };
                let w = format!(
                    "the target exec()ed {} ({}) {:.1} s into the session (it ran {} before): \
                     the profile holds both programs, and the summary names the new one",
                    seen.exe
                        .as_deref()
                        .map_or("?".into(), |e| e.display().to_string()),
                    seen.comm,
                    seen.seen_after_s,
                    seen.from_exe
                        .as_deref()
                        .map_or(seen.from_comm.clone(), |e| e.display().to_string()),
                );
                eprintln!("slotprof: warning: {w}");
                self.attach_warnings.push(w);
                if let Ok(now) = Target::from_pid(target.pid) {
                    *target = now;
                }
                self.execs.push(seen);
            }
        }
        if ticks <= 8 || ticks.is_multiple_of(4) {
            // New libraries may have been mapped since the last look
            // (often, right after start; then once a second).
            if let Err(e) = self.sym.track_process(target.pid) {
                self.maps_errors.note(target.pid, &e);
            }
        }
        let (agg, slot_log, recent_ids, stacks) = (
            &mut self.agg,
            &self.slot_log,
            &mut self.recent_ids,
            &mut self.stacks,
        );
        stream::drain(
            &mut self.ring,
            &mut stacks.user,
            &mut SessionSink {
                agg,
                slot_log,
                saved: self.saved.as_mut(),
                stack_ids: &mut recent_ids[0],
            },
        );
        {
            let mut sink = SessionSink {
                agg,
                slot_log,
                saved: None,
                stack_ids: &mut recent_ids[0],
            };
            stacks.user.expire(&mut |e| stream::Sink::event(&mut sink, e));
        }
        self.probes.set_stack_tops(&stacks.user.take_stack_tops());
        self.exact.refresh(&mut self.probes);
        let in_flight = self.probes.in_flight_offcpu();
        let still_needed = recent_ids
            .iter()
            .flatten()
            .copied()
            .chain(in_flight.iter().flat_map(|(_, s)| s.stack_ids()));
        stacks.rotate(&mut self.probes, still_needed)?;
        recent_ids.rotate_left(1);
        recent_ids[0].clear();
        if self.progress && ticks.is_multiple_of(4) {
            let lost = self.probes.counters().map(|c| c.lost()).unwrap_or(0) + self.ring.dropped();
            show_progress(self.started.elapsed(), opts.duration, &self.agg, lost);
        }
        Ok(())
    }

    /// Stops the phase probe, drains what is left, counts the threads
    /// still asleep, reads the counters and stack maps back, and detaches
    /// the probes: what the analysis and the outputs read.
    pub(super) fn collect(self, opts: &SessionOptions) -> anyhow::Result<Collected> {
        let Live {
            slot_log,
            mut source_task,
            probes,
            mut ring,
            target,
            kernel_thread,
            attach_warnings,
            started,
            started_mono,
            started_unix,
            mut sym,
            execs,
            fp_scan,
            phase_probe,
            psi,
            mut saved,
            progress,
            mut agg,
            exited_after,
            mut maps_errors,
            mut stacks,
            mut recent_ids,
            ..
        } = self;
        let elapsed = started.elapsed();
        let phase_windows = phase_probe.map(|p| p.stop()).unwrap_or_default();
        let phases: Vec<crate::phase::analysis::CpuPhases> = opts
            .spec
            .phase_probe
            .iter()
            .flat_map(|c| {
                c.cpus()
                    .into_iter()
                    .filter_map(|cpu| crate::phase::analysis::analyze_cpu(cpu, &phase_windows, c.every))
            })
            .collect();
        let kernel_ring = ring.finish();
        stream::drain(
            &mut ring,
            &mut stacks.user,
            &mut SessionSink {
                agg: &mut agg,
                slot_log: &slot_log,
                saved: saved.as_mut(),
                stack_ids: &mut recent_ids[0],
            },
        );
        {
            let mut sink = SessionSink {
                agg: &mut agg,
                slot_log: &slot_log,
                saved: None,
                stack_ids: &mut recent_ids[0],
            };
            stacks.user.flush(&mut |e| stream::Sink::event(&mut sink, e));
        }
        count_pending_folds(&probes, &mut stacks.user, &mut agg, target.pid);
        if let Some(mut w) = saved.take() {
            w.flush().context("--save-events")?;
        }
        if progress {
            eprint!("\r\x1b[K");
        }

        // Threads of a live target that are off-CPU right now: their
        // interval so far counts too, or a thread asleep for the whole
        // session would be missing.
        let target_alive = exited_after.is_none() && target.is_alive();
        if target_alive {
            let now = monotonic_ns();
            for (tid, start) in probes.in_flight_offcpu() {
                let alive = std::path::Path::new(&format!("/proc/{}/task/{tid}", target.pid)).exists();
                if start.tgid != target.pid
                    || !alive
                    || now.saturating_sub(start.start_ns) < opts.spec.min_offcpu.as_nanos() as u64
                {
                    continue;
                }
                let comm = std::fs::read_to_string(format!("/proc/{}/task/{tid}/comm", target.pid))
                    .unwrap_or_default();
                let mut start = start;
                // Still asleep: no system call exit will copy its stack; it
                // is read from /proc while the thread is blocked.
                (start.user_stack_id, start.kernel_stack_id) =
                    stacks.user.of_sleeper(target.pid, tid, &start);
                agg.still_off_cpu(tid, &start, now, comm.trim_end());
            }
            // Code mapped since the last tick (the last second) is known too.
            if let Err(e) = sym.track_process(target.pid) {
                maps_errors.note(target.pid, &e);
            }
        }
        let counters = probes.counters()?;
        let table = stacks.table(
            &probes,
            agg.stack_ids().context("reading back the off-CPU intervals")?,
        );
        let unwinding = report::Unwinding::new(&stacks.user, &counters);
        let unwind_warnings = stacks.user.unwinder.take_warnings();
        let probe_status = probes.status.clone();
        let short_futex = probes.short_futex_waits();
        let probe_cost = opts
            .probe_stats
            .then(|| report::ProbeCost::new(probes.costs(), elapsed));
        // Detach and unload now: nothing below needs the kernel side.
        let backlog_full = ring.dropped();
        drop(ring);
        drop(kernel_ring);
        drop(probes);
        if let Some(t) = &mut source_task {
            t.abort();
        }
        Ok(Collected {
            slot_log,
            target,
            kernel_thread,
            attach_warnings,
            started_mono,
            started_unix,
            elapsed,
            sym,
            execs,
            fp_scan,
            agg,
            exited_after,
            phase_windows,
            phases,
            psi,
            counters,
            table,
            unwinding,
            unwind_warnings,
            probe_status,
            short_futex,
            probe_cost,
            backlog_full,
        })
    }
}

/// Waits the kernel folded and had not sent yet when the session ended
/// (every thread's): counted as their records would have been.
fn count_pending_folds(
    probes: &Probes,
    user: &mut crate::kernel::user_stacks::UserStacks,
    agg: &mut Aggregator,
    pid: u32,
) {
    for (tid, tgid, f) in probes.pending_folds() {
        if tgid != pid {
            continue;
        }
        let mut rec = crate::pipeline::slot_window::fold_record(
            tid,
            tgid,
            &f,
            crate::kernel::target::comm_of(pid, tid),
        );
        rec.user_stack_id = user.fold_stack(tid, f.ip, f.sp, f.bp);
        agg.ingest(&events::Event::OffCpuFold(rec));
    }
}

pub(super) async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

pub(super) async fn wait_child(held: &mut Option<HeldChild>) -> std::io::Result<std::process::ExitStatus> {
    match held {
        Some(h) => h.child.wait().await,
        None => std::future::pending().await,
    }
}

pub(super) fn show_progress(elapsed: Duration, total: Option<Duration>, agg: &Aggregator, lost: u64) {
    let of = total
        .map(|t| format!("/{:.0}s", t.as_secs_f64()))
        .unwrap_or_default();
    eprint!(
        "\r\x1b[Kslotprof: {:.0}s{of}  samples {}  off-CPU {}  lost {}",
        elapsed.as_secs_f64(),
        agg.samples,
        agg.offcpu_intervals,
        lost
    );
    let _ = std::io::stderr().flush();
}
