//! `slotprof run`'s memory and CPU over minutes on the synthetic validator.

use std::{fmt::Write as _, path::Path, process::Command};

use super::*;

/// How long the always-on section runs (`--run-minutes`, default 10).
pub(super) static RUN_MINUTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(10);

/// `slotprof run` for `--run-minutes` against the synthetic validator (its
/// RPC fixture, a lock stall every 5th slot): resident memory after 1 minute
/// and at the end, slotprof's CPU.
pub(super) fn run_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let minutes = RUN_MINUTES.load(std::sync::atomic::Ordering::Relaxed);
    let m = measure_run(root, scratch, minutes)?;
    Ok(run_markdown(&m, minutes))
}

/// What `slotprof run` did over the always-on run: RSS every 10 s (s,
/// bytes), its CPU seconds, the run's length and its last /metrics.
pub(super) struct RunMeasure {
    samples: Vec<(f64, u64)>,
    cpu: f64,
    wall: f64,
    scrape: String,
}

/// Runs `slotprof run` against the synthetic validator for `minutes`.
pub(super) fn measure_run(root: &Path, scratch: &Path, minutes: u64) -> anyhow::Result<RunMeasure> {
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
pub(super) fn run_markdown(m: &RunMeasure, minutes: u64) -> String {
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
