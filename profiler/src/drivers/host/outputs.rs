//! What a host session leaves: its summary (summary.json), the findings,
//! the per-second series (CSV, JSON, the plot) and, when asked, the
//! recording `replay` reads.

use super::*;

/// summary.json of a host session.
#[derive(Debug, Serialize)]
pub struct HostSummary {
    pub command: &'static str,
    pub version: &'static str,
    pub kernel: String,
    pub duration_s: f64,
    pub ended_by: &'static str,
    /// CLOCK_MONOTONIC at second 0 of the series (to line it up with a
    /// guest-side or slot timeline).
    pub start_monotonic_ns: u64,
    pub totals: InvalidationTotals,
    pub vms: Vec<VmInfo>,
    /// Ranges several VM processes map: (pids, pages).
    pub ambiguous: Vec<(Vec<u32>, u64)>,
    pub duty_cycle: DutyCycle,
    pub sysctls_at_start: Sysctls,
    pub sysctls_at_end: Sysctls,
    pub findings: usize,
    pub lost: HostLost,
    pub probes: Vec<ProbeStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_cost: Option<ProbeCost>,
    pub outputs: Vec<String>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
pub struct HostLost {
    pub ring_buffer_full: u64,
    /// Records the reader dropped at its queue's bound (slotprof's own
    /// loop fell behind).
    pub backlog_full: u64,
    pub stacks: u64,
    pub malformed_records: u64,
    pub total: u64,
}

/// What a host session produced.
pub struct HostOutcome {
    pub summary: HostSummary,
    pub findings: Vec<HostFinding>,
}

/// How a host session ended, and what its probes said before detaching.
pub(super) struct Ended {
    pub(super) elapsed: Duration,
    pub(super) ended_by: &'static str,
    pub(super) sysctls_at_start: Sysctls,
    pub(super) counters: crate::kernel::probes::Counters,
    pub(super) probe_status: Vec<crate::kernel::probes::ProbeStatus>,
    pub(super) costs: Option<Vec<crate::kernel::probes::ProgramCost>>,
    /// Records the ring reader dropped at its queue's bound.
    pub(super) backlog_full: u64,
}

/// The findings, the series (CSV, JSON, SVG) and the summary of a host
/// session.
pub(super) fn write_outputs(
    opts: &HostOptions,
    mut state: InvalidationCounts,
    mut vms: Vmms,
    ended: Ended,
    mut warnings: Vec<String>,
    saved: Option<Vec<HostSample>>,
) -> anyhow::Result<HostOutcome> {
    let Ended {
        elapsed,
        ended_by,
        sysctls_at_start,
        counters,
        probe_status,
        costs,
        backlog_full,
    } = ended;
    state.end(elapsed.as_secs_f64());
    vms.refresh();
    let sysctls_at_end = read_sysctls();
    let infos: BTreeMap<u32, VmInfo> = vms.vmms.iter().map(|(&pid, v)| (pid, v.info.clone())).collect();
    let findings = detect(&state, &infos, &sysctls_at_end, elapsed.as_secs_f64());
    if let (Some(dir), Some(samples)) = (&opts.save_replay, saved) {
        let recording = crate::pipeline::replay::HostRecording {
            version: crate::pipeline::replay::VERSION,
            start_ns: state.start_ns,
            seconds: elapsed.as_secs_f64(),
            samples,
            stacks: state.stacks.clone(),
            vms: infos.clone(),
            sysctls: sysctls_at_end.clone(),
            findings: serde_json::to_value(&findings)?,
        };
        crate::pipeline::replay::write_host(dir, &recording)?;
    }
    let all_pages: Vec<u64> = state.series.seconds.iter().map(|s| s.invalidated_pages).collect();
    let duty = duty_cycle(&all_pages);

    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot create the output directory {}", opts.out.display()))?;
    let mut outputs = Vec::new();
    let mut put = |name: &str, bytes: &[u8]| -> anyhow::Result<()> {
        let path = opts.out.join(name);
        write_atomic(&path, bytes)?;
        outputs.push(path.display().to_string());
        Ok(())
    };
    put("findings.json", &serde_json::to_vec_pretty(&findings)?)?;
    put("host-series.csv", series_csv(&state.series).as_bytes())?;
    put("host-series.json", &serde_json::to_vec(&state.series.seconds)?)?;
    let title = format!(
        "slotprof host: {} pages invalidated in {:.0} s; {}",
        state.totals.invalidated_pages,
        elapsed.as_secs_f64(),
        vm_list(&vms)
    );
    put("host.svg", plot::render(&state.series, &duty, &title).as_bytes())?;
    let summary_path = opts.out.join("summary.json");
    outputs.push(summary_path.display().to_string());
    let lost = HostLost {
        ring_buffer_full: counters.ring_full,
        backlog_full,
        stacks: counters.stack_lost,
        malformed_records: state.malformed,
        total: counters.ring_full + backlog_full + counters.stack_lost + state.malformed,
    };
    if lost.total > 0 {
        warnings.push(format!(
            "{} events lost ({} ring buffer full, {} slotprof's queue full, {} stacks, {} malformed): counts are lower bounds",
            lost.total, lost.ring_buffer_full, lost.backlog_full, lost.stacks, lost.malformed_records
        ));
    }
    if state.totals.ambiguous_pages > 0 {
        warnings.push(format!(
            "{} invalidated pages are in ranges several VM processes map; pass --vm-pid to single one out",
            state.totals.ambiguous_pages
        ));
    }
    let summary = HostSummary {
        command: "host",
        version: crate::VERSION,
        kernel: crate::export::report::kernel_release(),
        duration_s: elapsed.as_secs_f64(),
        ended_by,
        start_monotonic_ns: state.start_ns,
        totals: state.totals.clone(),
        vms: vms.vmms.values().map(|v| v.info.clone()).collect(),
        ambiguous: state.ambiguous.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        duty_cycle: duty,
        sysctls_at_start,
        sysctls_at_end,
        findings: findings.len(),
        lost,
        probes: probe_status,
        probe_cost: costs.map(|c| ProbeCost::new(c, elapsed)),
        outputs,
        warnings,
    };
    write_atomic(&summary_path, &serde_json::to_vec_pretty(&summary)?)?;
    Ok(HostOutcome { summary, findings })
}

/// The VM processes watched, for messages.
pub(super) fn vm_list(vms: &Vmms) -> String {
    if vms.vmms.is_empty() {
        "no VM processes yet (looking every 5 s)".into()
    } else {
        vms.vmms
            .values()
            .map(|v| format!("{} (pid {})", v.info.comm, v.info.pid))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

pub(super) fn vm_list_one(vms: &Vmms, pid: u32) -> String {
    vms.vmms.get(&pid).map_or(format!("pid {pid}"), |v| {
        format!("{} (pid {})", v.info.comm, v.info.pid)
    })
}

/// The series as CSV: one row per second, fixed columns, then invalidated
/// pages per source and per VM (`vm0`: not attributed to one VM), then
/// compaction's scanned and isolated pages per source.
pub fn series_csv(series: &Series) -> String {
    let mut sources: BTreeSet<&String> = BTreeSet::new();
    let mut vms: BTreeSet<u32> = BTreeSet::new();
    let mut compactors: BTreeSet<&String> = BTreeSet::new();
    for s in &series.seconds {
        sources.extend(s.invalidated_by_source.keys());
        vms.extend(s.invalidated_by_vm.keys());
        compactors.extend(s.scanned_by_source.keys());
    }
    let mut out = String::from(
        "second,invalidated_pages,invalidations,compaction_scanned,compaction_isolated,migrated,migrate_failed,compaction_runs",
    );
    for s in &sources {
        out.push_str(&format!(",invalidated_pages_{s}"));
    }
    for v in &vms {
        out.push_str(&format!(",invalidated_pages_vm{v}"));
    }
    for c in &compactors {
        out.push_str(&format!(",compaction_scanned_{c},compaction_isolated_{c}"));
    }
    out.push('\n');
    for (i, s) in series.seconds.iter().enumerate() {
        out.push_str(&format!(
            "{i},{},{},{},{},{},{},{}",
            s.invalidated_pages,
            s.invalidations,
            s.compaction_scanned,
            s.compaction_isolated,
            s.migrated,
            s.migrate_failed,
            s.compaction_runs
        ));
        for src in &sources {
            out.push_str(&format!(",{}", s.invalidated_by_source.get(*src).unwrap_or(&0)));
        }
        for v in &vms {
            out.push_str(&format!(",{}", s.invalidated_by_vm.get(v).unwrap_or(&0)));
        }
        for c in &compactors {
            out.push_str(&format!(
                ",{},{}",
                s.scanned_by_source.get(*c).unwrap_or(&0),
                s.isolated_by_source.get(*c).unwrap_or(&0)
            ));
        }
        out.push('\n');
    }
    out
}
