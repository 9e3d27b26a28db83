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
//!    And `slotprof run` on the shipped configuration (`slotprof run
//!    --print-config`, pointed at this node; phase probe as shipped): once
//!    it has exported its first slot, the round measures the node, the
//!    daemon's CPU and all its BPF programs' run time (from its
//!    descriptors' fdinfo, `kernel.bpf_stats_enabled` on for the round and
//!    restored after).
//! 2. With perf: where `slotprof run`'s own CPU goes (perf record -g on
//!    the daemon, which keeps frame pointers; functions by self time).
//! 3. `slotprof run` for `--run-minutes` on the shipped configuration,
//!    following the node by name: RSS and CPU every 10 s. Twice: as
//!    shipped (every slot of this node is a leader slot, so every slot is
//!    exported in full) and with `export.full = "findings"`.
//!
//! The node and the load stop, and the ledger goes, on every exit path
//! (their Drop); every child is waited for.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
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

/// A `/proc/PID/status` memory field (`VmRSS:`, `VmHWM:`), bytes.
fn status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn rss(pid: u32) -> Option<u64> {
    status_bytes(pid, "VmRSS:")
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
    /// All the tool's BPF programs' run time over the round (`slotprof
    /// run`; an attach's is in its summary).
    bpf_ns: u64,
    summary: Option<Value>,
}

const RUN: &str = "slotprof run (shipped configuration)";

const VARIANTS: [&str; 5] = [
    "alone",
    "slotprof attach",
    "slotprof attach --offcpu exact",
    "perf record --call-graph dwarf",
    RUN,
];

fn one_round(a: &Args, node: &Node, variant: &'static str, i: usize) -> Result<Round, String> {
    let pid = node.pid();
    // The daemon is measured once it runs steadily: its start (symbols
    // loaded, probes attached, first slot exported) is not the always-on
    // cost, and comes before the round's clock starts.
    let daemon = if variant == RUN {
        Some(Daemon::start(a, node, &format!("run-{i}"), None)?)
    } else {
        None
    };
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
        RUN => {
            let d = daemon.as_ref().ok_or("no daemon")?;
            let _stats = BpfStats::on()?;
            let (cpu0, bpf0) = (cpu_seconds(d.pid()).unwrap_or(0.0), bpf_run_ns(d.pid()));
            std::thread::sleep(Duration::from_secs(a.seconds));
            let (cpu1, bpf1) = (cpu_seconds(d.pid()).unwrap_or(0.0), bpf_run_ns(d.pid()));
            r.tool_cpu_s = cpu1 - cpu0;
            r.bpf_ns = bpf1.saturating_sub(bpf0);
            r.tool_rss = peak_rss(d.pid()).unwrap_or(0);
        }
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
                    // Without inline expansion: perf resolves inlined
                    // frames by running binutils' addr2line on the node's
                    // 1 GB of debug info, which took over 8 minutes of CPU
                    // for one 60 s round here (kept out: an operator
                    // waiting on that would pass --no-inline too).
                    .args(["report", "--stdio", "--no-inline", "-i"])
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
    drop(daemon);
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

/// Peak RSS of a running process so far (VmHWM), bytes.
fn peak_rss(pid: u32) -> Option<u64> {
    status_bytes(pid, "VmHWM:")
}

/// The run time so far (ns) of every BPF program `pid` holds, from its
/// descriptors' fdinfo (`run_time_ns`, counted while
/// `kernel.bpf_stats_enabled` is 1); a program held twice counts once.
fn bpf_run_ns(pid: u32) -> u64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return 0;
    };
    for e in dir.flatten() {
        let Ok(info) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let Some(ns) = field("run_time_ns:") else {
            continue;
        };
        let id = field("prog_id:").unwrap_or(u64::MAX - seen.len() as u64);
        if seen.insert(id) {
            total += ns;
        }
    }
    total
}

/// kernel.bpf_stats_enabled's value before the bench set it (-1: untouched),
/// for the signal handler to put back.
static BPF_STATS_WAS: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// `kernel.bpf_stats_enabled` on while it lives, put back as it was after.
struct BpfStats;

