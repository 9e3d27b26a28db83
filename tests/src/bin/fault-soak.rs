//! The fault soak behind `cargo xtask soak --minutes N` (root): `slotprof
//! run` follows a synthetic validator whose RPC is this program's fixture,
//! with its export on a tmpfs of this program's, while faults come at
//! random, one at a time, every 10-30 s:
//!
//! - `rpc_down`: the RPC goes away for 5-15 s (listeners and connections
//!   closed), then comes back;
//! - `wrong_types`: for 10 s every answer's result is the string "123"
//!   (the connections dropped first, so slotprof asks again);
//! - `huge_answers`: for 10 s every answer announces 50 MB and sends it;
//! - `disk_full`: the export's file system is filled below the free-space
//!   floor for 10 s, then to just above it (a slot's write can fail) for
//!   10 s, then drained;
//! - `idle_connections`: 1,100 idle connections to /metrics for 10 s;
//! - `sighup_good`: a changed, valid configuration and SIGHUP;
//! - `sighup_unappliable`: a configuration whose metrics port is taken,
//!   SIGHUP (refused), then the good one back;
//! - `target_restart`: the target killed and started again 2 s later;
//! - `ws_silent`, `ws_garbage`, `ws_flood`, `ws_huge_frame`, `ws_close`:
//!   for 10 s the websocket sends no notification, garbage in their
//!   place, each 2,000 times, a frame header announcing 2^62 bytes, or
//!   closes (HTTP answers well).
//!
//! Meanwhile it samples, every 2 s, whether the daemon lives, its RSS and
//! whether /metrics answers. At the end: SIGTERM, and the accounting of
//! slots (/metrics against the files on disk, and against the time the
//! target ran). Then the kill loop ([`kill_loop`]): `run` on an export
//! of its own, SIGKILLed 20 times at random points and started again on
//! the same directory, its slot directories and summary lines compared.
//! The report (JSON) goes to `--report`.
//!
//! Flags: `--minutes M` (default 60), `--slotprof PATH`, `--report FILE`,
//! `--seed S`.

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use slotprof_tests::{
    private_temp_dir,
    rpc_fixture::{ChainConfig, Fault, RpcFixture, WsFault},
    write_report, Flags,
};

const SLOT: Duration = Duration::from_millis(400);
const FIRST_SLOT: u64 = 345_600_000;
/// SIGKILLs of the kill loop.
const KILLS: u32 = 20;

/// A small xorshift: the faults' order and timing, reproducible by seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no free port pair");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn chain() -> ChainConfig {
    ChainConfig {
        identity: "SoakNode11111111111111111111111111111111111".into(),
        slots_in_epoch: 432_000,
        leader: (4, 8),
    }
}

/// The RPC fixture, its slot clock, and whether it is up.
struct Node {
    port: u16,
    fixture: Mutex<Option<RpcFixture>>,
    slot: AtomicU64,
    fault: Mutex<Fault>,
    ws_fault: Mutex<WsFault>,
}

