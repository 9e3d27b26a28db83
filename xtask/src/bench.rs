//! `cargo xtask bench`: overhead measurements, written to BENCHMARKS.md.
//!
//! The machine is a noisy 2-vCPU VM (see ../shared/notes/benchmarking.md),
//! so every comparison interleaves its variants in rounds and reports
//! medians, and the probes' own cost comes from the kernel's accounting
//! (`--probe-stats`), not from wall-clock differences.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context};
use serde_json::Value;

const ROUNDS: usize = 5;
const SECONDS: &str = "3";

/// What runs the storm.
#[derive(Clone, Copy, PartialEq)]
enum Tool {
    Alone,
    /// `slotprof record [options] -- storm`.
    Slotprof(&'static [&'static str]),
    /// `perf trace -e futex,madvise -- storm`: the detector probes' job.
    PerfTrace,
    /// `perf record -e sched:sched_switch -g -- storm`: the off-CPU job.
    PerfSwitch,
}

/// A way to run the storm: through what, under which tool.
struct Variant {
    name: &'static str,
    /// `futex-storm --through`: futex or pipe.
    through: &'static str,
    /// `futex-storm --pairs`: 1 (a CPU goes idle at every handoff) or 2
    /// (more threads than CPUs: a CPU switches straight to the next one).
    pairs: u32,
    tool: Tool,
}

const fn variant(name: &'static str, through: &'static str, pairs: u32, tool: Tool) -> Variant {
    Variant {
        name,
        through,
        pairs,
        tool,
    }
}

/// Every storm runs alone, under slotprof with all probes, and under both
/// perf jobs (the one-pair futex storm also under slotprof without the
/// detector probes), so each tool is compared on the same storm.
const VARIANTS: [Variant; 17] = [
    variant("alone", "futex", 1, Tool::Alone),
    variant(
        "slotprof, on/off-CPU probes only (--no-detector-probes)",
        "futex",
        1,
        Tool::Slotprof(&["--no-detector-probes"]),
    ),
    variant(
        "slotprof, all probes (+ madvise, futex, TLB, IPI, page faults)",
        "futex",
        1,
        Tool::Slotprof(&[]),
    ),
    variant(PERF_TRACE, "futex", 1, Tool::PerfTrace),
    variant(PERF_SWITCH, "futex", 1, Tool::PerfSwitch),
    variant("alone", "pipe", 1, Tool::Alone),
    variant("slotprof, all probes", "pipe", 1, Tool::Slotprof(&[])),
    variant(PERF_TRACE, "pipe", 1, Tool::PerfTrace),
    variant(PERF_SWITCH, "pipe", 1, Tool::PerfSwitch),
    variant("alone", "futex", 2, Tool::Alone),
    variant("slotprof, all probes", "futex", 2, Tool::Slotprof(&[])),
    variant(PERF_TRACE, "futex", 2, Tool::PerfTrace),
    variant(PERF_SWITCH, "futex", 2, Tool::PerfSwitch),
    variant("alone", "pipe", 2, Tool::Alone),
    variant("slotprof, all probes", "pipe", 2, Tool::Slotprof(&[])),
    variant(PERF_TRACE, "pipe", 2, Tool::PerfTrace),
    variant(PERF_SWITCH, "pipe", 2, Tool::PerfSwitch),
];

const PERF_TRACE: &str = "perf trace -e futex,madvise";
const PERF_SWITCH: &str = "perf record -e sched:sched_switch -g";

/// The variants with all slotprof probes on the futex storm, one pair and
/// two (those whose per-program costs are reported).
const ALL_PROBES: usize = 2;
const ALL_PROBES_2: usize = 10;

fn bin(root: &Path, name: &str) -> PathBuf {
    root.join("target/release").join(name)
}

/// One run of the storm: its report, and under slotprof the summary and
/// slotprof's own CPU seconds (its children's CPU minus the storm's own).
struct StormRun {
    report: Value,
    summary: Option<Value>,
    tool_cpu_s: f64,
    /// Context switches a second on the whole machine (/proc/stat ctxt).
    switches_per_s: f64,
}

/// Context switches since boot, all CPUs (/proc/stat `ctxt`).
fn context_switches() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("ctxt ").and_then(|n| n.trim().parse().ok()))
        })
        .unwrap_or(0)
}

/// Runs the storm once.
fn storm(
    root: &Path,
    v: &Variant,
    stats: bool,
    scratch: &Path,
    perf: Option<&Path>,
) -> anyhow::Result<StormRun> {
    let before = children_cpu_s();
    let (switches_before, started) = (context_switches(), std::time::Instant::now());
    let report = scratch.join("storm.json");
    let out = scratch.join("out");
    let storm = bin(root, "futex-storm");
    let pairs = v.pairs.to_string();
    let storm_args = [
        "--seconds",
        SECONDS,
        "--through",
        v.through,
        "--pairs",
        &pairs,
        "--report",
        report.to_str().unwrap(),
    ];
    let mut c = match v.tool {
        Tool::Alone => Command::new(&storm),
        Tool::Slotprof(opts) => {
            let mut c = Command::new(bin(root, "slotprof"));
            c.args(["record", "--out", out.to_str().unwrap()]).args(opts);
            if stats {
                c.arg("--probe-stats");
            }
            c.arg("--").arg(&storm);
            c
        }
        Tool::PerfTrace | Tool::PerfSwitch => {
            let mut c = Command::new(perf.context("perf is not installed")?);
            if v.tool == Tool::PerfTrace {
                c.args(["trace", "-e", "futex,madvise", "-o"]);
            } else {
                c.args(["record", "-e", "sched:sched_switch", "-g", "-o"]);
            }
            c.arg(scratch.join("perf.out")).arg("--").arg(&storm);
            c
        }
    };
    let status = c
        .args(storm_args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("{} ({}) failed ({status})", v.name, v.through);
    }
    let read =
        |p: &Path| -> anyhow::Result<Value> { Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?) };
    let spent = children_cpu_s() - before;
    let switches_per_s = (context_switches() - switches_before) as f64 / started.elapsed().as_secs_f64();
    let summary = if matches!(v.tool, Tool::Slotprof(_)) {
        Some(read(&out.join("summary.json"))?)
    } else {
        None
    };
    let report = read(&report)?;
    // The storm's CPU reaches our children's total through the tool that
    // waited for it; `perf trace` does not wait for its workload (checked:
    // a 1.5 s busy child under it adds 0.12 s here), so there everything
    // spent is the tool's own.
    let storm_cpu = report["cpu_s"].as_f64().unwrap_or(0.0);
    let tool_cpu_s = match v.tool {
        Tool::Alone => 0.0,
        Tool::PerfTrace => spent,
        _ => (spent - storm_cpu).max(0.0),
    };
    Ok(StormRun {
        report,
        summary,
        tool_cpu_s,
        switches_per_s,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpus} vCPUs ({cpu}), Linux {kernel}")
}

