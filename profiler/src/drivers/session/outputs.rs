//! A session's outputs: profiles, the per-slot export, the summary.

use super::*;

/// Analyses what the session collected, then writes its outputs: the
/// summary first (small, so that a full disk still leaves it), then the
/// profiles, findings, per-slot files and trace, and the summary again
/// with what was written and what was not.
pub(super) async fn report(opts: &SessionOptions, mut c: Collected, stop: Stop) -> anyhow::Result<Outcome> {
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
pub(super) fn summary_of(
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
            offcpu_folded: c.agg.offcpu_folded,
            offcpu_folds: c.agg.offcpu_folds,
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
pub(super) fn write_outputs(
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
        report::Draw::Now,
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
pub(super) struct SlotLabelled<'a> {
    pub(super) b: flamegraphs::pprof::Builder,
    pub(super) whole: &'a Profiles,
    /// What the slots have not taken yet, by (stack, thread, CPU):
    /// (samples, off-CPU ns).
    pub(super) left: HashMap<RowKey, (u64, u64)>,
    pub(super) period_ns: i64,
}

impl<'a> SlotLabelled<'a> {
    pub(super) fn new(whole: &'a Profiles, period_ns: i64) -> Self {
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

    pub(super) fn slot(&mut self, p: &Profiles, labels: &report::SlotLabels) {
        for r in &p.rows {
            if let Some(v) = self.left.get_mut(&r.key()) {
                v.0 = v.0.saturating_sub(r.samples);
                v.1 = v.1.saturating_sub(r.offcpu_ns);
            }
        }
        report::add_rows(&mut self.b, &p.rows, self.period_ns, &labels.labels());
    }

    pub(super) fn finish(mut self) -> flamegraphs::pprof::Builder {
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
