//! One profiling session: attach, collect until told to stop, write.

use std::{
    io::{IsTerminal, Write},
    os::fd::{AsRawFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context;
use flamegraphs::pprof::{ProfileMeta, SampleType};
use symbolizer::Symbolizer;
use tokio::signal::unix::SignalKind;

use crate::{
    aggregate::{Aggregator, StackTable},
    detectors::{self, DetectorConfig},
    events,
    probes::{ProbeConfig, Probes, StackCache},
    report::{self, Counts, FramePointers, Lost, Summary, TargetSummary},
    slot_export,
    slot_sources::SlotSourceSpec,
    slot_sources::{rpc, SharedSlotLog},
    slots::{monotonic_ns, Timeline},
    target::Target,
};

/// How a session runs.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Stop after this long; `None` runs until Ctrl-C or the target exits.
    pub duration: Option<Duration>,
    pub freq_hz: u64,
    pub min_offcpu: Duration,
    /// See [`ProbeConfig::stack_repeat`].
    pub stack_repeat: Duration,
    pub out: PathBuf,
    /// "attach" or "record", for the summary.
    pub command: &'static str,
    /// Measure the probes' own cost (see [`ProbeConfig::probe_stats`]).
    pub probe_stats: bool,
    /// Where slot boundaries come from; `None`: one profile for the session.
    pub slot_source: Option<SlotSourceSpec>,
    pub detectors: DetectorConfig,
    /// `--loop-symbol`: a function of the target's executable.
    pub loop_symbol: Option<String>,
    /// The target's executable when known before it runs (`record`).
    pub exe: Option<PathBuf>,
    /// Attach the detectors' probes (see [`ProbeConfig::detector_probes`]).
    pub detector_probes: bool,
    /// The guest-side phase probe, when on.
    pub phase_probe: Option<crate::phase::probe::ProbeConfig>,
    /// Write every raw record here too (see [`crate::events::write_raw`]).
    pub save_events: Option<PathBuf>,
}

/// A process started by `record`, held before `exec` until the probes are in.
pub struct HeldChild {
    pub child: tokio::process::Child,
    /// Writing a byte here lets the child exec.
    pub release: OwnedFd,
}

/// What a finished session produced.
pub struct Outcome {
    pub summary: Summary,
    pub summary_path: PathBuf,
    /// Warnings already printed while the session ran (not to repeat).
    pub printed: Vec<String>,
}

enum Stop {
    Duration,
    Interrupted,
    TargetExited,
}

/// Runs a session against `target` (and, for `record`, its held child).
pub async fn run(
    opts: &SessionOptions,
    mut target: Target,
    mut held: Option<HeldChild>,
) -> anyhow::Result<Outcome> {
    // First: a Ctrl-C or SIGTERM while the probes load (seconds in an
    // emulated VM, most of a second on a validator's 77 MB executable) ends
    // the session at its first turn, with its outputs; a listener made
    // later would not see it.
    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
    let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
    // The slot source runs beside the session and logs what it sees.
    let slot_log = SharedSlotLog::default();
    let mut source_task = match &opts.slot_source {
        Some(SlotSourceSpec::Rpc(ep)) | Some(SlotSourceSpec::Uprobe { rpc: Some(ep), .. }) => {
            Some(rpc::follow_in_background(ep.clone(), slot_log.clone())?)
        }
        _ => None,
    };
    let loop_uprobe = match &opts.loop_symbol {
        Some(function) => {
            let exe = opts.exe.clone().or_else(|| target.exe.clone()).with_context(|| {
                format!("--loop-symbol: cannot find the executable of pid {}", target.pid)
            })?;
            Some(uprobe_target(&exe, function)?)
        }
        None => None,
    };
    let slot_uprobe = match &opts.slot_source {
        Some(SlotSourceSpec::Uprobe { binary, function, .. }) => Some(uprobe_target(binary, function)?),
        _ => None,
    };

    let mut probes = Probes::load(&ProbeConfig {
        tgid: target.pid,
        min_offcpu: opts.min_offcpu,
        stack_repeat: opts.stack_repeat,
        freq_hz: opts.freq_hz,
        probe_stats: opts.probe_stats,
        slot_uprobe,
        loop_uprobe,
        detector_probes: opts.detector_probes,
    })?;
    // Said now, when it matters, and kept for the summary (not said twice).
    let mut attach_warnings: Vec<String> = probes
        .status
        .iter()
        .filter(|p| !p.attached)
        .map(|p| {
            format!(
                "{} on {} did not attach ({}); profiling without it",
                p.program,
                p.event,
                p.error.as_deref().unwrap_or("unknown error")
            )
        })
        .collect();
    attach_warnings.extend(crate::privileges::kernel_symbols_warning());
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
    let mut ring = crate::ring_reader::RingReader::start(probes.take_events()?)?;
    let started = Instant::now();
    let started_mono = monotonic_ns();
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();

    if let Some(h) = &held {
        let byte = [1u8];
        let n = unsafe { libc::write(h.release.as_raw_fd(), byte.as_ptr().cast(), 1) };
        if n != 1 {
            anyhow::bail!("could not start the command: {}", std::io::Error::last_os_error());
        }
        target = wait_for_exec(&target).await;
    }
    let mut sym = symbolizer_for(target.pid)?;
    let mut execs: Vec<report::ExecSummary> = Vec::new();
    // The prologue scan reads the whole executable (a validator's is 77 MB:
    // most of a second): beside the loop, which must drain the ring from
    // the first moment (it filled while the scan ran first).
    let fp_scan = target
        .exe
        .clone()
        .map(|exe| tokio::task::spawn_blocking(move || symbolizer::frame_pointers::scan(&exe).ok()));

    let phase_probe = opts.phase_probe.as_ref().map(crate::phase::probe::start);
    let mut saved = match &opts.save_events {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p)
                .with_context(|| format!("--save-events: cannot create {}", p.display()))?,
        )),
        None => None,
    };
    let progress = std::io::stderr().is_terminal();
    let mut agg = Aggregator::new();
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut ticks = 0u64;
    let mut exited_after = None;
    let mut maps_errors = MapsErrors::default();

    // Stack ids seen since the last stack epoch began, and in the one
    // before: what a new epoch may empty from the kernel.
    let mut stacks = StackCache::default();
    let mut recent_ids: [Vec<i32>; 2] = Default::default();
    let stop = loop {
        tokio::select! {
            batch = ring.recv() => match batch {
                Some(batch) => feed(&batch, &mut agg, &slot_log, saved.as_mut(), &mut recent_ids[0], &mut stacks.user),
                None => anyhow::bail!("the ring buffer's reader thread ended"),
            },
            _ = sleep_until(deadline) => break Stop::Duration,
            _ = sigint.recv() => break Stop::Interrupted,
            _ = sigterm.recv() => break Stop::Interrupted,
            status = wait_child(&mut held) => {
                let _ = status;
                exited_after = Some(started.elapsed());
                break Stop::TargetExited;
            }
            _ = tick.tick() => {
                ticks += 1;
                if held.is_none() && !target.is_alive() {
                    exited_after = Some(started.elapsed());
                    break Stop::TargetExited;
                }
                if ticks.is_multiple_of(4) {
                    if let Some((comm, exe)) = target.exec_since() {
                        let seen = report::ExecSummary {
                            seen_after_s: started.elapsed().as_secs_f64(),
                            from_comm: target.comm.clone(),
                            from_exe: target.exe.clone(),
                            comm,
                            exe,
                        };
                        let w = format!(
                            "the target exec()ed {} ({}) {:.1} s into the session (it ran {} before): \
                             the profile holds both programs, and the summary names the new one",
                            seen.exe.as_deref().map_or("?".into(), |e| e.display().to_string()),
                            seen.comm,
                            seen.seen_after_s,
                            seen.from_exe.as_deref().map_or(seen.from_comm.clone(), |e| e.display().to_string()),
                        );
                        eprintln!("slotprof: warning: {w}");
                        attach_warnings.push(w);
                        if let Ok(now) = Target::from_pid(target.pid) {
                            target = now;
                        }
                        execs.push(seen);
                    }
                }
                if ticks <= 8 || ticks.is_multiple_of(4) {
                    // New libraries may have been mapped since the last look
                    // (often, right after start; then once a second).
                    if let Err(e) = sym.track_process(target.pid) {
                        maps_errors.note(target.pid, &e);
                    }
                }
                {
                    drain(&mut ring, &mut agg, &slot_log, saved.as_mut(), &mut recent_ids[0], &mut stacks.user);
                    stacks.user.expire(&mut |e| ingest(&mut agg, &slot_log, &mut recent_ids[0], e));
                    probes.set_stack_tops(&stacks.user.take_stack_tops());
                    let in_flight = probes.in_flight_offcpu();
                    let still_needed = recent_ids.iter().flatten().copied().chain(in_flight.iter().flat_map(
                        |(_, s)| s.stack_ids(),
                    ));
                    stacks.rotate(&mut probes, still_needed)?;
                    recent_ids.rotate_left(1);
                    recent_ids[0].clear();
                }
                if progress && ticks.is_multiple_of(4) {
                    let lost = probes.counters().map(|c| c.lost()).unwrap_or(0) + ring.dropped();
                    show_progress(started.elapsed(), opts.duration, &agg, lost);
                }
            }
        }
    };
    let elapsed = started.elapsed();
    let phase_windows = phase_probe.map(|p| p.stop()).unwrap_or_default();
    let phases: Vec<crate::phase::analysis::CpuPhases> = opts
        .phase_probe
        .iter()
        .flat_map(|c| {
            c.cpus
                .iter()
                .filter_map(|&cpu| crate::phase::analysis::analyze_cpu(cpu, &phase_windows, c.every))
        })
        .collect();
    // The CPU that shows the slow phase most.
    let strongest = phases
        .iter()
        .max_by(|a, b| a.slowdown.total_cmp(&b.slowdown))
        .cloned();
    let phase_of = |ts: u64| -> Option<&'static str> {
        let p = strongest.as_ref().filter(|p| p.slowdown >= 0.05)?;
        crate::phase::analysis::slow_at(p, ts).map(|slow| if slow { "slow" } else { "fast" })
    };
    let kernel_ring = ring.finish();
    drain(
        &mut ring,
        &mut agg,
        &slot_log,
        saved.as_mut(),
        &mut recent_ids[0],
        &mut stacks.user,
    );
    stacks
        .user
        .flush(&mut |e| ingest(&mut agg, &slot_log, &mut recent_ids[0], e));
    if let Some(mut w) = saved.take() {
        w.flush().context("--save-events")?;
    }
    if progress {
        eprint!("\r\x1b[K");
    }

    // Threads of a live target that are off-CPU right now: their interval so
    // far counts too, or a thread asleep for the whole session would be missing.
    let target_alive = exited_after.is_none() && target.is_alive();
    if target_alive {
        let now = monotonic_ns();
        for (tid, start) in probes.in_flight_offcpu() {
            let alive = std::path::Path::new(&format!("/proc/{}/task/{tid}", target.pid)).exists();
            if start.tgid != target.pid
                || !alive
                || now.saturating_sub(start.start_ns) < opts.min_offcpu.as_nanos() as u64
            {
                continue;
            }
            let comm =
                std::fs::read_to_string(format!("/proc/{}/task/{tid}/comm", target.pid)).unwrap_or_default();
            let mut start = start;
            // Still asleep: no system call exit will copy its stack; it is
            // read from /proc while the thread is blocked.
            (start.user_stack_id, start.kernel_stack_id) = stacks.user.of_sleeper(target.pid, tid, &start);
            agg.still_off_cpu(tid, &start, now, comm.trim_end());
        }
    }

    if target_alive {
        // Code mapped since the last tick (the last second) is known too.
        if let Err(e) = sym.track_process(target.pid) {
            maps_errors.note(target.pid, &e);
        }
    }
    let counters = probes.counters()?;
    let unwinding;
    let unwind_warnings;
    let stacks: StackTable = {
        let table = stacks.table(
            &probes,
            agg.stack_ids().context("reading back the off-CPU intervals")?,
        );
        unwinding = report::Unwinding::new(&stacks.user, &counters);
        unwind_warnings = stacks.user.unwinder.take_warnings();
        table
    };
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

    let profiles = agg
        .resolve(&stacks, &mut sym)
        .context("reading back the off-CPU intervals")?;
    let longest_offcpu = agg.longest_intervals();
    let subtitle = format!(
        "{} (pid {}), {:.1} s at {} Hz, slotprof {}",
        target.comm,
        target.pid,
        elapsed.as_secs_f64(),
        opts.freq_hz,
        crate::VERSION
    );
    let meta = ProfileMeta {
        time_nanos: started_unix.as_nanos() as i64,
        duration_nanos: elapsed.as_nanos() as i64,
        period_type: Some(SampleType::new("cpu", "nanoseconds")),
        period: (1_000_000_000 / opts.freq_hz.max(1)) as i64,
        comments: vec![subtitle.clone()],
    };
    let ended_mono = started_mono + elapsed.as_nanos() as u64;
    if let Some(t) = &mut source_task {
        t.abort();
    }
    let timeline = match &opts.slot_source {
        Some(SlotSourceSpec::Clock {
            slot,
            origin_ns,
            leader,
        }) => Timeline::clock(
            *slot,
            origin_ns.unwrap_or(started_mono),
            *leader,
            started_mono,
            ended_mono,
        ),
        Some(SlotSourceSpec::Rpc(_)) => slot_log.lock().unwrap().timeline(ended_mono),
        Some(SlotSourceSpec::Uprobe { numbers, .. }) => {
            slot_log.lock().unwrap().uprobe_timeline(*numbers, ended_mono)
        }
        None => Timeline::default(),
    };
    let buckets = detectors::Buckets::new(opts.slot_source.is_some().then_some(&timeline), started_mono);
    let topology = match &opts.detectors.topology {
        Some(file) => crate::topology::Topology::from_file(file)?,
        None => crate::topology::Topology::from_sysfs().unwrap_or_default(),
    };
    let mut findings = crate::pipeline::detect(
        &agg,
        target.pid,
        &short_futex,
        &opts.detectors,
        &buckets,
        &stacks,
        &mut sym,
    )
    .context("reading back the off-CPU intervals")?;
    let thread_names = agg.thread_names();
    let cache_lines = crate::pipeline::cache_lines(
        &agg.user_regs,
        target.pid,
        &thread_names,
        &topology,
        opts.detectors.pingpong_threshold,
        &mut sym,
    );
    findings.extend(cache_lines.findings);

    let exe_label = target
        .exe
        .as_ref()
        .and_then(|e| e.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let frame_pointers = FramePointers::judge(
        target.exe.clone(),
        match fp_scan {
            Some(t) => t.await.ok().flatten(),
            None => None,
        },
        profiles.median_user_depth,
        unwinding.has_cfi(&exe_label),
    );

    let mut warnings = unwind_warnings;
    warnings.extend(agg.intervals().file_error().map(str::to_string));
    if let Some(advice) = &frame_pointers.advice {
        warnings.push(advice.clone());
    }
    let lost = Lost::new(&counters, agg.malformed, backlog_full);
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
    let mut printed = attach_warnings;
    printed.extend(slot_log.lock().unwrap().warnings.iter().cloned());
    warnings.extend(printed.iter().cloned());
    if opts.slot_source.is_some() && timeline.slots().is_empty() {
        warnings.push("the slot source gave no slot during the session: no per-slot output".to_string());
    }
    if let Some(after) = exited_after {
        warnings.push(format!(
            "the target exited {:.1} s into the session; the profile covers the time it ran",
            after.as_secs_f64()
        ));
    }
    let summary_path = opts.out.join("summary.json");
    let mut summary = Summary {
        slotprof_version: crate::VERSION,
        kernel: report::kernel_release(),
        command: opts.command,
        target: TargetSummary {
            pid: target.pid,
            comm: target.comm.clone(),
            exe: target.exe.clone(),
            exited: exited_after.is_some(),
            exited_after_s: exited_after.map(|d| d.as_secs_f64()),
            kernel_thread,
            execs,
        },
        duration_s: elapsed.as_secs_f64(),
        ended_by: match stop {
            Stop::Duration => "duration",
            Stop::Interrupted => "interrupted",
            Stop::TargetExited => "target exited",
        },
        freq_hz: opts.freq_hz,
        min_offcpu_ms: opts.min_offcpu.as_secs_f64() * 1e3,
        probes: probe_status,
        probe_cost,
        counts: Counts {
            oncpu_samples: agg.samples,
            offcpu_intervals: agg.offcpu_intervals,
            offcpu_ns: agg.offcpu_ns,
            oncpu_stacks: profiles.oncpu.len(),
            offcpu_stacks: profiles.offcpu.len(),
            offcpu_interval_file_bytes: agg.intervals().file_bytes(),
            peak_rss_bytes: report::peak_rss_bytes(),
            kernel_samples: counters.samples,
        },
        lost,
        frame_pointers,
        unwinding,
        threads: agg.threads().into_iter().take(64).collect(),
        longest_offcpu,
        findings: {
            let mut by_kind = std::collections::BTreeMap::new();
            for f in &findings {
                *by_kind.entry(f.kind).or_insert(0u64) += 1;
            }
            by_kind
        },
        madvise_by_thread: report::madvise_by_thread(&agg.madvise_log, &thread_names),
        phase_probe: opts.phase_probe.as_ref().map(|c| {
            let in_slow = |ts: u64| phase_of(ts) == Some("slow");
            report::PhaseProbe {
                every_ms: c.every.as_secs_f64() * 1e3,
                burst_ms: c.burst.as_secs_f64() * 1e3,
                windows: phase_windows.len(),
                cpus: phases.clone(),
                slow_slots: timeline
                    .slots()
                    .iter()
                    .filter(|s| in_slow(s.start_ns + s.duration_ns() / 2))
                    .count(),
                slots: timeline.slots().len(),
                findings_in_slow_phase: findings.iter().filter(|f| in_slow(f.start_ns)).count(),
                findings: findings.len(),
            }
        }),
        cache_lines: report::CacheLines {
            path: crate::topology::cache_line_path(),
            topology: topology.source.clone(),
            samples_with_registers: agg.user_regs.len(),
            decoded_accesses: cache_lines.accesses,
            decoding: cache_lines.decoding,
        },
        tlb: report::Tlb {
            flushes: counters.tlb_local,
            shootdown_ipis: counters.tlb_ipis,
        },
        complete: false,
        outputs: Vec::new(),
        missing: Vec::new(),
        warnings,
    };
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
    for (path, result) in report::write_profiles_each(
        &opts.out,
        &profiles,
        &meta,
        &subtitle,
        crate::output::write_atomic,
    ) {
        attempt(path, result);
    }
    let findings_path = opts.out.join("findings.json");
    attempt(
        findings_path.clone(),
        serde_json::to_vec_pretty(&findings)
            .map_err(anyhow::Error::from)
            .and_then(|json| crate::output::write_atomic(&findings_path, &json)),
    );
    if opts.slot_source.is_some() {
        let period_ns = 1_000_000_000 / opts.freq_hz.max(1);
        let slot_phase = |s: &crate::slots::Slot| phase_of(s.start_ns + s.duration_ns() / 2);
        let mut writer = slot_export::SlotWriter::new(&opts.out, &findings, &slot_phase, &meta, period_ns);
        let slots = agg
            .resolve_slots_each(&timeline, &stacks, &mut sym, |i, p| {
                writer.add(&timeline.slots()[i], p)
            })
            .and_then(|()| writer.finish());
        let has_windows = timeline.slots().iter().any(|s| s.window.is_some());
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
            slot_export::write_trace(
                w,
                target.pid,
                &target.comm,
                &timeline,
                agg.samples(),
                agg.intervals(),
            )
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
    })
}