/// Section headings (`--only NAME` replaces that section alone).
const STORM_HEADING: &str = "## Detector probes on a futex-heavy workload";
const RUN_HEADING: &str = "## Always-on memory and CPU (`slotprof run`)";
const OVERHEAD_HEADING: &str = "## Overhead on a CPU-bound PoH loop: slotprof and perf";
const USERSPACE_HEADING: &str = "## The aggregator and the symbolizer (userspace, one core)";
const VALIDATOR_HEADING: &str = "## On a real validator: solana-test-validator 4.4.0 under load, beside perf";
const PHASE_HEADING: &str = "## Phase probe (guest mode) on a CPU-bound PoH loop";
const HOST_HEADING: &str = "## Host mode during compaction";

/// Which commit a section was measured at: the short hash, and whether the
/// work tree had changes on top of it.
pub(crate) fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(hash) = git(&["rev-parse", "--short=7", "HEAD"]) else {
        return "an unknown commit (not a git checkout)".into();
    };
    // BENCHMARKS.md itself is not a change to what is measured (the
    // sections run one after another rewrite it).
    let dirty = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!BENCHMARKS.md",
    ])
    .is_some_and(|s| !s.is_empty());
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    format!(
        "commit `{hash}`{} ({date})",
        if dirty { " with uncommitted changes" } else { "" }
    )
}

/// A section with the commit it was measured at under its heading.
pub(crate) fn stamped(root: &Path, section: String) -> String {
    match section.split_once('\n') {
        Some((heading, rest)) => format!("{heading}\n\nMeasured at {}.\n{rest}", commit(root)),
        None => section,
    }
}

/// `md` with the section under `heading` replaced by `section` (inserted
/// before "## Reproduce" when it is not there yet).
pub(crate) fn splice(md: &str, heading: &str, section: &str) -> String {
    match md.find(heading) {
        Some(i) => {
            let rest = &md[i + heading.len()..];
            let end = rest.find("\n## ").map_or(md.len(), |j| i + heading.len() + j + 1);
            format!("{}{section}{}", &md[..i], &md[end..])
        }
        None => match md.find("## Reproduce") {
            Some(i) => format!("{}{section}{}", &md[..i], &md[i..]),
            None => md.to_string() + section,
        },
    }
}

pub fn run(root: &Path, args: &[String]) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmarks load eBPF programs: run `sudo cargo xtask bench`");
    }
    let scratch = crate::private_temp_dir("slotprof-bench")?;
    type Section = fn(&Path, &Path) -> anyhow::Result<String>;
    let sections: [(&str, &str, Section); 7] = [
        ("storm", STORM_HEADING, storm_section),
        ("overhead", OVERHEAD_HEADING, overhead_section),
        ("userspace", USERSPACE_HEADING, userspace_section),
        ("phase", PHASE_HEADING, phase_probe_section),
        ("host", HOST_HEADING, host_section),
        ("run", RUN_HEADING, run_section),
        ("validator", VALIDATOR_HEADING, validator_section),
    ];
    let mut only = None;
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        match (a.as_str(), rest.next()) {
            ("--only", Some(what)) => only = Some(what.clone()),
            ("--run-minutes", Some(n)) => match n.parse::<u64>() {
                Ok(n) if n >= 2 => RUN_MINUTES.store(n, std::sync::atomic::Ordering::Relaxed),
                _ => bail!(
                    "cargo xtask bench --run-minutes: {n:?} is not a whole number of minutes (2 or more)"
                ),
            },
            _ => bail!(
                "usage: cargo xtask bench [--only storm|overhead|userspace|phase|host|run|validator] [--run-minutes N]"
            ),
        }
    }
    match only {
        None => {}
        Some(what) => {
            let Some((_, heading, f)) = sections.iter().find(|(n, _, _)| *n == what.as_str()) else {
                bail!("cargo xtask bench --only: {what:?} is not a section: use storm, overhead, userspace, phase, host, run or validator");
            };
            // Just this section, spliced into the existing file.
            let section = stamped(root, f(root, &scratch)?);
            let _ = std::fs::remove_dir_all(&scratch);
            let path = root.join("BENCHMARKS.md");
            let md = std::fs::read_to_string(&path).unwrap_or_default();
            std::fs::write(&path, splice(&md, heading, &section))?;
            eprintln!("xtask: updated the {what} section of BENCHMARKS.md");
            return Ok(());
        }
    }
    let mut md = String::new();
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(
        md,
        "Written by `sudo cargo xtask bench` (do not edit by hand). Machine: {}.\n",
        machine()
    );
    let _ = writeln!(md, "This machine is a noisy VM: each comparison runs its variants interleaved, {ROUNDS} rounds of {SECONDS} s, and reports medians; the probes' own cost is the kernel's accounting (`--probe-stats`, BPF_ENABLE_STATS).\n");
    md.push_str(&stamped(root, storm_section(root, &scratch)?));
    md.push_str(&stamped(root, overhead_section(root, &scratch)?));
    md.push_str(&stamped(root, userspace_section(root, &scratch)?));
    md.push_str(&stamped(root, phase_probe_section(root, &scratch)?));
    md.push_str(&stamped(root, host_section(root, &scratch)?));
    md.push_str(&stamped(root, run_section(root, &scratch)?));
    md.push_str(&stamped(root, validator_section(root, &scratch)?));
    let _ = std::fs::remove_dir_all(&scratch);
    // The fault soak's section is written by `cargo xtask soak`: kept.
    let old = std::fs::read_to_string(root.join("BENCHMARKS.md")).unwrap_or_default();
    if let Some(i) = old.find(crate::soak::HEADING) {
        let rest = &old[i..];
        let end = rest[3..].find("\n## ").map_or(rest.len(), |j| j + 4);
        md.push_str(&rest[..end]);
    }
    let _ = writeln!(
        md,
        "## Reproduce\n\n```sh\nsudo cargo xtask bench                  # rewrites this file (every section; the validator one alone takes ~35 min)\nsudo cargo xtask bench --only run       # one section: storm, overhead, userspace, phase, host, run (10 min) or validator (35 min)\nsudo cargo xtask bench --run-minutes 30 # the always-on runs (synthetic and real node) for longer\nsudo cargo xtask soak --minutes 60      # the fault soak (its own section)\n```\n"
    );
    let _ = writeln!(md, "Reference figures for perf and bpftrace on this machine kind are in ../shared/notes/benchmarking.md (a pipe ping-pong storm: bpftrace sched_switch counting 0.82, offcputime-style 0.62, perf record -e sched:sched_switch -g 0.63).");
    std::fs::write(root.join("BENCHMARKS.md"), md)?;
    eprintln!("xtask: wrote BENCHMARKS.md");
    Ok(())
}

