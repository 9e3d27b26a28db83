//! slotprof and perf on a CPU-bound PoH loop: throughput lost, and attach's memory.

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{bail, Context};
use serde_json::Value;

use super::*;

/// Sleeps until CLOCK_MONOTONIC reaches `t_ns`.
pub(super) fn sleep_until(t_ns: u64) {
    let now = monotonic_ns();
    if t_ns > now {
        std::thread::sleep(std::time::Duration::from_nanos(t_ns - now));
    }
}

/// Hashes per second between `from` and `to` (CLOCK_MONOTONIC ns) in a
/// poh-loop series of (time, hashes so far), linear between its points.
pub(super) fn rate_between(series: &[(u64, u64)], from: u64, to: u64) -> Option<f64> {
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
pub(super) fn overhead_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
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
        "`poh-loop` (one sha256 chain per CPU, on both CPUs: any CPU a tool uses is taken from it) runs {}.5 s; 0.5 s in, a profiler is started for {ATTACH_S} s. **While attached** is the loop's rate from {SETTLE_S} s after the tool was started (past loading, verifying and attaching its programs) to {ATTACH_S} s after (before it detaches and writes its outputs), from the loop's own series (its hash count every 100 ms); the tool's CPU in that window (utime + stime from /proc, counted in 10 ms ticks: 0.00% is under a tick) is given as a share of the machine's {cpus} CPUs. **Whole run** is the loop's rate over all its time and the tool's CPU from start to exit (wait4): slotprof's includes loading its programs and, at the end, symbolizing and writing its outputs while the loop still runs; perf's post-processing (`perf report`) is not run. Medians of {ROUNDS} interleaved rounds. On this VM throughput alone hardly resolves 1% (rounds of the same variant differ by about that much); the probes' kernel-side cost is in the futex-storm section's per-program table.\n",
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
pub(super) fn attach_memory(root: &Path, scratch: &Path) -> anyhow::Result<String> {
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
    // SAFETY: rusage is plain data: all zeros is a valid value.
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