/// A symbolizer that has taken the memory map of `pid`.
pub(crate) fn symbolizer_for(pid: u32) -> anyhow::Result<Symbolizer> {
    let mut sym = Symbolizer::new();
    sym.track_process(pid)
        .with_context(|| format!("cannot read /proc/{pid}/maps (does slotprof have CAP_SYS_PTRACE?)"))?;
    Ok(sym)
}

/// Where a uprobe on `function` of `binary` goes: (binary, file offset,
/// `binary:demangled name` for messages).
pub(crate) fn uprobe_target(
    binary: &std::path::Path,
    function: &str,
) -> anyhow::Result<(PathBuf, u64, String)> {
    let f = symbolizer::functions::find(binary, function)?;
    Ok((
        binary.to_path_buf(),
        f.file_offset,
        format!("{}:{}", binary.display(), f.name),
    ))
}

/// After releasing a held child: its view once it has exec'd the command
/// and the kernel has mapped the command's code (its executable is no
/// longer slotprof's, and `/proc/PID/maps` shows the new one executable),
/// or as it is after 60 s. An exec takes a millisecond natively but can
/// take seconds in an emulated VM under the probes; past the old 2 s limit
/// the session took the trampoline's executable for the target's. The
/// executable changes at the start of the exec, before its code is
/// mapped: a map read in between holds only the stack, and a VM run whose
/// first read fell there once decoded none of its samples.
async fn wait_for_exec(held: &Target) -> Target {
    for _ in 0..12_000 {
        match Target::from_pid(held.pid) {
            Ok(now) if now.exe != held.exe && code_is_mapped(&now) => return now,
            Ok(_) => {}
            // Gone (the exec failed and the trampoline exited): the
            // session sees it exit.
            Err(_) => break,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Target::from_pid(held.pid).unwrap_or_else(|_| held.clone())
}

/// Failed re-reads of a target's memory map: said once (with the first
/// error), since code mapped after the last good read is not symbolized.
#[derive(Default)]
pub(crate) struct MapsErrors {
    said: bool,
}

impl MapsErrors {
    pub(crate) fn note(&mut self, pid: u32, e: &std::io::Error) {
        // Gone: the target exited (said when the loop sees it), not a
        // map that cannot be read.
        if e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) {
            return;
        }
        if !std::mem::replace(&mut self.said, true) {
            eprintln!(
                "slotprof: warning: cannot re-read /proc/{pid}/maps ({e}); code mapped after the last read \
                 will show as [unknown] addresses"
            );
        }
    }
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

/// Feeds every batch the reader has queued.
fn drain(
    ring: &mut crate::ring_reader::RingReader,
    agg: &mut Aggregator,
    slot_log: &SharedSlotLog,
    mut saved: Option<&mut std::io::BufWriter<std::fs::File>>,
    stack_ids: &mut Vec<i32>,
    user: &mut crate::user_stacks::UserStacks,
) {
    while let Some(batch) = ring.try_recv() {
        feed(&batch, agg, slot_log, saved.as_deref_mut(), stack_ids, user);
    }
}

fn feed(
    batch: &crate::ring_reader::Batch,
    agg: &mut Aggregator,
    slot_log: &SharedSlotLog,
    mut saved: Option<&mut std::io::BufWriter<std::fs::File>>,
    stack_ids: &mut Vec<i32>,
    user: &mut crate::user_stacks::UserStacks,
) {
    user.begin_batch();
    for item in batch.records() {
        if let Some(w) = saved.as_deref_mut() {
            if events::write_raw(w, item).is_err() {
                agg.malformed += 1;
            }
        }
        if user
            .feed(item, &mut |e| ingest(agg, slot_log, stack_ids, e))
            .is_err()
        {
            agg.malformed += 1;
        }
    }
}

fn ingest(agg: &mut Aggregator, slot_log: &SharedSlotLog, stack_ids: &mut Vec<i32>, event: events::Event) {
    match event {
        events::Event::SlotMark(m) => slot_log.lock().unwrap().marks.push((m.ts_ns, m.arg0)),
        event => {
            stack_ids.extend(event.stack_ids().into_iter().filter(|&id| id >= 0));
            agg.ingest(&event);
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