/// The futex storm: throughput alone and under the probes, slotprof's own
/// CPU, lost events, and each program's kernel-accounted cost.
fn storm_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let perf = perf_binary(root);
    let variants: Vec<&Variant> = VARIANTS
        .iter()
        .filter(|v| perf.is_some() || matches!(v.tool, Tool::Alone | Tool::Slotprof(_)))
        .collect();
    let n = variants.len();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut tool_cpu: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut lost = vec![0u64; n];
    let mut switches: Vec<Vec<f64>> = vec![Vec::new(); n];
    // The storm's own CPU per round trip: its work plus whatever the
    // tracing runs in its threads' context (probes at its switches).
    let mut us_per_trip: Vec<Vec<f64>> = vec![Vec::new(); n];
    for round in 0..ROUNDS {
        for (i, v) in variants.iter().enumerate() {
            let run = storm(root, v, false, scratch, perf.as_deref())?;
            let rate = run.report["round_trips_per_s"].as_f64().context("storm report")?;
            eprintln!(
                "xtask: bench round {} {:<5} {:<64} {rate:>8.0} round trips/s, tool CPU {:.2} s",
                round + 1,
                v.through,
                v.name,
                run.tool_cpu_s
            );
            rates[i].push(rate);
            tool_cpu[i].push(run.tool_cpu_s);
            switches[i].push(run.switches_per_s);
            let trips = run.report["round_trips"].as_f64().unwrap_or(0.0).max(1.0);
            us_per_trip[i].push(run.report["cpu_s"].as_f64().unwrap_or(0.0) * 1e6 / trips);
            if let Some(s) = &run.summary {
                lost[i] += s["lost"]["total"].as_u64().unwrap_or(0);
            }
        }
    }
    let trip_cost: Vec<f64> = us_per_trip.iter().map(|v| median(v.clone())).collect();
    let medians: Vec<f64> = rates.iter().map(|r| median(r.clone())).collect();
    let alone_of = |of: &Variant| {
        variants
            .iter()
            .position(|v| v.through == of.through && v.pairs == of.pairs && v.tool == Tool::Alone)
    };
    let alone = |of: &Variant| alone_of(of).map_or(1.0, |i| medians[i]);
    let mut md = String::new();
    let _ = writeln!(md, "{STORM_HEADING}\n");
    let _ = writeln!(md, "`futex-storm` (tests/src/bin/futex-storm.rs): two threads hand a token back and forth, through a Mutex and a Condvar (futex: every round trip is two futex waits and two wakes) or through two pipes (pipe: the ping-pong of ../shared/notes/benchmarking.md). Every handoff is a context switch out and in: the worst case for the sched probes, and for the futex probes. With one pair a CPU goes idle at every handoff (~90k switches a second here); with two pairs on two CPUs it switches straight from one storm thread to another (~800k a second, every switch between two of the target's threads). slotprof runs as `slotprof record [options] -- futex-storm --seconds {SECONDS} --through T --pairs N` at the default 99 Hz; perf does the same job on the same storm: `perf trace -e futex,madvise` what the futex/madvise probes do, `perf record -e sched:sched_switch -g` what the off-CPU probes do (a stack at every switch).\n");
    let _ = writeln!(
        md,
        "| storm | variant | storm CPU per round trip (median) | vs alone | round trips/s (median) | ratio to alone | context switches/s, machine (median) | tool's own CPU (median, % of one CPU) | events lost (all rounds) | all rounds (round trips/s) |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    let alone_cost = |of: &Variant| alone_of(of).map_or(1.0, |i| trip_cost[i]);
    let secs: f64 = SECONDS.parse().unwrap_or(3.0);
    for (i, v) in variants.iter().enumerate() {
        let all: Vec<String> = rates[i].iter().map(|r| format!("{r:.0}")).collect();
        let cpu = match v.tool {
            Tool::Alone => "-".to_string(),
            _ => format!("{:.1}%", 100.0 * median(tool_cpu[i].clone()) / secs),
        };
        let lost = match v.tool {
            Tool::Slotprof(_) => lost[i].to_string(),
            _ => "-".to_string(),
        };
        let _ = writeln!(
            md,
            "| {}, {} | {} | {:.1} us | {:+.1} us | {:.0} | {:.2} | {:.0}k | {cpu} | {lost} | {} |",
            v.through,
            if v.pairs == 1 {
                "1 pair".to_string()
            } else {
                format!("{} pairs", v.pairs)
            },
            v.name,
            trip_cost[i],
            trip_cost[i] - alone_cost(v),
            medians[i],
            medians[i] / alone(v),
            median(switches[i].clone()) / 1000.0,
            all.join(", ")
        );
    }
    let _ = writeln!(
        md,
        "\nThe storm's CPU per round trip is its threads' user + system time (getrusage) over its round trips: the work of a handoff plus what tracing runs in their context (the probes at their switches, syscalls and wakeups), which is the cost to the traced program. With one pair, throughput is not: on this VM that storm often runs faster under tracing (ratios over 1), likely because extra work at each switch keeps a vCPU from going idle between handoffs, and waking an idle vCPU costs more than the probes. With two pairs both CPUs are always busy and the ratio is the cost. A tool's own CPU is its process's user + system time (for slotprof: decoding, aggregation, symbolization and writing the outputs at the end), not the probes' (those run in the kernel, in the storm's threads; below)."
    );
    let _ = writeln!(
        md,
        "\nThe one-pair futex storm's throughput moves by more than the detector probes' cost from round to round on this VM (between the first two slotprof rows: {:.2}); the kernel's accounting below is the steadier measure.\n",
        medians[ALL_PROBES] / medians[1]
    );
    let _ = writeln!(
        md,
        "History: the worst cost was the stack walks at every switch-out and wakeup. At commit 9e315a5 the one-pair table below read sched_switch 2374 ns/run, sched_waking 3720 ns/run, all probes 16.1% of the machine (same command). Before issue 15, a switch-out inside a futex wait skipped the kernel stack walk and a wakeup walked the waker's stacks only near the reporting minimum (two-pair storm 0.41-0.44 of alone). Since issue 15 no stack is taken at a switch-out or wakeup unless it will be reported: a blocked thread's kernel stack is walked (or named by its waiting system call) at its switch-in once the interval is known to be long enough, its user stack copied at its system call's exit; wakers are described by interrupt nesting and the waking task's system call, without a walk. At commit 92a51e3 the system call and wakeup probes became BTF tracepoints (the kernel's own arguments by direct loads; a classic tracepoint builds a record and the program reads it through a helper) and a thread's futex wait moved into its one off-CPU entry: the two-pair futex storm went from 0.70 to 0.78 of alone, the pipe storm from 0.73 to 0.75 (this bench at d4bc241 and at 92a51e3).\n"
    );
    for (which, title) in [(ALL_PROBES, "one pair"), (ALL_PROBES_2, "two pairs")] {
        let v = &VARIANTS[which];
        let summary = storm(root, v, true, scratch, None)?
            .summary
            .context("no summary")?;
        let _ = writeln!(
            md,
            "Per-program cost in one more run of the {} storm, {title}, with `--probe-stats` (all probes):\n",
            v.through
        );
        md.push_str(&probe_cost_text(&summary));
    }
    let floor = filtered_costs(root, scratch)?;
    let _ = writeln!(
        md,
        "The filtered path, what a run costs when the task is not the target's: `slotprof attach --probe-stats` to an idle process (`sleep`) while the two-pair futex storm runs alone: **sched_switch {:.0} ns/run, sched_waking {:.0} ns/run** (target < 150 ns). Both run at every switch and wakeup on the machine; they read the current task's tgid and the woken or incoming tid's byte in a 64 KiB hint of the target's threads, and stop. Run-time stats themselves cost: with both programs' bodies replaced by `return 0` (a one-off experiment, not part of this bench) the same measurement read 47 ns for each. A switch between two of the target's threads whose interval is not reported costs the two-pair table's figure: the outgoing thread's entry in the off-CPU map written in place, the incoming thread's read, and no stack (a storm's handoffs are far under --min-offcpu).\n",
        floor.0, floor.1
    );
    Ok(md)
}

