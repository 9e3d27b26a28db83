//! `cargo xtask bench`: overhead measurements, written to BENCHMARKS.md.
//!
//! The machine is a noisy 2-vCPU VM (the same variant's rounds differ by
//! about 1%), so every comparison interleaves its variants in rounds and reports
//! medians, and the probes' own cost comes from the kernel's accounting
//! (`--probe-stats`), not from wall-clock differences.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::bail;
use serde_json::Value;

use crate::benchmarks_md::{
    splice, stamped, HOST_HEADING, OVERHEAD_HEADING, PHASE_HEADING, RUN_HEADING, SOAK_HEADING, STORM_HEADING,
    USERSPACE_HEADING, VALIDATOR_HEADING,
};

mod always_on;
mod host;
mod overhead;
mod phase;
mod storm;
mod userspace;
mod validator;

use always_on::*;
use host::*;
use overhead::*;
use phase::*;
use storm::*;
use userspace::*;
use validator::*;

fn bin(root: &Path, name: &str) -> PathBuf {
    root.join("target/release").join(name)
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
    if let Some(i) = old.find(SOAK_HEADING) {
        let rest = &old[i..];
        let end = rest[3..].find("\n## ").map_or(rest.len(), |j| j + 4);
        md.push_str(&rest[..end]);
    }
    let _ = writeln!(
        md,
        "## Reproduce\n\n```sh\nsudo cargo xtask bench                  # rewrites this file (every section; the validator one alone takes ~35 min)\nsudo cargo xtask bench --only run       # one section: storm, overhead, userspace, phase, host, run (10 min) or validator (35 min)\nsudo cargo xtask bench --run-minutes 30 # the always-on runs (synthetic and real node) for longer\nsudo cargo xtask soak --minutes 60      # the fault soak (its own section)\n```\n"
    );
    let _ = writeln!(md, "Reference figures for perf and bpftrace on this machine kind (a pipe ping-pong storm, throughput against alone): bpftrace counting sched_switch 0.82, an offcputime-style bpftrace script 0.62, perf record -e sched:sched_switch -g 0.63.");
    std::fs::write(root.join("BENCHMARKS.md"), md)?;
    eprintln!("xtask: wrote BENCHMARKS.md");
    Ok(())
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

/// CPU time (user + system) of this process's waited-for children so far.
fn children_cpu_s() -> f64 {
    // SAFETY: rusage is plain data: all zeros is a valid value.
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
    // SAFETY: timespec is plain data: all zeros is a valid value.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel fills the timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
