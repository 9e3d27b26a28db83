//! One profiling session: attach, collect until told to stop, write.

use std::{
    collections::HashMap,
    io::{IsTerminal, Write},
    os::fd::AsFd,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context;
use flamegraphs::pprof::{ProfileMeta, SampleType};
use symbolizer::Symbolizer;
use tokio::signal::unix::SignalKind;

use crate::{
    detectors,
    export::report::{self, EventCounts, FramePointers, Lost, Summary, TargetSummary},
    export::{push::Pusher, slot_export, SlotExport, SlotResult},
    kernel::events,
    kernel::probes::{ProbeConfig, Probes, StackCache},
    kernel::stream,
    kernel::target::{symbolizer_for, MapsErrors, Target},
    pipeline::aggregate::{Aggregator, Profiles, Row, RowKey, StackTable},
    slot_sources::SharedSlotLog,
    slot_sources::SlotSourceSpec,
    slots::{monotonic_ns, Timeline},
};

/// How a session runs.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// What to measure (shared with `run`).
    pub spec: crate::spec::ProfileSpec,
    /// Stop after this long; `None` runs until Ctrl-C or the target exits.
    pub duration: Option<Duration>,
    pub out: PathBuf,
    /// "attach" or "record", for the summary.
    pub command: &'static str,
    /// Measure the probes' own cost (see [`ProbeConfig::probe_stats`]).
    pub probe_stats: bool,
    /// The target's executable when known before it runs (`record`).
    pub exe: Option<PathBuf>,
    /// Attach the detectors' probes (see [`ProbeConfig::detector_probes`]).
    pub detector_probes: bool,
    /// Write every raw record here too (see [`crate::kernel::events::write_raw`]).
    pub save_events: Option<PathBuf>,
    /// Write a recording for `replay` here.
    pub save_replay: Option<PathBuf>,
    /// Push the slots' profiles to a profiling backend (needs a slot source).
    pub push: crate::spec::PushConfig,
}

pub use crate::kernel::target::HeldChild;

/// What a finished session produced.
pub struct Outcome {
    pub summary: Summary,
    pub summary_path: PathBuf,
    /// Warnings already printed while the session ran (not to repeat).
    pub printed: Vec<String>,
    /// `record`: how the command ended, when it ended the session.
    pub command_status: Option<std::process::ExitStatus>,
}

enum Stop {
    Duration,
    Interrupted,
    TargetExited,
}

/// Runs a session against `target` (and, for `record`, its held child).
pub async fn run(opts: &SessionOptions, target: Target, held: Option<HeldChild>) -> anyhow::Result<Outcome> {
    let (pid, comm) = (target.pid, target.comm.clone());
    let mut live = Live::start(opts, target, held)
        .await
        .map_err(|e| gone_while_attaching(e, pid, &comm))?;
    let stop = live.pump(opts).await?;
    let command_status = live.command_status;
    let collected = live.collect(opts)?;
    let mut outcome = report(opts, collected, stop).await?;
    outcome.command_status = command_status;
    Ok(outcome)
}

/// An attach that failed because the target exited meanwhile says so
/// first (issue 42, case 10: a target gone mid-attach was reported as a
/// missing CAP_SYS_PTRACE, the error of whichever /proc read came first).
fn gone_while_attaching(e: anyhow::Error, pid: u32, comm: &str) -> anyhow::Error {
    if crate::sys::is_running(pid) {
        return e;
    }
    // (The /proc read that failed is no news: the process is gone.)
    anyhow::anyhow!(
        "pid {pid} ({comm}) exited while slotprof was attaching, before anything was profiled: \
         attach again while it runs, or profile a command from its start with `slotprof record -- COMMAND`"
    )
}