/// The per-program table of a `--probe-stats` summary, what sched_switch
/// ran at, and the probes' share of the machine, split between the
/// detectors' probes and the on/off-CPU ones.
fn probe_cost_text(summary: &Value) -> String {
    let mut md = String::new();
    md.push_str(&program_table(summary));
    let switch_runs = summary["probe_cost"]["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["program"] == "slotprof_switch")
        .and_then(|p| p["runs"].as_f64())
        .unwrap_or(0.0);
    let _ = writeln!(
        md,
        "\nsched_switch ran {:.0}k times a second in that run (every switch on the machine; the storm is slower under the probes).",
        switch_runs / summary["duration_s"].as_f64().unwrap_or(1.0) / 1000.0
    );
    let _ = writeln!(
        md,
        "\nAll probes together used {:.2}% of the machine's CPU during that run.",
        summary["probe_cost"]["cpu_percent"].as_f64().unwrap_or(0.0)
    );
    // Split the kernel-accounted time between the detectors' probes and the
    // on/off-CPU ones: a steadier answer than the noisy throughput ratio.
    // (slotprof_sys_enter records futex waits and madvise calls: a
    // detector probe; slotprof_sys_exit also copies deferred off-CPU
    // stacks, so it stays with the on/off-CPU ones.)
    let detector = [
        "slotprof_sys_enter",
        "slotprof_tlb",
        "slotprof_ipi",
        "slotprof_page",
    ];
    let (mut det_ns, mut base_ns) = (0.0, 0.0);
    for p in summary["probe_cost"]["programs"].as_array().into_iter().flatten() {
        let ns = p["total_ns"].as_f64().unwrap_or(0.0);
        if detector
            .iter()
            .any(|d| p["program"].as_str().unwrap_or("").starts_with(d))
        {
            det_ns += ns;
        } else {
            base_ns += ns;
        }
    }
    let secs = summary["duration_s"].as_f64().unwrap_or(1.0);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let _ = writeln!(
        md,
        "Of that, the detectors' probes (madvise, futex, TLB, IPI, page faults) ran {:.1} ms in {secs:.1} s \
         ({:.2}% of the machine), the on/off-CPU probes {:.1} ms ({:.2}%). The throughput ratios above move \
         by more than that from round to round on this VM.\n",
        det_ns / 1e6,
        100.0 * det_ns / (secs * 1e9 * cpus),
        base_ns / 1e6,
        100.0 * base_ns / (secs * 1e9 * cpus),
    );
    md
}

/// (sched_switch, sched_waking) ns per run when no task is the target's:
/// slotprof attached to an idle process while the storm runs alone.
fn filtered_costs(root: &Path, scratch: &Path) -> anyhow::Result<(f64, f64)> {
    let mut idle = Command::new("sleep").arg("30").spawn()?;
    let out = scratch.join("filtered");
    let mut tool = Command::new(bin(root, "slotprof"))
        .args([
            "attach",
            "-p",
            &idle.id().to_string(),
            "-d",
            "4s",
            "--probe-stats",
            "--out",
        ])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    std::thread::sleep(std::time::Duration::from_millis(700));
    let storm = Command::new(bin(root, "futex-storm"))
        .args(["--seconds", "3", "--pairs", "2", "--report"])
        .arg(scratch.join("filtered-storm.json"))
        .stdout(std::process::Stdio::null())
        .status()?;
    let status = tool.wait()?;
    let _ = idle.kill();
    let _ = idle.wait();
    if !storm.success() || !status.success() {
        bail!("the filtered-run measurement failed (storm {storm}, slotprof {status})");
    }
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json"))?)?;
    let avg = |name: &str| {
        summary["probe_cost"]["programs"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["program"] == name)
            .and_then(|p| p["avg_ns"].as_f64())
            .unwrap_or(f64::NAN)
    };
    Ok((avg("slotprof_switch"), avg("slotprof_waking")))
}

/// The guest-mode phase probe's cost to a CPU-bound PoH-like loop on every
/// CPU (the worst case: the probe's bursts take CPU time from it directly).
fn phase_probe_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let variants: [(&str, Option<&[&str]>); 3] = [
        ("alone", None),
        ("slotprof record (all probes)", Some(&[])),
        (
            "slotprof record --phase-probe (1 ms every 100 ms per CPU)",
            Some(&["--phase-probe"]),
        ),
    ];
    let report = scratch.join("poh.json");
    let poh = bin(root, "poh-loop");
    let poh_args = ["--seconds", SECONDS, "--report", report.to_str().unwrap()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..ROUNDS {
        for (i, (name, opts)) in variants.iter().enumerate() {
            let status = match opts {
                None => Command::new(&poh).args(poh_args).status()?,
                Some(opts) => Command::new(bin(root, "slotprof"))
                    .args(["record", "--out", scratch.join("poh-out").to_str().unwrap()])
                    .args(*opts)
                    .arg("--")
                    .arg(&poh)
                    .args(poh_args)
                    .stdout(std::process::Stdio::null())
                    .status()?,
            };
            if !status.success() {
                bail!("{name} failed ({status})");
            }
            let r: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
            let rate = r["hashes_per_s"].as_f64().context("poh report")?;
            eprintln!(
                "xtask: bench round {} {name:<60} {:>8.1} M hashes/s",
                round + 1,
                rate / 1e6
            );
            rates[i].push(rate);
        }
    }
    let medians: Vec<f64> = rates.iter().map(|r| median(r.clone())).collect();
    let mut md = String::new();
    let _ = writeln!(md, "{PHASE_HEADING}\n");
    let _ = writeln!(md, "`poh-loop` (tests/src/bin/poh-loop.rs): one sha256 chain per CPU, as a leader's PoH thread runs, for {SECONDS} s. The phase probe runs its own 1 ms sha256 burst every 100 ms pinned on each CPU, so by construction it takes 1% of each CPU; this measures what the loop loses.\n");
    let _ = writeln!(
        md,
        "| variant | M hashes/s (median) | ratio to alone | all rounds |"
    );
    let _ = writeln!(md, "|---|---|---|---|");
    for (i, (name, _)) in variants.iter().enumerate() {
        let all: Vec<String> = rates[i].iter().map(|r| format!("{:.1}", r / 1e6)).collect();
        let _ = writeln!(
            md,
            "| {name} | {:.1} | {:.3} | {} |",
            medians[i] / 1e6,
            medians[i] / medians[0],
            all.join(", ")
        );
    }
    let _ = writeln!(
        md,
        "\nThe phase probe alone: ratio {:.3} between the last two rows (expected ~0.99).\n",
        medians[2] / medians[1]
    );
    Ok(md)
}

/// Sets the two compaction sysctls and restores them when dropped, on
/// every path.
struct Sysctls(Vec<(&'static str, String)>);

impl Sysctls {
    const FILES: [&'static str; 2] = [
        "/proc/sys/vm/compact_unevictable_allowed",
        "/proc/sys/vm/compaction_proactiveness",
    ];

    fn save() -> anyhow::Result<Self> {
        Ok(Self(
            Self::FILES
                .iter()
                .map(|f| Ok((*f, std::fs::read_to_string(f)?.trim().to_string())))
                .collect::<anyhow::Result<_>>()?,
        ))
    }

    fn set(&self, unevictable: u32, proactiveness: u32) -> anyhow::Result<()> {
        std::fs::write(Self::FILES[0], unevictable.to_string())?;
        std::fs::write(Self::FILES[1], proactiveness.to_string())?;
        Ok(())
    }
}

impl Drop for Sysctls {
    fn drop(&mut self) {
        for (f, v) in &self.0 {
            let _ = std::fs::write(f, v);
        }
    }
}

/// `slotprof host`'s own cost while compaction moves a KVM guest's locked
/// memory at full speed (the guest of the host-mode tests).
fn host_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let mut md = format!("{HOST_HEADING}\n\n");
    let available_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / (1 << 20) as f64);
    if !Path::new("/dev/kvm").exists() || available_gib < 20.0 {
        let _ = writeln!(
            md,
            "Not measured: needs /dev/kvm and ~20 GiB free ({available_gib:.1} GiB available).\n"
        );
        return Ok(md);
    }
    let sysctls = Sysctls::save()?;
    sysctls.set(0, 0)?;
    let mut guest = Command::new(bin(root, "stall-kvm-guest"))
        .args(["--mem-mib", "1024", "--duration", "300"])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let result = (|| -> anyhow::Result<Value> {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(guest.stdout.take().context("guest stdout")?).lines();
        let ready = lines.next().context("the guest exited")??;
        anyhow::ensure!(ready == "ready", "unexpected guest output {ready:?}");
        sysctls.set(1, 0)?;
        let out = scratch.join("host");
        let mut host = Command::new(bin(root, "slotprof"))
            .args(["host", "--duration", "15s", "--probe-stats", "--vm-pid"])
            .arg(guest.id().to_string())
            .arg("-o")
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .spawn()?;
        std::thread::sleep(std::time::Duration::from_secs(3));
        std::fs::write("/proc/sys/vm/compact_memory", "1")?;
        anyhow::ensure!(host.wait()?.success(), "slotprof host failed");
        Ok(serde_json::from_str(&std::fs::read_to_string(
            out.join("summary.json"),
        )?)?)
    })();
    let _ = guest.kill();
    let _ = guest.wait();
    drop(sysctls);
    let summary = result?;
    let t = &summary["totals"];
    let _ = writeln!(
        md,
        "`slotprof host --probe-stats` for 15 s while `compact_memory` migrates a 1 GiB mlocked KVM guest \
         (tests/src/bin/stall-kvm-guest.rs, placed as in the host tests, vm.compact_unevictable_allowed=1): \
         {} invalidations, {} host events, {} lost. Stacks are walked at most once per 10 ms per thread and \
         tracepoint, so a run that reuses one costs far less than a walk.\n",
        t["invalidations"], t["events"], summary["lost"]["total"]
    );
    md.push_str(&program_table(&summary));
    let _ = writeln!(
        md,
        "\nThe host probes used {:.3}% of the machine's CPU over the session.\n",
        summary["probe_cost"]["cpu_percent"].as_f64().unwrap_or(0.0)
    );
    Ok(md)
}

/// The per-program cost table of a summary's `probe_cost`, costliest first;
/// programs that never ran are left out.
fn program_table(summary: &Value) -> String {
    let mut md = String::from("| program | runs | avg ns/run | total ms |\n|---|---|---|---|\n");
    let mut programs: Vec<&Value> = summary["probe_cost"]["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    programs.sort_by_key(|p| std::cmp::Reverse(p["total_ns"].as_u64().unwrap_or(0)));
    for p in programs
        .into_iter()
        .filter(|p| p["runs"].as_u64().unwrap_or(0) > 0)
    {
        let _ = writeln!(
            md,
            "| {} | {} | {:.0} | {:.1} |",
            p["program"].as_str().unwrap_or(""),
            p["runs"],
            p["avg_ns"].as_f64().unwrap_or(0.0),
            p["total_ns"].as_f64().unwrap_or(0.0) / 1e6
        );
    }
    md
}

/// `VmRSS` of a process, in bytes.
fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// How long the always-on section runs (`--run-minutes`, default 10).
static RUN_MINUTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(10);

/// `slotprof run` for `--run-minutes` against the synthetic validator (its
/// RPC fixture, a lock stall every 5th slot): resident memory after 1 minute
/// and at the end, slotprof's CPU.
fn run_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let minutes = RUN_MINUTES.load(std::sync::atomic::Ordering::Relaxed);
    let m = measure_run(root, scratch, minutes)?;
    Ok(run_markdown(&m, minutes))
}

/// What `slotprof run` did over the always-on run: RSS every 10 s (s,
/// bytes), its CPU seconds, the run's length and its last /metrics.
struct RunMeasure {
    samples: Vec<(f64, u64)>,
    cpu: f64,
    wall: f64,
    scrape: String,
}

/// Runs `slotprof run` against the synthetic validator for `minutes`.
fn measure_run(root: &Path, scratch: &Path, minutes: u64) -> anyhow::Result<RunMeasure> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let metrics = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let export = scratch.join("run-export");
    let config = scratch.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[target]\ncomm = \"synthetic-validator\"\n[slots]\nsource = \"rpc=http://127.0.0.1:{port}\"\n\
             [export]\ndir = \"{}\"\nretention_bytes = \"200MiB\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n",
            export.display()
        ),
    )?;
    let slots = (minutes * 60 * 1000 / 400 + 20).to_string();
    let mut validator = Command::new(bin(root, "synthetic-validator"))
        .args([
            "--rpc-port",
            &port.to_string(),
            "--first-slot",
            "345600000",
            "--slots",
            &slots,
        ])
        .args([
            "--lock-stall-every",
            "5",
            "--report",
            scratch.join("sv.json").to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let mut daemon = Command::new(bin(root, "slotprof"))
        .args(["run", "--config", config.to_str().unwrap()])
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let pid = daemon.id();
    let started = std::time::Instant::now();
    let mut samples: Vec<(f64, u64)> = Vec::new();
    while started.elapsed() < std::time::Duration::from_secs(minutes * 60) {
        std::thread::sleep(std::time::Duration::from_secs(10));
        if let Some(r) = rss(pid) {
            samples.push((started.elapsed().as_secs_f64(), r));
            eprintln!(
                "xtask: bench run {:>4.0} s  RSS {:.1} MiB",
                started.elapsed().as_secs_f64(),
                r as f64 / 1048576.0
            );
        }
    }
    let cpu = cpu_seconds(pid).unwrap_or(0.0);
    let wall = started.elapsed().as_secs_f64();
    let scrape = (|| -> std::io::Result<String> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", metrics))?;
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut r = String::new();
        c.read_to_string(&mut r)?;
        Ok(r)
    })()
    .unwrap_or_default();
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = daemon.wait();
    let _ = validator.kill();
    let _ = validator.wait();
    Ok(RunMeasure {
        samples,
        cpu,
        wall,
        scrape,
    })
}

