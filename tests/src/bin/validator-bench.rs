//! `validator-bench`: what slotprof costs the real node of `cargo xtask
//! validator`, beside perf, under a real client's load. Run by `sudo cargo
//! xtask bench --only validator`, which puts its output (a markdown
//! section) into BENCHMARKS.md.
//!
//! usage: SLOTPROF_VALIDATOR=BIN SLOTPROF_LOADGEN=BIN validator-bench
//!        --slotprof BIN [--perf BIN] [--rounds N] [--seconds S]
//!        [--run-minutes M] [--rate TX_PER_S] [--scratch DIR]
//!
//! 1. Interleaved rounds of `--seconds` each: the node alone, under
//!    `slotprof attach` (all probes, `--probe-stats`, RPC slot source; as
//!    shipped, and with `--offcpu exact`) and under `perf record
//!    --call-graph dwarf -F 99` (whole user stacks of a binary without
//!    frame pointers, like slotprof) followed by `perf report --stdio` on
//!    its data (where perf unwinds and symbolizes: the counterpart of
//!    slotprof's outputs). Per round: the node's slots a second (from its
//!    own RPC), its CPU; the tool's peak RSS (wait4) and CPU, each BPF
//!    program's run time, lost events, stacks.
//! 2. `slotprof run` for `--run-minutes`, phase probe off, following the
//!    node by name: RSS and CPU every 10 s. Twice: with the default
//!    export (every slot of this node is a leader slot, so every slot is
//!    exported in full) and with `export.full = "findings"`.
//!
//! The node and the load stop, and the ledger goes, on every exit path
//! (their Drop); every child is waited for.