impl BpfStats {
    fn on() -> Result<Self, String> {
        let was = std::fs::read_to_string(BPF_STATS)
            .map_err(|e| format!("cannot read {BPF_STATS}: {e}"))?
            .trim()
            .parse::<i32>()
            .map_err(|e| format!("{BPF_STATS}: {e}"))?;
        BPF_STATS_WAS.store(was, std::sync::atomic::Ordering::SeqCst);
        std::fs::write(BPF_STATS, "1").map_err(|e| format!("cannot write {BPF_STATS} (run as root): {e}"))?;
        Ok(Self)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let was = BPF_STATS_WAS.swap(-1, std::sync::atomic::Ordering::SeqCst);
        if was >= 0 {
            let _ = std::fs::write(BPF_STATS, was.to_string());
        }
    }
}

/// The shipped configuration (`slotprof run --print-config`) pointed at
/// this node: its name, its RPC, an export directory and a metrics port;
/// `full` replaces `export.full` when given; every other key as shipped,
/// the phase probe included. A shipped key this cannot find once fails
/// the bench: the figures would no longer be the shipped configuration's.
fn shipped_config(
    a: &Args,
    node: &Node,
    export: &Path,
    metrics: u16,
    full: Option<&str>,
) -> Result<String, String> {
    let out = Command::new(&a.slotprof)
        .args(["run", "--print-config"])
        .output()
        .map_err(|e| format!("slotprof run --print-config: {e}"))?;
    if !out.status.success() {
        return Err("slotprof run --print-config failed".into());
    }
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let mut edits = vec![
        ("comm = ", "comm = \"solana-test-validator\"".to_string()),
        ("source = ", format!("source = \"rpc={}\"", node.rpc_url())),
        ("dir = ", format!("dir = \"{}\"", export.display())),
        ("listen = ", format!("listen = \"127.0.0.1:{metrics}\"")),
    ];
    if let Some(f) = full {
        edits.push(("full = ", format!("full = \"{f}\"")));
    }
    for (key, line) in edits {
        let at: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].starts_with(key)).collect();
        let [i] = at[..] else {
            return Err(format!(
                "the shipped configuration has {} lines starting `{key}`, not one: update validator-bench",
                at.len()
            ));
        };
        lines[i] = line;
    }
    Ok(lines.join("\n") + "\n")
}

/// `slotprof run` on the shipped configuration, started and warmed up
/// (its first slot exported); stopped by SIGTERM (SIGKILL after 30 s) and
/// its export removed when dropped.
struct Daemon {
    child: std::process::Child,
    metrics: u16,
    export: PathBuf,
    log: PathBuf,
}