/// The always-on section of BENCHMARKS.md from a run's measure.
fn run_markdown(m: &RunMeasure, minutes: u64) -> String {
    let RunMeasure {
        samples,
        cpu,
        wall,
        scrape,
    } = m;
    let (cpu, wall) = (*cpu, *wall);
    let at = |t: f64| {
        samples
            .iter()
            .min_by(|a, b| (a.0 - t).abs().total_cmp(&(b.0 - t).abs()))
            .map_or(0, |s| s.1)
    };
    let (one, ten) = (at(60.0), at(wall));
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let metric = |name: &str| -> String {
        scrape
            .lines()
            .filter(|l| l.starts_with(name))
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join("; ")
    };
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut md = String::new();
    let _ = writeln!(md, "{RUN_HEADING}\n");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = writeln!(md, "`slotprof run` with the sample configuration's defaults (49 Hz, off-CPU and detector probes, the phase probe on every CPU, export of slots with findings and leader slots, hourly profiles) against `synthetic-validator` over its RPC fixture for {minutes} minutes (a lock stall every 5th slot, so every 5th slot has a finding).\n");
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| RSS after 1 min | {:.1} MiB |", mib(one));
    let _ = writeln!(
        md,
        "| RSS after {minutes} min | {:.1} MiB ({:+.1}%) |",
        mib(ten),
        100.0 * (ten as f64 / one.max(1) as f64 - 1.0)
    );
    let _ = writeln!(md, "| peak RSS sampled | {:.1} MiB |", mib(peak));
    let _ = writeln!(
        md,
        "| slotprof CPU | {cpu:.1} s in {wall:.0} s ({:.2}% of one CPU; the phase probe's bursts, slotprof's own threads, are {:.0}% of one CPU of that by construction: 1 ms every 100 ms on each of {cpus} CPUs) |",
        100.0 * cpu / wall,
        cpus as f64
    );
    let _ = writeln!(md, "| slots | {} |", metric("slotprof_slots_exported_total"));
    let _ = writeln!(
        md,
        "| slots not exported | {}; {} |",
        metric("slotprof_slots_not_exported_total"),
        metric("slotprof_export_write_errors_total")
    );
    let _ = writeln!(md, "| findings | {} |", metric("slotprof_findings_total"));
    let _ = writeln!(md, "| lost | {} |", metric("slotprof_lost_events_total"));
    let quarter = wall * 0.75;
    let _ = writeln!(
        md,
        "\nOver the last quarter of the run ({quarter:.0} s to {wall:.0} s) RSS went from {:.1} to {:.1} MiB.",
        mib(at(quarter)),
        mib(ten)
    );
    let findings: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("slotprof_findings_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    if findings > 0.0 {
        let full_s = 1000.0 * wall / findings;
        let _ = write!(
            md,
            "The run keeps the latest 1,000 findings in memory (findings.json and the index); at this run's rate ({findings:.0} in {wall:.0} s) that list {} after about {:.0} minutes",
            if full_s <= wall { "was full" } else { "would be full" },
            full_s / 60.0
        );
        let _ = if full_s <= wall {
            writeln!(
                md,
                "; from then to the end RSS went from {:.1} to {:.1} MiB.",
                mib(at(full_s)),
                mib(ten)
            )
        } else {
            writeln!(md, ".")
        };
    }
    let series: Vec<String> = samples
        .iter()
        .step_by(6 * (minutes as usize / 10).max(1))
        .map(|(t, r)| format!("{:.0} s {:.1}", t, mib(*r)))
        .collect();
    let _ = writeln!(
        md,
        "\nRSS every {} (MiB): {}.\n",
        match minutes / 10 {
            0 | 1 => "minute".to_string(),
            n => format!("{n} minutes"),
        },
        series.join(", ")
    );
    md
}