use std::{
    fmt::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use slotprof_tests::validator::{binary, Load, Node};

struct Args {
    slotprof: PathBuf,
    perf: Option<PathBuf>,
    rounds: u32,
    seconds: u64,
    run_minutes: u64,
    rate: u32,
    scratch: PathBuf,
}

fn usage() -> ! {
    eprintln!(
        "usage: validator-bench --slotprof BIN [--perf BIN] [--rounds N] [--seconds S] [--run-minutes M] \
         [--rate TX_PER_S] [--scratch DIR]"
    );
    std::process::exit(2)
}

fn args() -> Args {
    let mut a = Args {
        slotprof: PathBuf::new(),
        perf: None,
        rounds: 3,
        seconds: 60,
        run_minutes: 10,
        rate: 100,
        scratch: std::env::temp_dir(),
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut it = v.chunks(2);
    for pair in &mut it {
        let [k, val] = pair else { usage() };
        let num = |what: &str| -> u64 {
            val.parse().unwrap_or_else(|_| {
                eprintln!("validator-bench: {what} wants a whole number, not {val:?}");
                usage()
            })
        };
        match k.as_str() {
            "--slotprof" => a.slotprof = val.into(),
            "--perf" => a.perf = Some(val.into()),
            "--rounds" => a.rounds = num("--rounds").max(1) as u32,
            "--seconds" => a.seconds = num("--seconds").max(10),
            "--run-minutes" => a.run_minutes = num("--run-minutes"),
            "--rate" => a.rate = num("--rate").max(1) as u32,
            "--scratch" => a.scratch = val.into(),
            _ => usage(),
        }
    }
    if a.slotprof.as_os_str().is_empty() {
        usage()
    }
    a
}

/// utime + stime of a process, seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat.rsplit_once(") ")?.1.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

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

/// A child run to its end: success, peak RSS (bytes) and CPU seconds, from
/// wait4's rusage.
fn run_measured(cmd: &mut Command) -> std::io::Result<(bool, u64, f64)> {
    // Reaped by wait4 below (for its rusage), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = cmd.spawn()?;
    let mut status = 0;
    // SAFETY: a zeroed rusage for the kernel to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    if pid != child.id() as i32 {
        return Err(std::io::Error::last_os_error());
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    Ok((
        ok,
        usage.ru_maxrss as u64 * 1024,
        t(usage.ru_utime) + t(usage.ru_stime),
    ))
}

#[derive(Default)]
struct Round {
    variant: &'static str,
    slots_per_s: f64,
    node_cores: f64,
    tool_rss: u64,
    tool_cpu_s: f64,
    /// Of `tool_cpu_s`, what came after the recording (`perf report`).
    tool_post_cpu_s: f64,
    summary: Option<Value>,
}

const VARIANTS: [&str; 4] = [
    "alone",
    "slotprof attach",
    "slotprof attach --offcpu exact",
    "perf record --call-graph dwarf",
];

fn one_round(a: &Args, node: &Node, variant: &'static str, i: usize) -> Result<Round, String> {
    let pid = node.pid();
    let s0 = node.slot()?;
    let t0 = Instant::now();
    let c0 = cpu_seconds(pid).ok_or("the node is gone")?;
    let mut r = Round {
        variant,
        ..Default::default()
    };
    let secs = a.seconds.to_string();
    match variant {
        "alone" => std::thread::sleep(Duration::from_secs(a.seconds)),
        "slotprof attach" | "slotprof attach --offcpu exact" => {
            let out = a.scratch.join(format!("attach-{i}"));
            let mode = if variant.ends_with("exact") {
                "exact"
            } else {
                "folded"
            };
            let (ok, peak, cpu) = run_measured(
                Command::new(&a.slotprof)
                    .args(["attach", "--pid", &pid.to_string(), "--duration"])
                    .arg(format!("{secs}s"))
                    .args(["--offcpu", mode, "--probe-stats", "--slot-source"])
                    .arg(format!("rpc={}", node.rpc_url()))
                    .arg("--out")
                    .arg(&out)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .map_err(|e| format!("slotprof: {e}"))?;
            if !ok {
                return Err(format!(
                    "slotprof attach failed; run it by hand: {} attach --pid {pid} --duration {secs}s",
                    a.slotprof.display()
                ));
            }
            r.tool_rss = peak;
            r.tool_cpu_s = cpu;
            r.summary = std::fs::read(out.join("summary.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let _ = std::fs::remove_dir_all(&out);
        }
        _ => {
            let Some(perf) = &a.perf else {
                return Err("no perf".into());
            };
            let data = a.scratch.join(format!("perf-{i}.data"));
            let (ok, peak, cpu) = run_measured(
                Command::new(perf)
                    .args([
                        "record",
                        "--call-graph",
                        "dwarf",
                        "-F",
                        "99",
                        "-p",
                        &pid.to_string(),
                        "-o",
                    ])
                    .arg(&data)
                    .args(["--", "sleep", &secs])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .map_err(|e| format!("perf: {e}"))?;
            if !ok {
                let _ = std::fs::remove_file(&data);
                return Err("perf record failed".into());
            }
            // Where perf unwinds and names the stacks it copied: what
            // slotprof does while it records and at its end.
            let (report_ok, report_peak, report_cpu) = run_measured(
                Command::new(perf)
                    .args(["report", "--stdio", "-i"])
                    .arg(&data)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .map_err(|e| format!("perf report: {e}"))?;
            let _ = std::fs::remove_file(&data);
            if !report_ok {
                return Err("perf report failed".into());
            }
            r.tool_rss = peak.max(report_peak);
            r.tool_cpu_s = cpu + report_cpu;
            r.tool_post_cpu_s = report_cpu;
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let s1 = node.slot()?;
    let c1 = cpu_seconds(pid).ok_or("the node is gone")?;
    r.slots_per_s = (s1 - s0) as f64 / wall;
    r.node_cores = (c1 - c0) / wall;
    eprintln!(
        "validator-bench: {variant:<32} {:.3} slots/s, node {:.2} cores, tool RSS {:.1} MiB, tool CPU {:.1} s",
        r.slots_per_s,
        r.node_cores,
        r.tool_rss as f64 / 1048576.0,
        r.tool_cpu_s
    );
    Ok(r)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// (seconds, RSS bytes, CPU seconds) samples, and the last /metrics.
type RunResult = (Vec<(f64, u64, f64)>, String);

/// `slotprof run` following the node by name, phase probe off, with
/// `export.full = FULL`: (seconds, RSS bytes, CPU seconds) every 10 s, and
/// /metrics at the end.
fn always_on(a: &Args, node: &Node, full: &str) -> Result<RunResult, String> {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let export = a.scratch.join("run-export");
    let config = a.scratch.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[target]\ncomm = \"solana-test-validator\"\n[slots]\nsource = \"rpc={}\"\n[export]\ndir = \"{}\"\nfull = \"{full}\"\n\
             retention_bytes = \"500MiB\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n[phase_probe]\nenabled = false\n",
            node.rpc_url(),
            export.display()
        ),
    )
    .map_err(|e| e.to_string())?;
    let mut daemon = Command::new(&a.slotprof)
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("slotprof run: {e}"))?;
    let pid = daemon.id();
    let started = Instant::now();
    let mut samples = Vec::new();
    while started.elapsed() < Duration::from_secs(a.run_minutes * 60) {
        std::thread::sleep(Duration::from_secs(10));
        if let Ok(Some(_)) = daemon.try_wait() {
            return Err("slotprof run exited early".into());
        }
        if let (Some(r), Some(c)) = (rss(pid), cpu_seconds(pid)) {
            samples.push((started.elapsed().as_secs_f64(), r, c));
            eprintln!(
                "validator-bench: run (export.full = {full}) {:>5.0} s  RSS {:.1} MiB  CPU {:.1} s",
                started.elapsed().as_secs_f64(),
                r as f64 / 1048576.0,
                c
            );
        }
    }
    let scrape = (|| -> std::io::Result<String> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", metrics))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut r = String::new();
        c.read_to_string(&mut r)?;
        Ok(r)
    })()
    .unwrap_or_default();
    // SAFETY: our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = daemon.wait();
    let _ = std::fs::remove_dir_all(&export);
    let exported: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("slotprof_slots_exported_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    if exported == 0.0 {
        return Err(format!(
            "slotprof run exported no slot in {} minutes (did it find the node? run `{} run --config {}` by hand)",
            a.run_minutes,
            a.slotprof.display(),
            config.display()
        ));
    }
    Ok((samples, scrape))
}

/// The node's process group and the load's pid, for the signal handler.
static NODE_PGID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static LOAD_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// SIGINT/SIGTERM/SIGHUP: the node (its own process group, so the signal
/// did not reach it) and the load are killed before the bench goes; only
/// async-signal-safe calls here. The ledger directory stays (its path was
/// printed when the node started).
extern "C" fn on_signal(sig: libc::c_int) {
    use std::sync::atomic::Ordering::SeqCst;
    // SAFETY: kill and _exit are async-signal-safe.
    unsafe {
        let pgid = NODE_PGID.load(SeqCst);
        if pgid > 0 {
            libc::kill(-pgid, libc::SIGKILL);
        }
        let load = LOAD_PID.load(SeqCst);
        if load > 0 {
            libc::kill(load, libc::SIGKILL);
        }
        libc::_exit(128 + sig);
    }
}

fn main() {
    let a = args();
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: installs a handler that only calls async-signal-safe functions.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    match bench(&a) {
        Ok(md) => print!("{md}"),
        Err(e) => {
            eprintln!("validator-bench: {e}");
            std::process::exit(1)
        }
    }
}

/// The whole bench; the node and the load stop when this returns, on
/// every path (their Drop).
fn bench(a: &Args) -> Result<String, String> {
    let bin = binary()?;
    let node = Node::start(&bin, 3, Duration::from_secs(180))?;
    NODE_PGID.store(node.pid() as i32, std::sync::atomic::Ordering::SeqCst);
    eprintln!(
        "validator-bench: node pid {}, ledger {}",
        node.pid(),
        node.dir.display()
    );
    let load = Load::start(&node, a.rate, u32::MAX, &node.dir.join("load.json"))?;
    LOAD_PID.store(load.pid() as i32, std::sync::atomic::Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(15));
    let variants: Vec<&'static str> = VARIANTS
        .iter()
        .copied()
        .filter(|v| a.perf.is_some() || !v.starts_with("perf"))
        .collect();
    let mut rounds: Vec<Round> = Vec::new();
    for r in 0..a.rounds as usize {
        // A different order each round: the node's own drift spreads over
        // every variant.
        for k in 0..variants.len() {
            let v = variants[(k + r) % variants.len()];
            rounds.push(one_round(a, &node, v, rounds.len()).map_err(|e| format!("{v}: {e}"))?);
        }
    }
    // Every slot of this one-node cluster is a leader slot, so the
    // default export (leader slots and slots with findings) writes every
    // slot in full; a mainnet validator leads a few percent of slots, and
    // `findings` is the nearest this node comes to that rate.
    let mut runs = Vec::new();
    if a.run_minutes > 0 {
        for full in ["findings-and-leader", "findings"] {
            runs.push((full, always_on(a, &node, full)?));
        }
    }
    let report = load.stop()?;
    Ok(markdown(a, &rounds, &runs, &report.json))
}

fn markdown(a: &Args, rounds: &[Round], runs: &[(&str, RunResult)], load: &Value) -> String {
    let mib = |b: u64| b as f64 / 1048576.0;
    let of = |v: &str| -> Vec<&Round> { rounds.iter().filter(|r| r.variant == v).collect() };
    let alone = median(of("alone").iter().map(|r| r.slots_per_s).collect());
    let mut md = String::new();
    let _ = writeln!(
        md,
        "The real node of `cargo xtask validator` (solana-test-validator 4.4.0, a one-node cluster leading every slot) under a real client's load ({} transactions a second from tests/loadgen: transfers, Memo, SPL Token; {} sent, {} confirmed over the whole bench). {} interleaved rounds of {} s per variant; medians. Slots a second from the node's own RPC over each round (slotprof's set-up and tear-down included).\n",
        a.rate, load["sent"], load["confirmed"], a.rounds, a.seconds
    );
    let _ = writeln!(
        md,
        "| variant | node slots/s | of alone | node cores | tool peak RSS | tool CPU (% of one) |\n|---|---|---|---|---|---|"
    );
    for v in VARIANTS {
        let rs = of(v);
        if rs.is_empty() {
            continue;
        }
        let sps = median(rs.iter().map(|r| r.slots_per_s).collect());
        let cores = median(rs.iter().map(|r| r.node_cores).collect());
        let (rss, cpu) = if v == "alone" {
            ("".to_string(), "".to_string())
        } else {
            (
                format!(
                    "{:.1} MiB (max {:.1})",
                    mib(median(rs.iter().map(|r| r.tool_rss as f64).collect()) as u64),
                    mib(rs.iter().map(|r| r.tool_rss).max().unwrap_or(0))
                ),
                format!(
                    "{:.2}%",
                    median(
                        rs.iter()
                            .map(|r| 100.0 * r.tool_cpu_s / a.seconds as f64)
                            .collect()
                    )
                ),
            )
        };
        let _ = writeln!(
            md,
            "| {v} | {sps:.3} | {:.3} | {cores:.2} | {rss} | {cpu} |",
            sps / alone
        );
    }
    let perf_report = median(
        of("perf record --call-graph dwarf")
            .iter()
            .map(|r| 100.0 * r.tool_post_cpu_s / a.seconds as f64)
            .collect(),
    );
    let _ = writeln!(
        md,
        "\nperf writes the raw stack copies while recording and unwinds them at `perf report --stdio` time, counted in its CPU above ({perf_report:.2}% of it, of one CPU over the round); slotprof unwinds as it goes (its CPU includes that and the end-of-session symbolization and export). `--offcpu exact` sends every off-CPU interval with its own stack; the shipped default folds the short waits idle threads repeat (see docs/how-it-works.md)."
    );
    // The probes, from the last attach round's summary.
    if let Some(s) = of("slotprof attach")
        .iter()
        .rev()
        .find_map(|r| r.summary.as_ref())
    {
        let secs = s["duration_s"].as_f64().unwrap_or(1.0);
        let _ = writeln!(md, "\nEach BPF program on this node (the last attach round, {secs:.0} s; the kernel's accounting):\n");
        let _ = writeln!(
            md,
            "| program | runs/s | ns/run | % of one CPU |\n|---|---|---|---|"
        );
        for p in s["probe_cost"]["programs"].as_array().into_iter().flatten() {
            let runs = p["runs"].as_f64().unwrap_or(0.0);
            let total = p["total_ns"].as_f64().unwrap_or(0.0);
            if runs == 0.0 {
                continue;
            }
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.0} | {:.3} |",
                p["program"].as_str().unwrap_or("?"),
                runs / secs,
                total / runs,
                100.0 * total / (secs * 1e9)
            );
        }
        let u = &s["unwinding"];
        let stacks = u["stacks"].as_f64().unwrap_or(0.0);
        let lost_stacks = s["lost"]["stacks"].as_f64().unwrap_or(0.0);
        let _ = writeln!(
            md,
            "\nAll programs: {}% of the machine. Events lost: {} (stacks: {lost_stacks}, {:.3}% of the {stacks} user stacks unwound). \
             User stacks: {} complete, {} ended by the 32 KiB copy, {} with no unwind info. {} off-CPU intervals ({:.1} MiB of them in the temporary file); slotprof's peak RSS by its own count {:.1} MiB.",
            s["probe_cost"]["cpu_percent"],
            s["lost"]["total"],
            100.0 * lost_stacks / stacks.max(1.0),
            u["complete"],
            u["stack_copy_ended"],
            u["no_unwind_info"],
            s["counts"]["offcpu_intervals"],
            s["counts"]["offcpu_interval_file_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            s["counts"]["peak_rss_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        );
    }
    for (full, (samples, scrape)) in runs {
        let at = |t: f64| {
            samples
                .iter()
                .min_by(|x, y| (x.0 - t).abs().total_cmp(&(y.0 - t).abs()))
                .map_or((0.0, 0, 0.0), |s| *s)
        };
        let first = at(60.0);
        let last = samples.last().copied().unwrap_or_default();
        let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
        let cpu_pct = 100.0 * (last.2 - first.2) / (last.0 - first.0).max(1.0);
        let metric = |name: &str| -> String {
            scrape
                .lines()
                .filter(|l| l.starts_with(name))
                .collect::<Vec<_>>()
                .join("; ")
        };
        let what = if *full == "findings" {
            "`export.full = \"findings\"`: only slots with findings get flamegraphs, pprof and the trace; the others a line in slots.jsonl. The nearest this node comes to a mainnet validator, which leads a few percent of slots"
        } else {
            "the default `export.full = \"findings-and-leader\"`: full export of leader slots and slots with findings, so every slot here"
        };
        let _ = writeln!(
            md,
            "\n`slotprof run` following the node by name (`comm = \"solana-test-validator\"`, RPC slot source, 49 Hz, every probe) with {what}; phase probe off; {} minutes under the same load:\n",
            a.run_minutes
        );
        let _ = writeln!(md, "| | |\n|---|---|");
        let _ = writeln!(md, "| RSS after 1 min | {:.1} MiB |", mib(first.1));
        let _ = writeln!(md, "| RSS at the end | {:.1} MiB |", mib(last.1));
        let _ = writeln!(md, "| peak RSS sampled | {:.1} MiB |", mib(peak));
        let _ = writeln!(md, "| CPU from 1 min to the end | {cpu_pct:.2}% of one CPU |");
        let _ = writeln!(md, "| slots | {} |", metric("slotprof_slots_exported_total"));
        let _ = writeln!(
            md,
            "| slots not exported | {}; {} |",
            metric("slotprof_slots_not_exported_total"),
            metric("slotprof_export_write_errors_total")
        );
        let _ = writeln!(md, "| findings | {} |", metric("slotprof_findings_total"));
        let _ = writeln!(md, "| lost | {} |", metric("slotprof_lost_events_total"));
        let series: Vec<String> = samples
            .iter()
            .step_by(6)
            .map(|(t, r, _)| format!("{t:.0} s {:.1}", mib(*r)))
            .collect();
        let _ = writeln!(md, "\nRSS every minute (MiB): {}.", series.join(", "));
    }
    if !runs.is_empty() {
        let _ = writeln!(md, "\nThe phase probe, off here, costs its bursts by construction (1 ms every 100 ms on each CPU it runs on: 1% of each); see the always-on section above for it on.");
    }
    md.push('\n');
    md
}