impl Daemon {
    fn start(a: &Args, node: &Node, name: &str, full: Option<&str>) -> Result<Self, String> {
        let metrics = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let export = a.scratch.join(format!("{name}-export"));
        let config = a.scratch.join(format!("{name}.toml"));
        let log = a.scratch.join(format!("{name}.log"));
        std::fs::write(&config, shipped_config(a, node, &export, metrics, full)?)
            .map_err(|e| format!("{}: {e}", config.display()))?;
        let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let child = Command::new(&a.slotprof)
            .args(["run", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("slotprof run: {e}"))?;
        DAEMON_PID.store(child.id() as i32, std::sync::atomic::Ordering::SeqCst);
        let mut d = Self {
            child,
            metrics,
            export,
            log,
        };
        let started = Instant::now();
        while d.exported() == 0.0 {
            if let Ok(Some(status)) = d.child.try_wait() {
                return Err(format!("slotprof run exited ({status}): {}", d.log_tail()));
            }
            if started.elapsed() > Duration::from_secs(120) {
                return Err(format!(
                    "slotprof run exported no slot in 120 s (run `{} run --config {}` by hand): {}",
                    a.slotprof.display(),
                    config.display(),
                    d.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        Ok(d)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }

    /// Its /metrics, or empty.
    fn scrape(&self) -> String {
        (|| -> std::io::Result<String> {
            use std::io::{Read, Write};
            let mut c = std::net::TcpStream::connect(("127.0.0.1", self.metrics))?;
            c.set_read_timeout(Some(Duration::from_secs(10)))?;
            c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
            let mut r = String::new();
            c.read_to_string(&mut r)?;
            Ok(r)
        })()
        .unwrap_or_default()
    }

    /// Slots exported so far (full and summary).
    fn exported(&self) -> f64 {
        self.scrape()
            .lines()
            .filter(|l| l.starts_with("slotprof_slots_exported_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let asked = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) {
            if asked.elapsed() > Duration::from_secs(30) {
                eprintln!("validator-bench: slotprof run ignored SIGTERM for 30 s; killing it");
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        DAEMON_PID.store(0, std::sync::atomic::Ordering::SeqCst);
        let _ = std::fs::remove_dir_all(&self.export);
    }
}

/// With perf: where `slotprof run`'s CPU goes on this node, steady state
/// (after its first slot): `perf record -g` on the daemon (it keeps frame
/// pointers) for `--seconds`, its functions by self time.
fn profile_run(a: &Args, node: &Node) -> Result<Option<String>, String> {
    let Some(perf) = &a.perf else {
        return Ok(None);
    };
    let d = Daemon::start(a, node, "run-profile", None)?;
    let data = a.scratch.join("run-profile.data");
    let recorded = Command::new(perf)
        .args(["record", "-F", "999", "-g", "-p", &d.pid().to_string(), "-o"])
        .arg(&data)
        .args(["--", "sleep", &a.seconds.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("perf record: {e}"))?;
    drop(d);
    if !recorded.success() {
        let _ = std::fs::remove_file(&data);
        return Err("perf record on slotprof run failed".into());
    }
    let mut text = String::new();
    for sort in ["comm", "dso,sym"] {
        let out = Command::new(perf)
            .args([
                "report",
                "--stdio",
                "--no-inline",
                "--no-children",
                "-g",
                "none",
                "--percent-limit",
                "1",
                "--sort",
                sort,
                "-i",
            ])
            .arg(&data)
            .stderr(Stdio::null())
            .output()
            .map_err(|e| format!("perf report: {e}"))?;
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            if !l.trim().is_empty() && !l.starts_with('#') {
                text.push_str(l.trim_end());
                text.push('\n');
            }
        }
        text.push('\n');
    }
    let _ = std::fs::remove_file(&data);
    Ok(Some(text))
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

/// `slotprof run` on the shipped configuration following the node by
/// name, `export.full` replaced by `full` when given: (seconds, RSS bytes,
/// CPU seconds) every 10 s from its first exported slot, and /metrics at
/// the end.
fn always_on(a: &Args, node: &Node, full: Option<&str>) -> Result<RunResult, String> {
    let d = Daemon::start(a, node, "run-long", full)?;
    let pid = d.pid();
    let started = Instant::now();
    let mut samples = Vec::new();
    let what = full.unwrap_or("as shipped");
    while started.elapsed() < Duration::from_secs(a.run_minutes * 60) {
        std::thread::sleep(Duration::from_secs(10));
        if let (Some(r), Some(c)) = (rss(pid), cpu_seconds(pid)) {
            samples.push((started.elapsed().as_secs_f64(), r, c));
            eprintln!(
                "validator-bench: run (export.full {what}) {:>5.0} s  RSS {:.1} MiB  CPU {:.1} s",
                started.elapsed().as_secs_f64(),
                r as f64 / 1048576.0,
                c
            );
        } else {
            return Err(format!("slotprof run exited early: {}", d.log_tail()));
        }
    }
    let scrape = d.scrape();
    Ok((samples, scrape))
}

/// The node's process group and the load's pid, for the signal handler.
static NODE_PGID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static LOAD_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// A long `slotprof run` in progress, for the signal handler to stop.
static DAEMON_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

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
        let daemon = DAEMON_PID.load(SeqCst);
        if daemon > 0 {
            libc::kill(daemon, libc::SIGTERM);
        }
        // kernel.bpf_stats_enabled back as it was (open/write/close are
        // async-signal-safe).
        let was = BPF_STATS_WAS.load(SeqCst);
        if was >= 0 {
            let fd = libc::open(c"/proc/sys/kernel/bpf_stats_enabled".as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                let v: &[u8] = if was == 0 { b"0" } else { b"1" };
                libc::write(fd, v.as_ptr().cast(), 1);
                libc::close(fd);
            }
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
    let profile = profile_run(a, &node)?;
    let mut runs = Vec::new();
    if a.run_minutes > 0 {
        for full in [None, Some("findings")] {
            runs.push((full, always_on(a, &node, full)?));
        }
    }
    let report = load.stop()?;
    Ok(markdown(a, &rounds, profile.as_deref(), &runs, &report.json))
}

fn markdown(
    a: &Args,
    rounds: &[Round],
    profile: Option<&str>,
    runs: &[(Option<&str>, RunResult)],
    load: &Value,
) -> String {
    let mib = |b: u64| b as f64 / 1048576.0;
    let of = |v: &str| -> Vec<&Round> { rounds.iter().filter(|r| r.variant == v).collect() };
    let alone = median(of("alone").iter().map(|r| r.slots_per_s).collect());
    let mut md = String::new();
    let _ = writeln!(
        md,
        "The real node of `cargo xtask validator` (solana-test-validator 4.4.0, a one-node cluster leading every slot) under a real client's load ({} transactions a second from tests/loadgen: transfers, Memo, SPL Token; {} sent, {} confirmed over the whole bench). {} interleaved rounds of {} s per variant; medians. Slots a second from the node's own RPC over each round (an attach's set-up and tear-down included; `slotprof run`, the always-on daemon, measured from its first exported slot: its start is once per boot).\n",
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
    let run_bpf = median(
        of(RUN)
            .iter()
            .map(|r| 100.0 * r.bpf_ns as f64 / (a.seconds as f64 * 1e9))
            .collect(),
    );
    if !of(RUN).is_empty() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let _ = writeln!(
            md,
            "\n`slotprof run` on the shipped configuration (`slotprof run --print-config`: 49 Hz, every probe, off-CPU folded, export of leader slots and slots with findings, hourly profiles, the phase probe as shipped), pointed at the node by name: all its BPF programs {run_bpf:.3}% of one CPU, {:.3}% of the machine ({cpus:.0} CPUs), from the kernel's run time of each program it holds.",
            run_bpf / cpus
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
    if let Some(p) = profile {
        let _ = writeln!(
            md,
            "\nWhere `slotprof run`'s own CPU goes on this node (as shipped, steady state, {} s; `perf record -F 999 -g` on the daemon, self time, threads then functions over 1%):\n\n```\n{}```",
            a.seconds,
            p
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
        let five = at(300.0);
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
        let what = if *full == Some("findings") {
            "`export.full = \"findings\"`: only slots with findings get flamegraphs, pprof and the trace; the others a line in slots.jsonl. The nearest this node comes to a mainnet validator, which leads a few percent of slots"
        } else {
            "the shipped `export.full = \"findings-and-leader\"`: full export of leader slots and slots with findings, so every slot here"
        };
        let _ = writeln!(
            md,
            "\n`slotprof run` on the shipped configuration following the node by name (`comm = \"solana-test-validator\"`, RPC slot source) with {what}; the phase probe as shipped; {} minutes from its first exported slot under the same load:\n",
            a.run_minutes
        );
        let _ = writeln!(md, "| | |\n|---|---|");
        let _ = writeln!(md, "| RSS after 1 min | {:.1} MiB |", mib(first.1));
        let _ = writeln!(md, "| RSS after 5 min | {:.1} MiB |", mib(five.1));
        let _ = writeln!(
            md,
            "| RSS at the end | {:.1} MiB ({:+.1} MiB since 5 min) |",
            mib(last.1),
            mib(last.1) - mib(five.1)
        );
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
    md.push('\n');
    md
}