/// CPU time (user + system) of this process's waited-for children so far.
fn children_cpu_s() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a zeroed rusage for the kernel to fill.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// perf, installed (linux-perf) when missing; None if that fails.
fn perf_binary(root: &Path) -> Option<PathBuf> {
    let find = || {
        ["/usr/bin/perf", "/usr/local/bin/perf"]
            .iter()
            .map(Path::new)
            .find(|p| p.is_file())
            .map(Path::to_path_buf)
    };
    if find().is_none() {
        let env = [("DEBIAN_FRONTEND", "noninteractive")];
        if let Err(e) = crate::run_env(root, "apt-get", &["update", "-qq"], &env)
            .and_then(|_| crate::run_env(root, "apt-get", &["install", "-y", "-qq", "linux-perf"], &env))
        {
            eprintln!("xtask: could not install linux-perf ({e:#}): the perf rows are left out");
        }
    }
    find()
}

/// CLOCK_MONOTONIC now, in ns (the clock of poh-loop's series).
fn monotonic_ns() -> u64 {
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel fills the timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until CLOCK_MONOTONIC reaches `t_ns`.
fn sleep_until(t_ns: u64) {
    let now = monotonic_ns();
    if t_ns > now {
        std::thread::sleep(std::time::Duration::from_nanos(t_ns - now));
    }
}

/// Hashes per second between `from` and `to` (CLOCK_MONOTONIC ns) in a
/// poh-loop series of (time, hashes so far), linear between its points.
fn rate_between(series: &[(u64, u64)], from: u64, to: u64) -> Option<f64> {
    let at = |t: u64| -> Option<f64> {
        let i = series.windows(2).position(|w| w[0].0 <= t && t <= w[1].0)?;
        let ((t0, n0), (t1, n1)) = (series[i], series[i + 1]);
        let f = if t1 > t0 {
            (t - t0) as f64 / (t1 - t0) as f64
        } else {
            0.0
        };
        Some(n0 as f64 + f * (n1 as f64 - n0 as f64))
    };
    Some((at(to)? - at(from)?) / ((to - from) as f64 / 1e9))
}

/// What a profiler costs a CPU-bound PoH loop while it is attached:
/// nothing, `slotprof attach` (all probes, 99 Hz), `perf record --call-graph dwarf -F 99` (both take whole user stacks of a binary without frame pointers).
fn overhead_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    /// How long each tool is attached; the loop runs 2.5 s longer.
    const ATTACH_S: u64 = 20;
    /// The steady-state window starts this long after the tool is started
    /// (past loading, verifying and attaching) and ends when its attach
    /// time would end, before it detaches and writes its outputs.
    const SETTLE_S: u64 = 2;
    let perf = perf_binary(root);
    let mut variants = vec!["alone", "slotprof attach -F 99 (all probes)"];
    if perf.is_some() {
        variants.push("perf record --call-graph dwarf -F 99 -p PID");
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let report = scratch.join("poh-attach.json");
    let poh = bin(root, "poh-loop");
    let n = variants.len();
    let (mut steady, mut whole) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let (mut steady_cpu, mut whole_cpu) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for round in 0..ROUNDS {
        for (i, name) in variants.iter().enumerate() {
            let mut target = Command::new(&poh)
                .args(["--seconds", &format!("{}.5", ATTACH_S + 2), "--report"])
                .arg(&report)
                .spawn()?;
            std::thread::sleep(std::time::Duration::from_millis(500));
            let pid = target.id().to_string();
            let before = children_cpu_s();
            let started = monotonic_ns();
            let duration = format!("{ATTACH_S}");
            let tool = match i {
                0 => None,
                1 => Some(
                    Command::new(bin(root, "slotprof"))
                        .args(["attach", "-p", &pid, "-d", &format!("{duration}s"), "--out"])
                        .arg(scratch.join("attach-out"))
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .spawn()?,
                ),
                _ => Some(
                    Command::new(perf.as_ref().unwrap())
                        .args(["record", "--call-graph", "dwarf", "-F", "99", "-p", &pid, "-o"])
                        .arg(scratch.join("perf.data"))
                        .args(["--", "sleep", &duration])
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .spawn()?,
                ),
            };
            let (from, to) = (
                started + SETTLE_S * 1_000_000_000,
                started + ATTACH_S * 1_000_000_000,
            );
            sleep_until(from);
            let cpu_from = tool.as_ref().and_then(|t| cpu_seconds(t.id()));
            sleep_until(to);
            let cpu_to = tool.as_ref().and_then(|t| cpu_seconds(t.id()));
            let window_cpu = match (cpu_from, cpu_to) {
                (Some(a), Some(b)) => b - a,
                _ => 0.0,
            };
            if let Some(mut t) = tool {
                let st = t.wait()?;
                if !st.success() {
                    bail!("{name} failed ({st})");
                }
                whole_cpu[i].push(children_cpu_s() - before);
            } else {
                whole_cpu[i].push(0.0);
            }
            target.wait()?;
            let r: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
            let series: Vec<(u64, u64)> = r["series"]
                .as_array()
                .context("poh report: no series")?
                .iter()
                .filter_map(|p| Some((p[0].as_u64()?, p[1].as_u64()?)))
                .collect();
            let rate = rate_between(&series, from, to).context("poh series does not cover the window")?;
            let window_s = (to - from) as f64 / 1e9;
            steady_cpu[i].push(100.0 * window_cpu / (window_s * cpus));
            whole[i].push(r["hashes_per_s"].as_f64().context("poh report")?);
            eprintln!(
                "xtask: bench round {} {name:<40} {:>6.2} M hashes/s attached ({:.2} whole run), tool CPU {:.2} s in the window, {:.2} s in all",
                round + 1,
                rate / 1e6,
                whole[i].last().unwrap() / 1e6,
                window_cpu,
                whole_cpu[i].last().unwrap()
            );
            steady[i].push(rate);
        }
    }
    let med_steady: Vec<f64> = steady.iter().map(|r| median(r.clone())).collect();
    let med_whole: Vec<f64> = whole.iter().map(|r| median(r.clone())).collect();
    let mut md = String::new();
    let _ = writeln!(md, "{OVERHEAD_HEADING}\n");
    let _ = writeln!(
        md,
        "`poh-loop` (one sha256 chain per CPU, on both CPUs: any CPU a tool uses is taken from it) runs {}.5 s; 0.5 s in, a profiler is started for {ATTACH_S} s. **While attached** is the loop's rate from {SETTLE_S} s after the tool was started (past loading, verifying and attaching its programs) to {ATTACH_S} s after (before it detaches and writes its outputs), from the loop's own series (its hash count every 100 ms); the tool's CPU in that window (utime + stime from /proc, counted in 10 ms ticks: 0.00% is under a tick) is given as a share of the machine's {cpus} CPUs. **Whole run** is the loop's rate over all its time and the tool's CPU from start to exit (wait4): slotprof's includes loading its programs and, at the end, symbolizing and writing its outputs while the loop still runs; perf's post-processing (`perf report`) is not run. Medians of {ROUNDS} interleaved rounds. On this VM throughput alone hardly resolves 1% (see ../shared/notes/benchmarking.md); the probes' kernel-side cost is in the futex-storm section's per-program table.\n",
        ATTACH_S + 2
    );
    let _ = writeln!(
        md,
        "| variant | while attached: M hashes/s (median) | ratio to alone | tool CPU (% of the machine) | whole run: ratio to alone | tool CPU | while attached, all rounds |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for (i, name) in variants.iter().enumerate() {
        let all: Vec<String> = steady[i].iter().map(|r| format!("{:.2}", r / 1e6)).collect();
        let _ = writeln!(
            md,
            "| {name} | {:.2} | **{:.3}** | {:.2}% | {:.3} | {:.2} s | {} |",
            med_steady[i] / 1e6,
            med_steady[i] / med_steady[0],
            median(steady_cpu[i].clone()),
            med_whole[i] / med_whole[0],
            median(whole_cpu[i].clone()),
            all.join(", ")
        );
    }
    if perf.is_none() {
        let _ = writeln!(
            md,
            "\nperf is not installed here (`apt-get install linux-perf`): its row is missing."
        );
    }
    md.push('\n');
    md.push_str(&attach_memory(root, scratch)?);
    Ok(md)
}

/// Peak RSS of a 60 s `slotprof attach` (all probes, 99 Hz) to the
/// synthetic validator (its bank loop, lock stalls, RPC and worker threads).
fn attach_memory(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    const SECONDS: u64 = 60;
    let mut validator = Command::new(bin(root, "synthetic-validator"))
        .args(["--slots", &((SECONDS + 10) * 1000 / 400).to_string()])
        .args(["--lock-stall-every", "5"])
        .stdout(std::process::Stdio::null())
        .spawn()?;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let out = scratch.join("attach-60s");
    let tool = Command::new(bin(root, "slotprof"))
        .args([
            "attach",
            "-p",
            &validator.id().to_string(),
            "-d",
            &format!("{SECONDS}s"),
            "--out",
        ])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    // wait4 gives the child's peak RSS (ru_maxrss, KiB) with its status.
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child; the kernel fills status and usage.
    let r = unsafe { libc::wait4(tool.id() as i32, &mut status, 0, &mut usage) };
    let _ = validator.kill();
    let _ = validator.wait();
    if r < 0 || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("slotprof attach for {SECONDS} s failed (wait4 {r}, status {status:#x})");
    }
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json"))?)?;
    let peak_mib = usage.ru_maxrss as f64 / 1024.0;
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let cpu_s = secs(usage.ru_utime) + secs(usage.ru_stime);
    eprintln!("xtask: bench attach {SECONDS} s: peak RSS {peak_mib:.1} MiB");
    Ok(format!(
        "Memory of an attach session: `slotprof attach -p PID -d {SECONDS}s` (all probes, 99 Hz) to `synthetic-validator --lock-stall-every 5` (its own clock; bank loop, lock stalls, RPC and worker threads): peak RSS {peak_mib:.1} MiB (ru_maxrss from wait4; target <= 64 MiB); its own CPU {cpu_s:.2} s in {SECONDS} s ({:.2}% of one CPU, start-up, symbolization and outputs included); {} samples, {} off-CPU intervals, {} lost. An attach session keeps its events in memory until it ends; `slotprof run` (below) does not.\n\n",
        100.0 * cpu_s / SECONDS as f64,
        summary["counts"]["oncpu_samples"],
        summary["counts"]["offcpu_intervals"],
        summary["lost"]["total"]
    ))
}