/// A session while it runs: the probes, the event stream and everything
/// counted from it.
struct Live {
    sigterm: tokio::signal::unix::Signal,
    sigint: tokio::signal::unix::Signal,
    /// What the slot source saw (and the slot uprobe's marks).
    slot_log: SharedSlotLog,
    source_task: Option<crate::background::Background>,
    probes: Probes,
    ring: crate::kernel::ring_reader::RingReader,
    target: Target,
    held: Option<HeldChild>,
    kernel_thread: bool,
    /// Said when they happened, and kept for the summary.
    attach_warnings: Vec<String>,
    started: Instant,
    started_mono: u64,
    started_unix: Duration,
    sym: Symbolizer,
    execs: Vec<report::ExecSummary>,
    fp_scan: Option<tokio::task::JoinHandle<Option<symbolizer::frame_pointers::FramePointerScan>>>,
    phase_probe: Option<crate::phase::probe::RunningProbe>,
    /// The kernel's memory pressure, read for the slots.
    psi: Option<crate::kernel::psi::PsiSampler>,
    saved: Option<std::io::BufWriter<std::fs::File>>,
    progress: bool,
    agg: Aggregator,
    exited_after: Option<Duration>,
    /// `record`: how the command ended (when it ended the session).
    command_status: Option<std::process::ExitStatus>,
    maps_errors: MapsErrors,
    stacks: StackCache,
    /// Stack ids seen since the last stack epoch began, and in the one
    /// before: what a new epoch may empty from the kernel.
    recent_ids: [Vec<i32>; 2],
}

impl Live {
    /// Loads and attaches the probes, says what did not attach, starts the
    /// event stream (and, for `record`, the held command).
    async fn start(
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
        let crate::kernel::attach::Attached {
            probes,
            ring,
            slot_log,
            source_task,
            not_attached,
            program_cache,
            psi,
        } = crate::kernel::attach::attach(
            &target,
            crate::kernel::attach::Uprobes {
                slot_source: opts.spec.slot_source.as_ref(),
                loop_symbol: opts.spec.loop_symbol.as_deref().map(|f| ("--loop-symbol", f)),
                exe: opts.exe.as_deref(),
                program_cache: ("--program-cache", opts.spec.program_cache),
            },
            ProbeConfig {
                tgid: target.pid,
                min_offcpu: opts.spec.min_offcpu,
                stack_repeat: opts.spec.stack_repeat,
                freq_hz: opts.spec.frequency_hz,
                probe_stats: opts.probe_stats,
                slot_uprobe: None,
                loop_uprobe: None,
                cache_uprobes: Vec::new(),
                detector_probes: opts.detector_probes,
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
        })
    }

