//! What a session collected, and the detectors and phase analysis run on it.

use super::*;

/// A session once its probes are detached: what it counted and read back.
pub(super) struct Collected {
    pub(super) slot_log: SharedSlotLog,
    pub(super) target: Target,
    pub(super) kernel_thread: bool,
    pub(super) attach_warnings: Vec<String>,
    pub(super) started_mono: u64,
    pub(super) started_unix: Duration,
    pub(super) elapsed: Duration,
    pub(super) sym: Symbolizer,
    pub(super) execs: Vec<report::ExecSummary>,
    pub(super) fp_scan: Option<tokio::task::JoinHandle<Option<symbolizer::frame_pointers::FramePointerScan>>>,
    pub(super) agg: Aggregator,
    pub(super) exited_after: Option<Duration>,
    pub(super) phase_windows: Vec<crate::phase::probe::Window>,
    pub(super) phases: Vec<crate::phase::analysis::CpuPhases>,
    pub(super) psi: Option<crate::kernel::psi::PsiSampler>,
    pub(super) counters: crate::kernel::probes::Counters,
    pub(super) table: StackTable,
    pub(super) unwinding: report::Unwinding,
    pub(super) unwind_warnings: Vec<String>,
    pub(super) probe_status: Vec<crate::kernel::probes::ProbeStatus>,
    pub(super) short_futex: Vec<(u64, u64, u64)>,
    pub(super) probe_cost: Option<report::ProbeCost>,
    pub(super) backlog_full: u64,
}

impl Collected {
    /// The slots of the session, from its slot source.
    pub(super) fn timeline(&self, opts: &SessionOptions) -> Timeline {
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
pub(super) fn phase_at(phases: &[crate::phase::analysis::CpuPhases], ts: u64) -> Option<&'static str> {
    let p = phases
        .iter()
        .max_by(|a, b| a.slowdown.total_cmp(&b.slowdown))
        .filter(|p| p.slowdown >= 0.05)?;
    crate::phase::analysis::slow_at(p, ts).map(|slow| if slow { "slow" } else { "fast" })
}

/// What the session's analysis made of what it collected.
pub(super) struct Analysis {
    pub(super) profiles: crate::pipeline::aggregate::Profiles,
    pub(super) subtitle: String,
    pub(super) meta: ProfileMeta,
    pub(super) timeline: Timeline,
    pub(super) findings: Vec<detectors::Finding>,
    pub(super) cache_lines: Option<report::CacheLines>,
    pub(super) frame_pointers: FramePointers,
}

/// Names the stacks, cuts the slots, runs the detectors, judges the frame
/// pointers.
pub(super) async fn analyze(opts: &SessionOptions, c: &mut Collected) -> anyhow::Result<Analysis> {
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
pub(super) fn warnings_of(
    opts: &SessionOptions,
    c: &mut Collected,
    a: &Analysis,
    lost: &Lost,
) -> (Vec<String>, Vec<String>) {
    let mut warnings = std::mem::take(&mut c.unwind_warnings);
    warnings.extend(c.agg.intervals().file_error().map(str::to_string));
    warnings.extend(c.agg.futex_log.file_error().map(str::to_string));
    warnings.extend(c.agg.futex_log.read_error());
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