/// `cargo bench -p PACKAGE --bench NAME -- ARGS`: its last stdout line, as JSON.
fn cargo_bench(root: &Path, package: &str, name: &str, args: &[&str]) -> anyhow::Result<Value> {
    let out = Command::new("cargo")
        .args(["bench", "-q", "-p", package, "--bench", name, "--"])
        .args(args)
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("cargo bench -p {package} --bench {name} failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON from the bench")?;
    Ok(serde_json::from_str(line)?)
}

/// The aggregator on a recorded stream (no kernel), and the symbolizer.
fn userspace_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    // A dense stream: every switch of the futex storm (no minimum), 999 Hz.
    let stream = scratch.join("storm.events");
    let status = Command::new(bin(root, "slotprof"))
        .args(["record", "-F", "999", "--min-offcpu", "0ms", "--out"])
        .arg(scratch.join("stream-out"))
        .arg("--save-events")
        .arg(&stream)
        .arg("--")
        .arg(bin(root, "futex-storm"))
        .args(["--seconds", "3"])
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("recording the event stream failed ({status})");
    }
    let agg = cargo_bench(root, "profiler", "aggregate", &[stream.to_str().unwrap()])?;
    let sym = cargo_bench(root, "symbolizer", "symbolize", &["2000"])?;
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let mut md = String::new();
    let _ = writeln!(md, "{USERSPACE_HEADING}\n");
    let _ = writeln!(md, "The aggregator on a recorded stream: `slotprof record -F 999 --min-offcpu 0ms --save-events FILE -- futex-storm --seconds 3` (every context switch of the storm, {} events), replayed by `cargo bench -p profiler --bench aggregate -- FILE` (profiler/benches/aggregate.rs): decoding and ingestion, then slot bucketing (400 ms slots, off-CPU intervals split at boundaries) and the detectors; stacks are not symbolized there (below). Median of 7 passes.\n", agg["events"]);
    let _ = writeln!(md, "| stage | time | events/s |\n|---|---|---|");
    let n = f(&agg, "events");
    let _ = writeln!(
        md,
        "| decode + ingest | {:.1} ms | {:.1} M |",
        1e3 * f(&agg, "ingest_s"),
        n / f(&agg, "ingest_s") / 1e6
    );
    let _ = writeln!(
        md,
        "| slot bucketing ({} slots) | {:.1} ms | |",
        agg["slots"],
        1e3 * f(&agg, "bucket_s")
    );
    let _ = writeln!(md, "| detectors | {:.1} ms | |", 1e3 * f(&agg, "detect_s"));
    let _ = writeln!(
        md,
        "| all | {:.1} ms | **{:.1} M** (target >= 2 M) |\n",
        1e3 * (f(&agg, "ingest_s") + f(&agg, "bucket_s") + f(&agg, "detect_s")),
        f(&agg, "events_per_s") / 1e6
    );
    let _ = writeln!(md, "Symbolization (`cargo bench -p symbolizer --bench symbolize`, symbolizer/benches/symbolize.rs) of {} unique function addresses in a Rust binary with debug info (inlined frames resolved) and {} kernel text addresses: cold is a new symbolizer (parsing the ELF/DWARF or kallsyms on the way), warm is {} other addresses once parsed, cached is the same addresses again.\n", sym["user_addresses"], sym["kernel_addresses"], sym["user_addresses"]);
    let _ = writeln!(md, "| | cold | warm | cached |\n|---|---|---|---|");
    let per = |k: &str, count: &str| 1e6 * f(&sym, k) / f(&sym, count).max(1.0);
    let _ = writeln!(
        md,
        "| user ({} named of {}) | {:.0} ms ({:.1} us each) | {:.0} ms ({:.1} us) | {:.2} ms ({:.2} us) |",
        sym["user_named"],
        sym["user_addresses"],
        1e3 * f(&sym, "user_cold_s"),
        per("user_cold_s", "user_addresses"),
        1e3 * f(&sym, "user_warm_s"),
        per("user_warm_s", "user_addresses"),
        1e3 * f(&sym, "user_cached_s"),
        per("user_cached_s", "user_addresses")
    );
    let _ = writeln!(
        md,
        "| kernel | {:.0} ms ({:.1} us each) | {:.0} ms ({:.1} us) | {:.2} ms ({:.2} us) |\n",
        1e3 * f(&sym, "kernel_cold_s"),
        per("kernel_cold_s", "kernel_addresses"),
        1e3 * f(&sym, "kernel_warm_s"),
        per("kernel_warm_s", "kernel_addresses"),
        1e3 * f(&sym, "kernel_cached_s"),
        per("kernel_cached_s", "kernel_addresses")
    );
    Ok(md)
}