    /// Feeds the event stream into the aggregator until the duration ends,
    /// a signal comes or the target exits; every 250 ms the maintenance of
    /// [`Self::tick`].
    async fn pump(&mut self, opts: &SessionOptions) -> anyhow::Result<Stop> {
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
    fn tick(&mut self, opts: &SessionOptions, ticks: u64) -> anyhow::Result<()> {
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
    fn collect(self, opts: &SessionOptions) -> anyhow::Result<Collected> {
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

/// A session once its probes are detached: what it counted and read back.
struct Collected {
    slot_log: SharedSlotLog,
    target: Target,
    kernel_thread: bool,
    attach_warnings: Vec<String>,
    started_mono: u64,
    started_unix: Duration,
    elapsed: Duration,
    sym: Symbolizer,
    execs: Vec<report::ExecSummary>,
    fp_scan: Option<tokio::task::JoinHandle<Option<symbolizer::frame_pointers::FramePointerScan>>>,
    agg: Aggregator,
    exited_after: Option<Duration>,
    phase_windows: Vec<crate::phase::probe::Window>,
    phases: Vec<crate::phase::analysis::CpuPhases>,
    psi: Option<crate::kernel::psi::PsiSampler>,
    counters: crate::kernel::probes::Counters,
    table: StackTable,
    unwinding: report::Unwinding,
    unwind_warnings: Vec<String>,
    probe_status: Vec<crate::kernel::probes::ProbeStatus>,
    short_futex: Vec<(u64, u64, u64)>,
    probe_cost: Option<report::ProbeCost>,
    backlog_full: u64,
}

impl Collected {
    /// The slots of the session, from its slot source.
    fn timeline(&self, opts: &SessionOptions) -> Timeline {
        let ended_mono = self.started_mono + self.elapsed.as_nanos() as u64;
        match &opts.spec.slot_source {
            Some(SlotSourceSpec::Clock {
                slot,
                origin_ns,
                leader,
            }) => Timeline::clock(
                *slot,
                origin_ns.unwrap_or(self.started_mono),
                *leader,
                self.started_mono,
                ended_mono,
            ),
            Some(SlotSourceSpec::Rpc(_)) => self.slot_log.lock().unwrap().timeline(ended_mono),
            Some(SlotSourceSpec::Uprobe { numbers, .. }) => self
                .slot_log
                .lock()
                .unwrap()
                .uprobe_timeline(*numbers, ended_mono),
            None => Timeline::default(),
        }
    }
}

/// "slow" or "fast" at `ts` by the CPU that shows the slow phase most
/// (None without a slow phase of 5% or more).
fn phase_at(phases: &[crate::phase::analysis::CpuPhases], ts: u64) -> Option<&'static str> {
    let p = phases
        .iter()
        .max_by(|a, b| a.slowdown.total_cmp(&b.slowdown))
        .filter(|p| p.slowdown >= 0.05)?;
    crate::phase::analysis::slow_at(p, ts).map(|slow| if slow { "slow" } else { "fast" })
}

/// What the session's analysis made of what it collected.
struct Analysis {
    profiles: crate::pipeline::aggregate::Profiles,
    subtitle: String,
    meta: ProfileMeta,
    timeline: Timeline,
    findings: Vec<detectors::Finding>,
    cache_lines: Option<report::CacheLines>,
    frame_pointers: FramePointers,
}

/// Names the stacks, cuts the slots, runs the detectors, judges the frame
/// pointers.
async fn analyze(opts: &SessionOptions, c: &mut Collected) -> anyhow::Result<Analysis> {
    let profiles = c
        .agg
        .resolve(&c.table, &mut c.sym)
        .context("reading back the off-CPU intervals")?;
    let subtitle = format!(
        "{} (pid {}), {:.1} s at {} Hz, slotprof {}",
        c.target.comm,
        c.target.pid,
        c.elapsed.as_secs_f64(),
        opts.spec.frequency_hz,
        crate::VERSION
    );
    let meta = ProfileMeta {
        time_nanos: c.started_unix.as_nanos() as i64,
        duration_nanos: c.elapsed.as_nanos() as i64,
        period_type: Some(SampleType::new("cpu", "nanoseconds")),
        period: (1_000_000_000 / opts.spec.frequency_hz.max(1)) as i64,
        comments: vec![subtitle.clone()],
    };
    let timeline = c.timeline(opts);
    let buckets = crate::slots::Buckets::new(
        opts.spec.slot_source.is_some().then_some(&timeline),
        c.started_mono,
    );
    let topology = crate::topology::Topology::of(opts.spec.detectors.topology.as_deref())?;
    let mut named = crate::pipeline::replay::NameLog::default();
    let mut namer = crate::pipeline::aggregate::StackNamer::new(&c.table, &mut c.sym);
    let mut findings = crate::pipeline::detect_named(
        &c.agg,
        c.target.pid,
        &c.short_futex,
        &opts.spec.detectors,
        &buckets,
        &mut |tgid, id, kernel| {
            let frames = namer.part(tgid, id, kernel);
            named.note(tgid, id, kernel, &frames);
            frames
        },
    )
    .context("reading back the off-CPU intervals")?;
    drop(namer);
    let mut address_log = opts
        .save_replay
        .as_ref()
        .map(|_| crate::pipeline::AddressLog::default());
    let found = crate::pipeline::cache_lines(
        &c.agg.user_regs,
        c.target.pid,
        &c.agg.thread_names(),
        &topology,
        opts.spec.detectors.pingpong_threshold,
        &mut c.sym,
        address_log.as_mut(),
    );
    if let (Some(dir), Some(names)) = (&opts.save_replay, address_log) {
        let recording = crate::pipeline::replay::Recording {
            version: crate::pipeline::replay::VERSION,
            command: opts.command.to_string(),
            pid: c.target.pid,
            started_ns: c.started_mono,
            slots: opts.spec.slot_source.is_some().then(|| timeline.slots().to_vec()),
            detectors: opts.spec.detectors.clone(),
            short_futex: c.short_futex.clone(),
            names: named.into_names(),
            findings: serde_json::to_value(&findings)?,
            cache_lines: Some(crate::pipeline::replay::CacheLineRecording {
                topology: topology.clone(),
                sampled: c.agg.user_regs.iter().map(|r| (r.ts_ns, r.tid)).collect(),
                accesses: found.accesses.clone(),
                names,
                findings: serde_json::to_value(&found.findings)?,
            }),
        };
        let events = c.agg.take_recording();
        crate::pipeline::replay::write(dir, &recording, &events)?;
    }
    findings.extend(found.findings);
    let cache_lines = Some(report::CacheLines {
        path: crate::topology::cache_line_path(),
        topology: topology.source.clone(),
        samples_with_registers: c.agg.user_regs.len(),
        decoded_accesses: found.accesses.len(),
        decoding: found.decoding,
    });
    let exe_label = c
        .target
        .exe
        .as_ref()
        .and_then(|e| e.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let frame_pointers = FramePointers::judge(
        c.target.exe.clone(),
        match c.fp_scan.take() {
            Some(t) => t.await.ok().flatten(),
            None => None,
        },
        profiles.median_user_depth,
        c.unwinding.has_cfi(&exe_label),
    );
    Ok(Analysis {
        profiles,
        subtitle,
        meta,
        timeline,
        findings,
        cache_lines,
        frame_pointers,
    })
}

/// The session's warnings: those said while it ran (returned apart, not
/// to be said again) and those of its end.
fn warnings_of(
    opts: &SessionOptions,
    c: &mut Collected,
    a: &Analysis,
    lost: &Lost,
) -> (Vec<String>, Vec<String>) {
    let mut warnings = std::mem::take(&mut c.unwind_warnings);
    warnings.extend(c.agg.intervals().file_error().map(str::to_string));
    if let Some(advice) = &a.frame_pointers.advice {
        warnings.push(advice.clone());
    }
    if lost.total > 0 {
        warnings.push(format!(
            "{} events were lost (ring buffer full: {}, slotprof's queue full: {}, stacks: {}, off-CPU map full: {}, \
             syscall map full: {}, malformed: {}): lower --freq or raise --min-offcpu",
            lost.total,
            lost.ring_buffer_full,
            lost.backlog_full,
            lost.stacks,
            lost.offcpu_map_full,
            lost.syscall_map_full,
            lost.malformed_records
        ));
    }
    let mut printed = std::mem::take(&mut c.attach_warnings);
    printed.extend(c.slot_log.lock().unwrap().warnings.iter().cloned());
    warnings.extend(printed.iter().cloned());
    if opts.spec.slot_source.is_some() && a.timeline.slots().is_empty() {
        warnings.push("the slot source gave no slot during the session: no per-slot output".to_string());
    }
    if let Some(after) = c.exited_after {
        warnings.push(format!(
            "the target exited {:.1} s into the session; the profile covers the time it ran",
            after.as_secs_f64()
        ));
    }
    (printed, warnings)
}

/// Analyses what the session collected, then writes its outputs: the
/// summary first (small, so that a full disk still leaves it), then the
/// profiles, findings, per-slot files and trace, and the summary again
/// with what was written and what was not.
async fn report(opts: &SessionOptions, mut c: Collected, stop: Stop) -> anyhow::Result<Outcome> {
    let a = analyze(opts, &mut c).await?;
    let lost = Lost::new(&c.counters, c.agg.malformed(), c.backlog_full);
    let (printed, warnings) = warnings_of(opts, &mut c, &a, &lost);
    let mut a = a;
    let summary = summary_of(opts, &mut c, &mut a, lost, stop, warnings);
    // The push's senders run while the outputs are written (on this
    // runtime, between them) and are waited for after.
    // (`--push-*` without a slot source is refused at the command line.)
    let mut pusher = opts
        .push
        .is_on()
        .then(|| Pusher::start(&opts.push, &c.target.name(), Some(c.slot_log.clone())));
    let mut outcome = write_outputs(opts, &mut c, a, summary, printed, pusher.as_mut())?;
    if let Some(p) = pusher {
        let stats = p.stats();
        p.drain(opts.push.timeout).await;
        outcome.summary.push = stats.iter().map(|s| s.json()).collect();
        crate::output::write_atomic(
            &outcome.summary_path,
            &serde_json::to_vec_pretty(&outcome.summary)?,
        )?;
    }
    Ok(outcome)
}

/// The summary of a session (its outputs not written yet).
fn summary_of(
    opts: &SessionOptions,
    c: &mut Collected,
    a: &mut Analysis,
    lost: Lost,
    stop: Stop,
    warnings: Vec<String>,
) -> Summary {
    let thread_names = c.agg.thread_names();
    let target = &c.target;
    Summary {
        slotprof_version: crate::VERSION,
        kernel: report::kernel_release(),
        command: opts.command,
        target: TargetSummary {
            pid: target.pid,
            comm: target.comm.clone(),
            exe: target.exe.clone(),
            exited: c.exited_after.is_some(),
            exited_after_s: c.exited_after.map(|d| d.as_secs_f64()),
            kernel_thread: c.kernel_thread,
            execs: std::mem::take(&mut c.execs),
        },
        duration_s: c.elapsed.as_secs_f64(),
        ended_by: match stop {
            Stop::Duration => "duration",
            Stop::Interrupted => "interrupted",
            Stop::TargetExited => "target exited",
        },
        freq_hz: opts.spec.frequency_hz,
        min_offcpu_ms: opts.spec.min_offcpu.as_secs_f64() * 1e3,
        probes: std::mem::take(&mut c.probe_status),
        probe_cost: c.probe_cost.take(),
        counts: EventCounts {
            oncpu_samples: c.agg.samples,
            offcpu_intervals: c.agg.offcpu_intervals,
            offcpu_ns: c.agg.offcpu_ns,
            oncpu_stacks: a.profiles.oncpu.len(),
            offcpu_stacks: a.profiles.offcpu.len(),
            offcpu_interval_file_bytes: c.agg.intervals().file_bytes(),
            peak_rss_bytes: report::peak_rss_bytes(),
            kernel_samples: c.counters.samples,
        },
        lost,
        frame_pointers: std::mem::take(&mut a.frame_pointers),
        unwinding: std::mem::take(&mut c.unwinding),
        threads: c.agg.threads().into_iter().take(64).collect(),
        longest_offcpu: c.agg.longest_intervals(),
        findings: {
            let mut by_kind = std::collections::BTreeMap::new();
            for f in &a.findings {
                *by_kind.entry(f.kind.as_str()).or_insert(0u64) += 1;
            }
            by_kind
        },
        madvise_by_thread: report::madvise_by_thread(&c.agg.madvise_log, &thread_names),
        phase_probe: opts.spec.phase_probe.as_ref().map(|p| {
            let in_slow = |ts: u64| phase_at(&c.phases, ts) == Some("slow");
            report::PhaseProbe {
                every_ms: p.every.as_secs_f64() * 1e3,
                burst_ms: p.burst.as_secs_f64() * 1e3,
                windows: c.phase_windows.len(),
                cpus: c.phases.clone(),
                slow_slots: a
                    .timeline
                    .slots()
                    .iter()
                    .filter(|s| in_slow(s.start_ns + s.duration_ns() / 2))
                    .count(),
                slots: a.timeline.slots().len(),
                findings_in_slow_phase: a.findings.iter().filter(|f| in_slow(f.start_ns)).count(),
                findings: a.findings.len(),
            }
        }),
        cache_lines: a
            .cache_lines
            .take()
            .expect("the analysis's cache-line counts, taken once"),
        tlb: report::Tlb {
            flushes: c.counters.tlb_local,
            shootdown_ipis: c.counters.tlb_ipis,
        },
        complete: false,
        outputs: Vec::new(),
        missing: Vec::new(),
        warnings,
        push: Vec::new(),
    }
}

/// Writes the summary, then every output, then the summary again saying
/// what is there.
fn write_outputs(
    opts: &SessionOptions,
    c: &mut Collected,
    a: Analysis,
    mut summary: Summary,
    printed: Vec<String>,
    mut pusher: Option<&mut Pusher>,
) -> anyhow::Result<Outcome> {
    let summary_path = opts.out.join("summary.json");
    // The summary first (small): a disk that fills while the profiles are
    // written leaves it saying what is there and what is not.
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create output directory {}", opts.out.display()))?;
    // Padded with 8 KiB of trailing whitespace (still JSON): the room the
    // final summary's output and missing lists take, so that it can be
    // written over this one in place when the disk is full by then.
    let mut first_summary = serde_json::to_vec_pretty(&summary)?;
    first_summary.extend(std::iter::repeat_n(b' ', 8 << 10));
    first_summary.push(b'\n');
    crate::output::write_atomic(&summary_path, &first_summary).with_context(|| {
        format!(
            "nothing was written to {}: free some space there (or choose another --out) and run again",
            opts.out.display()
        )
    })?;
    let mut written: Vec<PathBuf> = Vec::new();
    let mut missing: Vec<report::MissingOutput> = Vec::new();
    let mut attempt = |path: PathBuf, result: anyhow::Result<()>| match result {
        Ok(()) => written.push(path),
        Err(e) => missing.push(report::MissingOutput {
            path: path.display().to_string(),
            error: format!("{e:#}"),
        }),
    };
    // With slots, the session's pprof labels each sample with its slot:
    // written after the slots are (below).
    let slotted = opts.spec.slot_source.is_some();
    for (path, result) in report::write_profiles_each(
        &opts.out,
        &a.profiles,
        if slotted {
            report::Parts::None
        } else {
            report::Parts::Whole
        },
        &a.meta,
        &a.subtitle,
        crate::output::write_atomic,
    ) {
        attempt(path, result);
    }
    let findings_path = opts.out.join("findings.json");
    attempt(
        findings_path.clone(),
        serde_json::to_vec_pretty(&a.findings)
            .map_err(anyhow::Error::from)
            .and_then(|json| crate::output::write_atomic(&findings_path, &json)),
    );
    if opts.spec.slot_source.is_some() {
        let period_ns = 1_000_000_000 / opts.spec.frequency_hz.max(1);
        let slot_phase = |s: &crate::slots::Slot| phase_at(&c.phases, s.start_ns + s.duration_ns() / 2);
        let mut writer = slot_export::SlotWriter::new(&opts.out, &a.findings);
        let mut session_pprof = SlotLabelled::new(&a.profiles, a.meta.period.max(0));
        let slots = c
            .agg
            .resolve_slots_each(&a.timeline, &c.table, &mut c.sym, |i, p| {
                let slot = &a.timeline.slots()[i];
                session_pprof.slot(&p, &report::SlotLabels::of(slot, slot_phase(slot)));
                let result = SlotResult {
                    slot,
                    profiles: &p,
                    findings: &a.findings,
                    phase: slot_phase(slot),
                    memory_pressure: c
                        .psi
                        .as_ref()
                        .and_then(|psi| psi.over(slot.start_ns, slot.end_ns)),
                    meta: &a.meta,
                    period_ns,
                };
                if let Some(p) = pusher.as_deref_mut() {
                    p.slot(&result)?;
                }
                writer.slot(&result)
            })
            .and_then(|()| writer.finish(&a.meta));
        if let Some(p) = pusher {
            p.finish(&a.meta)?;
        }
        let has_windows = a.timeline.slots().iter().any(|s| s.window.is_some());
        // The session's pprof: its slots' samples labelled, the rest not;
        // if the slots stopped short, the whole session unlabelled.
        let b = match &slots {
            Ok(_) => session_pprof.finish(),
            Err(_) => report::pprof_profile(&a.profiles, report::Parts::Whole, &a.meta),
        };
        let pprof_path = opts.out.join("profile.pb.gz");
        attempt(
            pprof_path.clone(),
            crate::output::write_atomic_with(&pprof_path, |w| b.write_gzip(&a.meta, w)),
        );
        match slots {
            Ok(_) => {
                attempt(opts.out.join("slots/"), Ok(()));
                if has_windows {
                    attempt(opts.out.join("windows/"), Ok(()));
                }
                attempt(opts.out.join("index.html"), Ok(()));
            }
            Err(e) => attempt(
                opts.out.join("slots/"),
                Err(e.context("the per-slot outputs stopped at this write; the slots before it are there")),
            ),
        }
    }
    let trace_path = opts.out.join("trace.json");
    attempt(
        trace_path.clone(),
        crate::output::write_atomic_with(&trace_path, |w| {
            slot_export::write_trace(w, c.target.pid, &c.target.comm, &a.timeline, &c.agg, &|ts| {
                phase_at(&c.phases, ts)
            })
        }),
    );
    written.push(summary_path.clone());
    summary.complete = missing.is_empty();
    summary.outputs = written.iter().map(|p| p.display().to_string()).collect();
    summary.missing = missing;
    let json = serde_json::to_vec_pretty(&summary)?;
    if let Err(e) = crate::output::write_atomic(&summary_path, &json) {
        // No room for a second copy beside the first: rewrite it in place
        // (its own blocks are freed first); if that fails too, put the
        // first one back (it fitted before), marked incomplete.
        if std::fs::write(&summary_path, &json).is_err() {
            let _ = std::fs::write(&summary_path, &first_summary);
            summary.missing.push(report::MissingOutput {
                path: summary_path.display().to_string(),
                error: format!("{e:#} (the one there says \"complete\": false)"),
            });
        }
    }
    Ok(Outcome {
        summary,
        summary_path,
        printed,
        command_status: None,
    })
}

/// A session's pprof profile with each sample labelled with its slot: the
/// slots' rows as they are resolved, then what is left of the whole
/// session's (events outside every slot), unlabelled. Samples are spooled
/// as they come (see [`flamegraphs::pprof::Builder`]).
struct SlotLabelled<'a> {
    b: flamegraphs::pprof::Builder,
    whole: &'a Profiles,
    /// What the slots have not taken yet, by (stack, thread, CPU):
    /// (samples, off-CPU ns).
    left: HashMap<RowKey, (u64, u64)>,
    period_ns: i64,
}

impl<'a> SlotLabelled<'a> {
    fn new(whole: &'a Profiles, period_ns: i64) -> Self {
        let mut left: HashMap<_, (u64, u64)> = HashMap::with_capacity(whole.rows.len());
        for r in &whole.rows {
            let v = left.entry(r.key()).or_default();
            v.0 += r.samples;
            v.1 += r.offcpu_ns;
        }
        Self {
            b: flamegraphs::pprof::Builder::new(&report::pprof_types()),
            whole,
            left,
            period_ns,
        }
    }

    fn slot(&mut self, p: &Profiles, labels: &report::SlotLabels) {
        for r in &p.rows {
            if let Some(v) = self.left.get_mut(&r.key()) {
                v.0 = v.0.saturating_sub(r.samples);
                v.1 = v.1.saturating_sub(r.offcpu_ns);
            }
        }
        report::add_rows(&mut self.b, &p.rows, self.period_ns, &labels.labels());
    }

    fn finish(mut self) -> flamegraphs::pprof::Builder {
        let rest: Vec<Row> = self
            .whole
            .rows
            .iter()
            .filter_map(|r| {
                // Each key once (rows of one key, e.g. two stacks that
                // name alike, were summed into it).
                let (samples, offcpu_ns) = self.left.remove(&r.key())?;
                (samples > 0 || offcpu_ns > 0).then(|| Row {
                    samples,
                    offcpu_ns,
                    ..r.clone()
                })
            })
            .collect();
        report::add_rows(&mut self.b, &rest, self.period_ns, &[]);
        self.b
    }
}

/// After releasing a held child: its view once it has exec'd the command
/// and the kernel has mapped the command's code (its executable is no
/// longer slotprof's, and `/proc/PID/maps` shows the new one executable),
/// or as it is after 60 s. An exec takes a millisecond natively but can
/// take seconds in an emulated VM under the probes; past the old 2 s limit
/// the session took the trampoline's executable for the target's. The
/// executable changes at the start of the exec, before its code is
/// mapped: a map read in between holds only the stack, and a VM run whose
/// first read fell there once decoded none of its samples. The auxiliary
/// vector is written after the code is mapped: waited for too, or the
/// first look at it would show an exec that did not happen.
async fn wait_for_exec(held: &Target) -> Target {
    for _ in 0..12_000 {
        match Target::from_pid(held.pid) {
            Ok(now) if now.exe != held.exe && code_is_mapped(&now) && now.auxv_written() => return now,
            Ok(_) => {}
            // Gone (the exec failed and the trampoline exited): the
            // session sees it exit.
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Target::from_pid(held.pid).unwrap_or_else(|_| held.clone())
}

/// Whether `target`'s executable has an executable mapping yet.
fn code_is_mapped(target: &Target) -> bool {
    let Some(exe) = &target.exe else { return false };
    symbolizer::maps::ProcessMaps::read(target.pid).is_ok_and(|m| {
        m.mappings()
            .iter()
            .any(|m| m.executable && m.path.as_deref() == Some(exe.as_path()))
    })
}

/// A session's side of the event stream: the aggregator, the slot log
/// (slot marks), the raw recording (`--save-events`) and the stack ids
/// seen since the last sweep.
struct SessionSink<'a> {
    agg: &'a mut Aggregator,
    slot_log: &'a SharedSlotLog,
    saved: Option<&'a mut std::io::BufWriter<std::fs::File>>,
    stack_ids: &'a mut Vec<i32>,
}

impl stream::Sink for SessionSink<'_> {
    fn event(&mut self, event: events::Event) {
        match event {
            events::Event::SlotMark(m) => self.slot_log.lock().unwrap().marks.push((m.ts_ns, m.arg0)),
            event => {
                self.stack_ids
                    .extend(event.stack_ids().into_iter().filter(|&id| id >= 0));
                self.agg.ingest(&event);
            }
        }
    }

    fn malformed(&mut self) {
        self.agg.note_malformed();
    }

    fn raw(&mut self, record: &[u8]) {
        if let Some(w) = self.saved.as_deref_mut() {
            if events::write_raw(w, record).is_err() {
                self.agg.note_malformed();
            }
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn wait_child(held: &mut Option<HeldChild>) -> std::io::Result<std::process::ExitStatus> {
    match held {
        Some(h) => h.child.wait().await,
        None => std::future::pending().await,
    }
}

fn show_progress(elapsed: Duration, total: Option<Duration>, agg: &Aggregator, lost: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(stack: &str, tid: u32, cpu: Option<u16>, samples: u64, offcpu_ns: u64) -> Row {
        Row {
            stack: stack.into(),
            tid: Some(tid),
            cpu,
            samples,
            offcpu_ns,
            locs: None,
        }
    }

    fn profiles(rows: Vec<Row>) -> Profiles {
        Profiles {
            rows,
            ..Default::default()
        }
    }

    #[test]
    fn a_sessions_pprof_labels_its_slots_samples_and_keeps_the_rest_unlabelled() {
        let whole = profiles(vec![
            row("t;main;hot", 7, Some(1), 10, 0),
            row("t;main;wait", 7, None, 0, 100),
            row("u;run", 8, Some(0), 2, 0),
        ]);
        let period = 10_000_000;
        let mut s = SlotLabelled::new(&whole, period);
        let slot = |n| report::SlotLabels {
            slot: n,
            leader: n == 0,
            phase: None,
        };
        s.slot(
            &profiles(vec![
                row("t;main;hot", 7, Some(1), 4, 0),
                row("t;main;wait", 7, None, 0, 60),
            ]),
            &slot(0),
        );
        s.slot(&profiles(vec![row("t;main;hot", 7, Some(1), 3, 0)]), &slot(1));
        let p = s.finish().finish(&ProfileMeta::default()).unwrap();
        let label = |smp: &flamegraphs::pprof::Sample, key: &str| {
            smp.label
                .iter()
                .find(|l| p.string_table[l.key as usize] == key)
                .map(|l| l.num)
        };
        // Per slot label (None: outside every slot): (samples, cpu ns, off-CPU ns).
        let mut by: std::collections::BTreeMap<Option<i64>, (i64, i64, i64)> = Default::default();
        for smp in &p.sample {
            let e = by.entry(label(smp, "slot")).or_default();
            e.0 += smp.value[0];
            e.1 += smp.value[1];
            e.2 += smp.value[2];
            assert!(label(smp, "thread_id").is_some());
        }
        assert_eq!(by[&Some(0)], (4, 4 * period, 60));
        assert_eq!(by[&Some(1)], (3, 3 * period, 0));
        // What the slots did not take: 3 + 2 samples, 40 ns.
        assert_eq!(by[&None], (5, 5 * period, 40));
        let total = by.values().fold((0, 0), |a, v| (a.0 + v.0, a.1 + v.2));
        assert_eq!(total, (12, 100), "the whole session's");
    }
}