impl Node {
    fn start(&self) {
        let mut f = self.fixture.lock().unwrap();
        if f.is_none() {
            // The port may linger for a moment after a stop.
            for _ in 0..50 {
                match RpcFixture::start(self.port, chain(), self.slot.load(Ordering::Relaxed)) {
                    Ok(fx) => {
                        fx.set_fault(*self.fault.lock().unwrap());
                        fx.set_ws_fault(*self.ws_fault.lock().unwrap());
                        *f = Some(fx);
                        return;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
            panic!("cannot start the RPC fixture again on {}", self.port);
        }
    }
    fn stop(&self) {
        if let Some(mut f) = self.fixture.lock().unwrap().take() {
            f.stop();
        }
    }
    fn set_fault(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
        if let Some(f) = self.fixture.lock().unwrap().as_ref() {
            f.set_fault(fault);
        }
    }
    fn set_ws_fault(&self, fault: WsFault) {
        *self.ws_fault.lock().unwrap() = fault;
        if let Some(f) = self.fixture.lock().unwrap().as_ref() {
            f.set_ws_fault(fault);
        }
    }
    fn tick(&self) {
        let s = self.slot.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(f) = self.fixture.lock().unwrap().as_ref() {
            f.set_slot(s);
        }
    }
}

/// A tmpfs for the export, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn statvfs_free(p: &Path) -> u64 {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a zeroed statvfs filled by the call.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    s.f_bavail * s.f_frsize
}

/// Grows (or shrinks) the filler so that `leave` bytes stay free.
fn fill_to(dir: &Path, leave: u64) {
    let filler = dir.join("filler");
    let now = std::fs::metadata(&filler).map_or(0, |m| m.len());
    let free = statvfs_free(dir);
    let want = (now + free).saturating_sub(leave);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(&filler)
        .unwrap();
    if want < now {
        f.set_len(want).unwrap();
    } else {
        // tmpfs allocates on write: write the zeros.
        let mut f = f;
        use std::io::Seek;
        f.seek(std::io::SeekFrom::Start(now)).unwrap();
        let chunk = vec![0u8; 1 << 20];
        let mut left = want - now;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            if f.write_all(&chunk[..n]).is_err() {
                break;
            }
            left -= n as u64;
        }
    }
}

fn config_text(rpc: u16, metrics: u16, export: &Path, lock_threshold: &str) -> String {
    format!(
        "[target]\ncomm = \"synthetic-validator\"\n[slots]\nsource = \"rpc=http://127.0.0.1:{rpc}\"\n\
         [export]\ndir = \"{}\"\nfull = \"findings\"\nretention_bytes = \"1800MiB\"\n\
         free_space_floor = \"8MiB\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n\
         [detectors]\nlock_threshold = \"{lock_threshold}\"\n[phase_probe]\nenabled = false\n",
        export.display()
    )
}

fn start_target(bin: &Path, minutes: u64) -> Child {
    Command::new(bin.join("synthetic-validator"))
        .args([
            "--slots",
            &(minutes * 60 * 3 + 100).to_string(),
            "--lock-stall-every",
            "10",
            "--lock-stall-ms",
            "30",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("start synthetic-validator")
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes())
        .ok()?;
    let mut r = String::new();
    s.read_to_string(&mut r).ok()?;
    let (head, body) = r.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let flags = Flags::from_env();
    let minutes = flags.num("minutes", 60.0) as u64;
    let seed = flags.num("seed", 1.0) as u64;
    let bin = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let slotprof = flags
        .get("slotprof")
        .map_or_else(|| bin.join("slotprof"), PathBuf::from);
    let dir = private_temp_dir("slotprof-soak").expect("a scratch directory");
    let export = dir.join("export");
    std::fs::create_dir_all(&export).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2g,mode=0700", "tmpfs"])
        .arg(&export)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cannot mount a tmpfs for the export (needs root)");
    let _tmpfs = Tmpfs(export.clone());
    let (rpc, metrics) = (free_port_pair(), free_port());
    let config = dir.join("slotprof.toml");
    let good = config_text(rpc, metrics, &export, "10ms");
    std::fs::write(&config, &good).unwrap();

    let node = Arc::new(Node {
        port: rpc,
        fixture: Mutex::new(None),
        slot: AtomicU64::new(FIRST_SLOT),
        fault: Mutex::new(Fault::None),
        ws_fault: Mutex::new(WsFault::None),
    });
    node.start();
    let stop = Arc::new(AtomicBool::new(false));
    let clock = {
        let (node, stop) = (node.clone(), stop.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut n = 1u32;
            while !stop.load(Ordering::Relaxed) {
                let next = t0 + SLOT * n;
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                node.tick();
                n += 1;
            }
        })
    };
    let mut target = Some(start_target(&bin, minutes));
    let mut target_since = Some(Instant::now());
    let mut target_alive = Duration::ZERO;
    let stderr_path = dir.join("slotprof-run.stderr");
    let mut daemon = Command::new(&slotprof)
        .args(["run", "--config", config.to_str().unwrap()])
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("start slotprof run");
    let pid = daemon.id();

    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let began = Instant::now();
    let end = began + Duration::from_secs(minutes * 60);
    let mut faults: Vec<(f64, &str)> = Vec::new();
    let mut rss_max = 0u64;
    let mut rss_series: Vec<(u64, u64)> = Vec::new();
    let mut metrics_misses: Vec<u64> = Vec::new();
    let mut answered = false;
    let mut died: Option<String> = None;
    let mut last_sample = Instant::now() - Duration::from_secs(10);
    // Samples while waiting, and stops the soak if the daemon died.
    let mut wait = |d: Duration,
                    daemon: &mut Child,
                    rss_max: &mut u64,
                    rss_series: &mut Vec<(u64, u64)>,
                    metrics_misses: &mut Vec<u64>,
                    answered: &mut bool,
                    died: &mut Option<String>| {
        let until = Instant::now() + d;
        while Instant::now() < until && died.is_none() {
            if last_sample.elapsed() >= Duration::from_secs(2) {
                last_sample = Instant::now();
                if let Ok(Some(status)) = daemon.try_wait() {
                    *died = Some(format!("slotprof run exited with {status}"));
                    break;
                }
                let rss = rss_kib(pid);
                *rss_max = (*rss_max).max(rss);
                let t = began.elapsed().as_secs();
                if rss_series.last().is_none_or(|(s, _)| t >= s + 30) {
                    rss_series.push((t, rss));
                }
                // Counted once it has answered: at the very start the
                // daemon has not bound its port yet.
                match http_get(metrics, "/metrics") {
                    Some(_) => *answered = true,
                    None if *answered => metrics_misses.push(began.elapsed().as_secs()),
                    None => {}
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    // The first slots before any fault.
    wait(
        Duration::from_secs(20),
        &mut daemon,
        &mut rss_max,
        &mut rss_series,
        &mut metrics_misses,
        &mut answered,
        &mut died,
    );
    let kinds = [
        "rpc_down",
        "wrong_types",
        "huge_answers",
        "disk_full",
        "idle_connections",
        "sighup_good",
        "sighup_unappliable",
        "target_restart",
        "ws_silent",
        "ws_garbage",
        "ws_flood",
        "ws_huge_frame",
        "ws_close",
    ];
    while Instant::now() < end && died.is_none() {
        let kind = kinds[(rng.next() % kinds.len() as u64) as usize];
        faults.push((began.elapsed().as_secs_f64(), kind));
        eprintln!("soak: {:>6.0} s: {kind}", began.elapsed().as_secs_f64());
        let mut w = |d: Duration, daemon: &mut Child| {
            wait(
                d,
                daemon,
                &mut rss_max,
                &mut rss_series,
                &mut metrics_misses,
                &mut answered,
                &mut died,
            )
        };
        match kind {
            "rpc_down" => {
                node.stop();
                w(Duration::from_secs(rng.range(5, 15)), &mut daemon);
                node.start();
            }
            "wrong_types" | "huge_answers" => {
                node.set_fault(if kind == "wrong_types" {
                    Fault::WrongTypes
                } else {
                    Fault::Huge
                });
                node.stop();
                node.start();
                w(Duration::from_secs(10), &mut daemon);
                node.set_fault(Fault::None);
                node.stop();
                node.start();
            }
            "disk_full" => {
                fill_to(&export, 4 << 20);
                w(Duration::from_secs(10), &mut daemon);
                fill_to(&export, 9 << 20);
                w(Duration::from_secs(10), &mut daemon);
                let _ = std::fs::remove_file(export.join("filler"));
            }
            "idle_connections" => {
                let idle: Vec<TcpStream> = (0..1100)
                    .filter_map(|_| TcpStream::connect(("127.0.0.1", metrics)).ok())
                    .collect();
                w(Duration::from_secs(10), &mut daemon);
                drop(idle);
            }
            "sighup_good" => {
                let t = if rng.next().is_multiple_of(2) {
                    "12ms"
                } else {
                    "10ms"
                };
                std::fs::write(&config, config_text(rpc, metrics, &export, t)).unwrap();
                unsafe { libc::kill(pid as i32, libc::SIGHUP) };
            }
            "sighup_unappliable" => {
                let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let port = taken.local_addr().unwrap().port();
                std::fs::write(&config, config_text(rpc, port, &export, "10ms")).unwrap();
                unsafe { libc::kill(pid as i32, libc::SIGHUP) };
                w(Duration::from_secs(3), &mut daemon);
                drop(taken);
                std::fs::write(&config, &good).unwrap();
            }
            "target_restart" => {
                if let Some(mut t) = target.take() {
                    let _ = t.kill();
                    let _ = t.wait();
                }
                if let Some(s) = target_since.take() {
                    target_alive += s.elapsed();
                }
                w(Duration::from_secs(2), &mut daemon);
                target = Some(start_target(&bin, minutes));
                target_since = Some(Instant::now());
            }
            ws => {
                // The websocket misbehaves for 10 s (HTTP answers well):
                // slotprof polls getSlot instead, and tries the websocket
                // again a minute later.
                node.set_ws_fault(match ws {
                    "ws_silent" => WsFault::Silent,
                    "ws_garbage" => WsFault::Garbage,
                    "ws_flood" => WsFault::Flood,
                    "ws_huge_frame" => WsFault::HugeFrame,
                    _ => WsFault::Close,
                });
                w(Duration::from_secs(10), &mut daemon);
                node.set_ws_fault(WsFault::None);
            }
        }
        let gap = Duration::from_secs(rng.range(10, 30));
        w(
            gap.min(end.saturating_duration_since(Instant::now())),
            &mut daemon,
        );
    }
    // The end: the target stops (slotprof writes what ended and waits),
    // then the last metrics (nothing changes after), SIGTERM, the
    // accounting.
    if let Some(mut t) = target.take() {
        let _ = t.kill();
        let _ = t.wait();
    }
    if let Some(s) = target_since.take() {
        target_alive += s.elapsed();
    }
    std::thread::sleep(Duration::from_secs(5));
    let last = http_get(metrics, "/metrics").unwrap_or_default();
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let status = daemon.wait().unwrap();
    let full = metric(&last, "slotprof_slots_exported_total{mode=\"full\"}");
    let summary = metric(&last, "slotprof_slots_exported_total{mode=\"summary\"}");
    let low_space = metric(&last, "slotprof_slots_not_exported_total{reason=\"low_space\"}");
    let write_failed = metric(
        &last,
        "slotprof_slots_not_exported_total{reason=\"write_failed\"}",
    );
    let accounted = full + summary + low_space + write_failed;
    let slot_dirs = std::fs::read_dir(export.join("slots")).map_or(0, |d| d.count());
    let mut lines = 0usize;
    for h in std::fs::read_dir(export.join("hours"))
        .into_iter()
        .flatten()
        .flatten()
    {
        lines += std::fs::read_to_string(h.path().join("slots.jsonl")).map_or(0, |t| t.lines().count());
    }
    // The kill loop, on an export of its own beside (the RPC and its
    // clock still up, the target started again).
    let kills_export = export.join("kills");
    let kills_config = dir.join("kills.toml");
    std::fs::write(
        &kills_config,
        config_text(rpc, free_port(), &kills_export, "10ms"),
    )
    .unwrap();
    let mut target = start_target(&bin, minutes);
    let kills = kill_loop(&slotprof, &kills_config, &kills_export, KILLS, &mut rng);
    let _ = target.kill();
    let _ = target.wait();
    stop.store(true, Ordering::Relaxed);
    let _ = clock.join();
    node.stop();
    let said = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let expected = target_alive.as_secs_f64() / SLOT.as_secs_f64();
    let faults_json: Vec<String> = faults.iter().map(|(t, k)| format!("[{t:.0},\"{k}\"]")).collect();
    let report = format!(
        "{{\"minutes\":{minutes},\"seed\":{seed},\"died\":{},\"exit\":\"{status}\",\"exit_ok\":{},\
         \"rss_max_kib\":{rss_max},\"rss_series\":[{}],\"metrics_misses\":[{}],\
         \"faults\":[{}],\"slots\":{{\"full\":{full},\"summary\":{summary},\"low_space\":{low_space},\
         \"write_failed\":{write_failed},\"accounted\":{accounted},\"expected_from_target_time\":{expected:.0},\
         \"slot_dirs_on_disk\":{slot_dirs},\"summary_lines_on_disk\":{lines}}},\
         \"export_write_errors\":{},\"lost\":{},\"stderr_lines\":{},\"kills\":{kills}}}",
        died.as_deref().map_or("null".to_string(), |d| format!("\"{d}\"")),
        status.success(),
        rss_series.iter().map(|(t, r)| format!("[{t},{r}]")).collect::<Vec<_>>().join(","),
        metrics_misses.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
        faults_json.join(","),
        metric(&last, "slotprof_export_write_errors_total"),
        last.lines()
            .filter(|l| l.starts_with("slotprof_lost_events_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>(),
        said.lines().count(),
    );
    std::fs::write(dir.join("slotprof-run.said"), &said).ok();
    eprintln!(
        "soak: slotprof said {} lines; kept in {}",
        said.lines().count(),
        dir.display()
    );
    write_report(&flags, &report);
}

/// What the disk of an export holds: its slot directories against its
/// summary lines.
#[derive(Default)]
struct Disk {
    dirs: std::collections::BTreeSet<u64>,
    /// Each summary line's slot number and whether it had findings (with
    /// `full = "findings"`: exported whole).
    lines: Vec<(u64, bool)>,
    /// Lines that are not whole JSON objects.
    torn: usize,
    /// Hidden temporary files and directories left anywhere.
    leftovers: Vec<String>,
}

impl Disk {
    fn read(export: &Path) -> Self {
        let mut d = Disk::default();
        for e in std::fs::read_dir(export.join("slots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Some(n) = e.file_name().to_str().and_then(|n| n.parse().ok()) {
                d.dirs.insert(n);
            }
        }
        let mut places = vec![export.to_path_buf(), export.join("slots"), export.join("windows")];
        places.push(export.join("hours"));
        for h in std::fs::read_dir(export.join("hours"))
            .into_iter()
            .flatten()
            .flatten()
        {
            places.push(h.path());
            let text = std::fs::read_to_string(h.path().join("slots.jsonl")).unwrap_or_default();
            for line in text.lines() {
                match serde_json::from_str::<serde_json::Value>(line) {
                    Ok(v) if v["number"].is_u64() => d.lines.push((
                        v["number"].as_u64().unwrap(),
                        v["findings"].as_array().is_some_and(|f| !f.is_empty()),
                    )),
                    _ => d.torn += 1,
                }
            }
        }
        for p in places {
            for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    d.leftovers.push(e.path().display().to_string());
                }
            }
        }
        d
    }

    /// (slot directories without a line, lines of slots exported whole
    /// without a directory, slot numbers with more than one line).
    fn mismatches(&self) -> (usize, usize, usize) {
        let numbers: std::collections::BTreeSet<u64> = self.lines.iter().map(|l| l.0).collect();
        let no_line = self.dirs.iter().filter(|n| !numbers.contains(n)).count();
        let no_dir = self
            .lines
            .iter()
            .filter(|(n, full)| *full && !self.dirs.contains(n))
            .count();
        (no_line, no_dir, self.lines.len() - numbers.len())
    }
}

/// The kill loop: `slotprof run` on an export directory of its own,
/// SIGKILLed `kills` times at random points (1-12 s after it starts:
/// while it attaches, between slots, while it writes one) and started
/// again on the same directory each time; then one last run ended by
/// SIGTERM after the target exits. The report's `kills` object: what is
/// on disk and what does not match.
fn kill_loop(slotprof: &Path, config: &Path, export: &Path, kills: u32, rng: &mut Rng) -> String {
    let mut killed_at: Vec<u64> = Vec::new();
    let mut exits: Vec<String> = Vec::new();
    for k in 0..=kills {
        let mut daemon = Command::new(slotprof)
            .args(["run", "--config", config.to_str().unwrap()])
            .stderr(Stdio::null())
            .spawn()
            .expect("start slotprof run");
        if k == kills {
            std::thread::sleep(Duration::from_secs(8));
            unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
            exits.push(daemon.wait().map_or("?".into(), |s| s.to_string()));
            break;
        }
        let at = rng.range(1_000, 12_000);
        std::thread::sleep(Duration::from_millis(at));
        // Dead already is a finding of its own (the exit is kept).
        if let Ok(Some(s)) = daemon.try_wait() {
            exits.push(format!("exited by itself before its kill: {s}"));
        }
        let _ = daemon.kill();
        let _ = daemon.wait();
        killed_at.push(at);
        eprintln!("soak: kill {} of {kills}, {at} ms after the start", k + 1);
    }
    let d = Disk::read(export);
    let (no_line, no_dir, dup) = d.mismatches();
    format!(
        "{{\"kills\":{kills},\"killed_at_ms\":[{}],\"exits\":[{}],\"slot_dirs\":{},\"lines\":{},\
         \"dirs_without_line\":{no_line},\"full_lines_without_dir\":{no_dir},\"duplicate_lines\":{dup},\
         \"torn_lines\":{},\"leftovers\":[{}]}}",
        killed_at.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
        exits
            .iter()
            .map(|e| format!("{e:?}"))
            .collect::<Vec<_>>()
            .join(","),
        d.dirs.len(),
        d.lines.len(),
        d.torn,
        d.leftovers
            .iter()
            .map(|l| format!("{l:?}"))
            .collect::<Vec<_>>()
            .join(","),
    )
}