/// The real node (`cargo xtask validator`) under a real client's load:
/// slots a second alone, under `slotprof attach` and under perf's DWARF
/// call graphs (interleaved rounds), each BPF program's cost at this
/// node's switch rate, then `slotprof run` following it for
/// `--run-minutes`. Measured by tests/src/bin/validator-bench.rs; without
/// the node's binary the section says why and what to do.
fn validator_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let mut md = format!("{VALIDATOR_HEADING}\n\n");
    let node = match crate::validator::binary(root) {
        Ok(b) => b,
        Err(e) => {
            let _ = writeln!(md, "Not measured: {e:#}.\n");
            return Ok(md);
        }
    };
    let load = crate::validator::loadgen(root)?;
    let perf = perf_binary(root);
    let minutes = RUN_MINUTES.load(std::sync::atomic::Ordering::Relaxed).to_string();
    let mut cmd = Command::new(bin(root, "validator-bench"));
    cmd.arg("--slotprof")
        .arg(bin(root, "slotprof"))
        .args(["--run-minutes", &minutes, "--scratch"])
        .arg(scratch)
        .env("SLOTPROF_VALIDATOR", &node)
        .env("SLOTPROF_LOADGEN", &load)
        .stderr(std::process::Stdio::inherit());
    if let Some(p) = &perf {
        cmd.arg("--perf").arg(p);
    }
    let out = cmd
        .output()
        .context("cannot run target/release/validator-bench")?;
    if !out.status.success() {
        bail!("validator-bench failed (its messages are above)");
    }
    md.push_str(&String::from_utf8_lossy(&out.stdout));
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_storm_runs_under_every_tool_and_the_per_program_runs_are_all_probes() {
        for (through, pairs) in [("futex", 1), ("pipe", 1), ("futex", 2), ("pipe", 2)] {
            let tools: Vec<Tool> = VARIANTS
                .iter()
                .filter(|v| v.through == through && v.pairs == pairs)
                .map(|v| v.tool)
                .collect();
            for want in [
                Tool::Alone,
                Tool::Slotprof(&[]),
                Tool::PerfTrace,
                Tool::PerfSwitch,
            ] {
                assert!(
                    tools.contains(&want),
                    "{through}, {pairs} pair(s) lacks a variant"
                );
            }
        }
        for (i, pairs) in [(ALL_PROBES, 1), (ALL_PROBES_2, 2)] {
            let v = &VARIANTS[i];
            assert!(v.through == "futex" && v.pairs == pairs && v.tool == Tool::Slotprof(&[]));
        }
    }
}
