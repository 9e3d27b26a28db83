//! `slotprof run` (always-on mode) against the synthetic validator over
//! its RPC fixture: per-slot directories within one slot of each slot's
//! end, LockContention findings in the slots the program stalled, metrics a
//! real Prometheus parser reads and that match findings.json, retention
//! under its cap, and a clean SIGTERM (nothing left loaded, no partial
//! files).

mod common;

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::*;
use slotprof_tests::monotonic_ns;

/// Every file or directory under `dir` whose name marks it temporary.
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') || name.contains(".tmp") {
            out.push(p.clone());
        }
        if p.is_dir() {
            out.extend(leftovers(&p));
        }
    }
    out
}

fn du(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                du(&p)
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn always_on_exports_each_slot_as_it_ends_with_findings_and_metrics() {
    let Some(_k) = kernel() else { return };
    let dir = scratch("run");
    let export = dir.join("export");
    let (rpc, metrics) = (free_port_pair(), free_port());
    let config = write_config(
        &dir,
        &config_text(rpc, metrics, &export, "full = \"findings-and-leader\""),
    );
    let mut validator = start_validator(
        &dir,
        rpc,
        30,
        &["--lock-stall-every", "5", "--lock-stall-ms", "30"],
    );
    let daemon = Daemon::start(&config, &dir);
    // When each slot directory first appeared (CLOCK_MONOTONIC).
    let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
    let mut pre_scrape = None;
    while validator.try_wait().unwrap().is_none() {
        for name in std::fs::read_dir(export.join("slots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(n) = name.file_name().to_string_lossy().parse::<u64>() {
                seen.entry(n).or_insert_with(monotonic_ns);
            }
        }
        if pre_scrape.is_none() && seen.len() >= 8 {
            // /metrics while it runs: it must parse.
            pre_scrape = Some(http_get(metrics, "/metrics"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let truth = read_json(&dir.join("truth.json"));
    // The target is gone; slotprof waits for it to come back, with every
    // finished slot written and /metrics still up.
    std::thread::sleep(Duration::from_millis(1500));
    let scrape_text = http_get(metrics, "/metrics");
    let index = http_get(metrics, "/");
    // Every kind of link the index holds answers over HTTP, as on disk.
    let links: Vec<&str> = index
        .split("href=\"")
        .skip(1)
        .filter_map(|l| l.split('"').next())
        .filter(|l| l.starts_with("slots/"))
        .collect();
    assert!(!links.is_empty(), "no slot links in the index");
    // A slot with findings has its flamegraphs on disk; one without has
    // them drawn by the server from its .folded when asked (`run` does not
    // draw two SVGs for every slot of a node that leads often).
    let svgs: Vec<&&str> = links.iter().filter(|l| l.ends_with(".svg")).collect();
    let drawn = svgs.iter().find(|l| export.join(l).is_file());
    let undrawn = svgs.iter().find(|l| !export.join(l).exists());
    let (Some(drawn), Some(undrawn)) = (drawn, undrawn) else {
        panic!("expected flamegraphs both on disk (slots with findings) and drawn on request (leader slots without): {svgs:?}");
    };
    for link in [**drawn]
        .into_iter()
        .chain(links.iter().filter(|l| l.ends_with(".json")).take(1).copied())
    {
        let served = http_get(metrics, &format!("/{link}"));
        let on_disk = std::fs::read_to_string(export.join(link)).unwrap_or_default();
        assert_eq!(
            served.len(),
            on_disk.len(),
            "/{link} over HTTP and on disk differ"
        );
    }
    let folded = export.join(undrawn.replace(".svg", ".folded"));
    assert!(
        folded.is_file(),
        "{} is not there to draw {undrawn} from",
        folded.display()
    );
    let served = http_get(metrics, &format!("/{undrawn}"));
    assert!(
        served.contains("<svg") && served.trim_end().ends_with("</svg>"),
        "/{undrawn} was not drawn on request: {}",
        &served[..served.len().min(300)]
    );
    let (status, said) = daemon.stop();
    assert!(status.success(), "slotprof run exited with {status}");

    let slot_ns = truth["slot_ns"].as_u64().unwrap();
    let stalls: Vec<u64> = truth["lock_stalls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let slots: Vec<&serde_json::Value> = truth["slots"].as_array().unwrap().iter().collect();
    let leader = |n: u64| (n - 345_600_000) % 8 < 4;
    // Exported in full: leader slots and slots with findings; the rest are
    // summary lines.
    let (mut late, mut with_lock, mut checked) = (Vec::new(), 0, 0);
    let mut delays_ms = Vec::new();
    // The last slot never ends as far as the RPC can tell (no next slot).
    for s in &slots[..slots.len() - 1] {
        let n = s["slot"].as_u64().unwrap();
        let end = s["end_ns"].as_u64().unwrap();
        let d = export.join("slots").join(n.to_string());
        let stalled = stalls.contains(&n);
        if !(leader(n) || stalled) {
            continue;
        }
        checked += 1;
        assert!(
            d.join("slot.json").is_file(),
            "slot {n} (leader {}, stalled {stalled}) was not exported",
            leader(n)
        );
        if let Some(&t) = seen.get(&n) {
            delays_ms.push(t.saturating_sub(end) as f64 / 1e6);
            if t > end + slot_ns {
                late.push((n, (t - end) as f64 / 1e6));
            }
        }
        if stalled {
            let sj = read_json(&d.join("slot.json"));
            if sj["findings"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["kind"] == "LockContention" && f["thread"] == "bank-loop")
            {
                with_lock += 1;
            }
        }
    }
    delays_ms.sort_by(f64::total_cmp);
    eprintln!(
        "{checked} slots exported in full; {} seen while running, {:.0} ms (median) and {:.0} ms (max) after \
         the slot's end; late (over one slot): {late:?}; LockContention in {with_lock} of {} stalled slots",
        seen.len(),
        delays_ms.get(delays_ms.len() / 2).copied().unwrap_or(0.0),
        delays_ms.last().copied().unwrap_or(0.0),
        stalls.len()
    );
    assert!(
        seen.len() >= 10,
        "only {} slot directories appeared while the validator ran",
        seen.len()
    );
    // Within one slot of the slot's end, generously: all but one.
    assert!(
        late.len() <= 1,
        "slots exported more than one slot after they ended: {late:?}"
    );
    assert!(
        with_lock as f64 >= 0.8 * stalls.len() as f64 && !stalls.is_empty(),
        "LockContention in {with_lock} of {} stalled slots",
        stalls.len()
    );
    // Every other slot left one summary line.
    let mut lines = HashMap::new();
    for h in std::fs::read_dir(export.join("hours")).unwrap().flatten() {
        for l in std::fs::read_to_string(h.path().join("slots.jsonl"))
            .unwrap_or_default()
            .lines()
        {
            let v: serde_json::Value = serde_json::from_str(l).expect("a whole JSON line");
            lines.insert(v["number"].as_u64().unwrap(), v);
        }
    }
    let quiet: Vec<u64> = slots[..slots.len() - 1]
        .iter()
        .map(|s| s["slot"].as_u64().unwrap())
        .filter(|&n| !leader(n) && !stalls.contains(&n))
        .collect();
    let summarised = quiet.iter().filter(|n| lines.contains_key(n)).count();
    assert!(!quiet.is_empty(), "no quiet slot to check");
    assert!(
        summarised as f64 >= 0.9 * quiet.len() as f64,
        "{summarised} of {} quiet slots have a summary line",
        quiet.len()
    );

    // Each exported leader slot's block, as the fixture's RPC served it.
    let mut outcomes = HashMap::new();
    for h in std::fs::read_dir(export.join("hours")).unwrap().flatten() {
        for l in std::fs::read_to_string(h.path().join("outcomes.jsonl"))
            .unwrap_or_default()
            .lines()
        {
            let v: serde_json::Value = serde_json::from_str(l).expect("a whole outcome line");
            outcomes.insert(v["slot"].as_u64().unwrap(), v);
        }
    }
    let leaders: Vec<u64> = lines
        .iter()
        .filter(|(_, v)| v["leader"] == true)
        .map(|(n, _)| *n)
        .collect();
    assert!(!leaders.is_empty(), "no leader slot exported");
    // The last few, whose blocks were not yet confirmed when the target
    // exited (its RPC with it), are counted as not asked, and said.
    let mut leaders = leaders;
    leaders.sort_unstable();
    let asked = leaders.iter().take_while(|n| outcomes.contains_key(n)).count();
    let not_asked = leaders.len() - asked;
    assert!(
        not_asked <= 4 && said.contains(&format!("{not_asked} not asked")),
        "{not_asked} leader slots at the end without an outcome: {:?}; slotprof said: {said}",
        &leaders[asked..]
    );
    for n in &leaders[..asked] {
        let o = &outcomes[n];
        let (txs, cu) = slotprof_tests::rpc_fixture::block_of(*n);
        assert_eq!(
            (
                o["transactions"].as_u64(),
                o["compute_units"].as_u64(),
                &o["skipped"]
            ),
            (Some(txs), Some(cu), &serde_json::json!(false)),
            "slot {n}"
        );
    }
    eprintln!(
        "{asked} of {} leader slots with their block's outcome, {not_asked} not asked (the target exited)",
        leaders.len()
    );

    // /metrics: a real parser reads it, and its counts are findings.json's.
    for text in pre_scrape.iter().chain([&scrape_text]) {
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .expect("valid exposition format");
    }
    // The gauges an alert reads: attached with a healthy RPC while the
    // target ran, detached once it was gone; the last slot written.
    let gauge = |text: &str, name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
    };
    let running = pre_scrape.as_deref().expect("a scrape while the target ran");
    assert_eq!(gauge(running, "slotprof_target_attached"), 1.0, "{running}");
    assert_eq!(
        gauge(running, "slotprof_slot_source_healthy{source=\"rpc\"}"),
        1.0,
        "{running}"
    );
    assert!(
        gauge(running, "slotprof_last_exported_slot") >= 345_600_102.0,
        "{running}"
    );
    assert_eq!(
        gauge(&scrape_text, "slotprof_target_attached"),
        0.0,
        "{scrape_text}"
    );
    assert!(gauge(&scrape_text, "process_resident_memory_bytes") > 0.0);
    let scrape = prometheus_parse::Scrape::parse(scrape_text.lines().map(|l| Ok(l.to_string()))).unwrap();
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for f in read_json(&export.join("findings.json")).as_array().unwrap() {
        *by_kind
            .entry(f["kind"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    let mut metric_kinds: BTreeMap<String, u64> = BTreeMap::new();
    for s in scrape
        .samples
        .iter()
        .filter(|s| s.metric == "slotprof_findings_total")
    {
        if let prometheus_parse::Value::Counter(v) = s.value {
            metric_kinds.insert(s.labels.get("kind").unwrap().to_string(), v as u64);
        }
    }
    eprintln!("findings.json {by_kind:?}; /metrics {metric_kinds:?}");
    assert!(
        by_kind.contains_key("LockContention"),
        "findings.json has no LockContention: {by_kind:?}"
    );
    assert_eq!(metric_kinds, by_kind, "/metrics and findings.json disagree");
    // The quiet slots stay quiet: LockContention only in the slots where
    // the program waited for its bank lock (its log says which).
    let stray: Vec<Option<u64>> = read_json(&export.join("findings.json"))
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "LockContention")
        .map(|f| f["slot"].as_u64())
        .filter(|n| !n.is_some_and(|n| stalls.contains(&n)))
        .collect();
    assert!(
        stray.is_empty(),
        "LockContention in slots where the program waited for no lock: {stray:?}"
    );
    let lost: f64 = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "slotprof_lost_events_total")
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) => v,
            _ => 0.0,
        })
        .sum();
    assert_eq!(lost, 0.0, "events lost:\n{scrape_text}");
    assert!(scrape
        .samples
        .iter()
        .any(|s| s.metric == "slotprof_slot_duration_seconds"));
    assert!(index.contains("<table"), "/ does not serve the index");

    // After SIGTERM: nothing loaded, nothing half-written.
    assert_eq!(
        slotprof_programs_left(),
        Vec::<String>::new(),
        "BPF programs left loaded"
    );
    assert_eq!(leftovers(&export), Vec::<PathBuf>::new(), "partial files left");
    assert!(!said.contains("error"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn retention_keeps_the_export_under_its_cap_and_sigterm_leaves_it_whole() {
    let Some(_k) = kernel() else { return };
    let dir = scratch("run-retention");
    let export = dir.join("export");
    let (rpc, metrics) = (free_port_pair(), free_port());
    // A slot's directory is ~6.5 KiB here (flamegraphs are drawn only
    // for slots with findings) and the current hour's, which retention
    // never removes, ~85 KiB after 18 s: 37 slots pass 160 KiB twice over.
    const CAP: u64 = 160 << 10;
    let config = write_config(
        &dir,
        &config_text(
            rpc,
            metrics,
            &export,
            "full = \"all\"\nretention_bytes = \"160KiB\"",
        ),
    );
    let mut validator = start_validator(&dir, rpc, 60, &[]);
    let daemon = Daemon::start(&config, &dir);
    let started = Instant::now();
    let (mut peak, mut largest_slot) = (0, 0);
    // Long enough to pass the cap many times over, then SIGTERM while the
    // target still runs.
    let good = std::fs::read_to_string(&config).unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port();
    let mut reloads = 0usize;
    while started.elapsed() < Duration::from_secs(18) {
        peak = peak.max(du(&export));
        for slot in std::fs::read_dir(export.join("slots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            largest_slot = largest_slot.max(du(&slot.path()));
        }
        std::thread::sleep(Duration::from_millis(50));
        // SIGHUP with a bad configuration (refused, the run goes on), then
        // with the good one again.
        let hup = |body: &str| {
            std::fs::write(&config, body).unwrap();
            unsafe { libc::kill(daemon.pid() as i32, libc::SIGHUP) };
        };
        // Files that parse but cannot be applied are refused too, and the
        // daemon goes on (each of these ended it before).
        let unappliable = [
            good.replace("full = \"all\"", "full = \"everything\""),
            good.replace(&format!("127.0.0.1:{metrics}"), &format!("127.0.0.1:{busy_port}")),
            good.replace("comm = \"synthetic-validator\"", "pid = 2147483646"),
            good.replace(
                &format!("source = \"rpc=http://127.0.0.1:{rpc}\""),
                "source = \"uprobe=/bin/true:no_such_function_here\"",
            ),
            good.replace(
                "retention_bytes = \"160KiB\"",
                "retention_bytes = \"160KiB\"\nretention_age = \"99999999999999999999s\"",
            ),
        ];
        let at = Duration::from_millis(8000 + 1000 * reloads as u64);
        if reloads < unappliable.len() && started.elapsed() > at {
            hup(&unappliable[reloads]);
            reloads += 1;
        } else if reloads == unappliable.len() && started.elapsed() > at {
            hup(&good);
            reloads += 1;
        }
    }
    let slots_written = std::fs::read_dir(export.join("slots")).unwrap().count();
    let (status, said) = daemon.stop();
    let _ = validator.kill();
    assert!(
        said.contains("the new configuration is refused") && said.contains("export.full: \"everything\""),
        "a bad configuration on SIGHUP was not refused with its reason"
    );
    for reason in [
        format!("cannot listen on 127.0.0.1:{busy_port}"),
        "target.pid = 2147483646".to_string(),
        "no function named \"no_such_function_here\"".to_string(),
        "is too long: at most 3650d".to_string(),
    ] {
        assert!(
            said.contains(&reason),
            "an unappliable configuration on SIGHUP was not refused with {reason:?}:\n{said}"
        );
    }
    drop(busy);
    assert!(said.contains("configuration reloaded"), "SIGHUP did not reload");
    let _ = validator.wait();
    assert!(status.success(), "slotprof run exited with {status}");
    let end = du(&export);
    eprintln!(
        "export: peak {peak} bytes while running, {end} at the end, cap {CAP}; {slots_written} slot directories kept, the largest {largest_slot} bytes"
    );
    // It did pass the cap's worth of slots (else the test proves nothing).
    assert!(slots_written >= 5, "too few slots exported: {slots_written}");
    assert!(end <= CAP, "export {end} bytes over the {CAP}-byte cap");
    // While running, at most one slot's directory over, for the instant
    // between writing it and removing the oldest.
    assert!(
        peak <= CAP + largest_slot,
        "export reached {peak} bytes (cap {CAP}, the largest slot {largest_slot})"
    );
    let passed: usize = std::fs::read_dir(export.join("hours"))
        .unwrap()
        .flatten()
        .map(|h| {
            std::fs::read_to_string(h.path().join("slots.jsonl"))
                .unwrap_or_default()
                .lines()
                .count()
        })
        .sum();
    let kept = export.join("slots").read_dir().unwrap().count();
    eprintln!("{passed} slots passed, {kept} kept");
    assert!(
        kept < passed,
        "retention removed nothing ({kept} of {passed} slots kept)"
    );
    assert_eq!(
        slotprof_programs_left(),
        Vec::<String>::new(),
        "BPF programs left loaded"
    );
    assert_eq!(leftovers(&export), Vec::<PathBuf>::new(), "partial files left");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The capabilities the systemd unit bounds slotprof to, as setpriv
/// spells them (`+bpf,+perfmon,...`), read from the unit itself.
fn unit_capabilities() -> String {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../profiler/packaging/slotprof.service"
    ))
    .expect("the unit file");
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet= in the unit");
    line.split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_ascii_lowercase()))
        .collect::<Vec<_>>()
        .join(",")
}

/// What systemd would be told on `$NOTIFY_SOCKET`: every datagram, with
/// when it came.
struct Notifications {
    got: std::sync::Arc<std::sync::Mutex<Vec<(std::time::Instant, String)>>>,
}

impl Notifications {
    fn listen(path: &Path) -> Self {
        let socket = std::os::unix::net::UnixDatagram::bind(path).expect("bind the notify socket");
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = got.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                sink.lock().unwrap().push((std::time::Instant::now(), text));
            }
        });
        Self { got }
    }

    /// Waits up to `within` for a message holding `line` after the first
    /// `after` messages; returns its index.
    fn wait_for(&self, line: &str, after: usize, within: Duration) -> Option<usize> {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            let got = self.got.lock().unwrap();
            if let Some(i) = got
                .iter()
                .skip(after)
                .position(|(_, m)| m.lines().any(|l| l == line))
            {
                return Some(after + i);
            }
            drop(got);
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn all(&self) -> Vec<String> {
        self.got.lock().unwrap().iter().map(|(_, m)| m.clone()).collect()
    }
}

/// The systemd unit's sandbox, without systemd (this machine has no
/// systemd as PID 1): `slotprof run` as root bounded to exactly the unit's
/// CapabilityBoundingSet with no new privileges (setpriv), told to notify
/// a socket of the test's as `Type=notify` does. READY=1 comes once the
/// probes are attached (the metrics answer then and say attached),
/// RELOADING=1 then READY=1 around a SIGHUP, WATCHDOG=1 at half of
/// WATCHDOG_USEC, STOPPING=1 at SIGTERM; the slots are exported. Its twin
/// without CAP_BPF (and CAP_SYS_ADMIN) fails at start naming CAP_BPF and
/// never says READY, as `systemctl start` would report.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn the_units_capabilities_suffice_and_systemd_hears_ready_reload_watchdog_and_stop() {
    let Some(_k) = kernel() else { return };
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip(
            Need::Tool("setpriv"),
            "needs setpriv (util-linux) to bound the capabilities",
        );
        return;
    }
    let dir = scratch("unit");
    let export = dir.join("export");
    let (rpc, metrics) = (free_port_pair(), free_port());
    let config = write_config(&dir, &config_text(rpc, metrics, &export, "full = \"all\""));
    let caps = unit_capabilities();
    eprintln!("the unit's capabilities: {caps}");

    // Without CAP_BPF and CAP_SYS_ADMIN: refused at start, no READY.
    let lacking: String = caps
        .split(',')
        .filter(|c| *c != "+bpf" && *c != "+sys_admin")
        .collect::<Vec<_>>()
        .join(",");
    let sock = dir.join("notify-lacking");
    let heard = Notifications::listen(&sock);
    let bounding = format!("-all,{lacking}");
    let o = Command::new("setpriv")
        .args(["--bounding-set", &bounding, "--no-new-privs"])
        .arg(slotprof())
        .args(["run", "--config", config.to_str().unwrap()])
        .env("NOTIFY_SOCKET", &sock)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "started without CAP_BPF: {said}");
    assert!(said.contains("CAP_BPF") && said.contains("setcap"), "{said}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !heard.all().iter().any(|m| m.contains("READY=1")),
        "{:?}",
        heard.all()
    );

    // With the unit's set: the whole life of a unit.
    let sock = dir.join("notify");
    let heard = Notifications::listen(&sock);
    let mut validator = start_validator(&dir, rpc, 25, &[]);
    let bounding = format!("-all,{caps}");
    let sock_s = sock.to_str().unwrap().to_string();
    let daemon = Daemon::start_with(
        &config,
        &dir,
        &["setpriv", "--bounding-set", &bounding, "--no-new-privs"],
        &[("NOTIFY_SOCKET", &sock_s), ("WATCHDOG_USEC", "1000000")],
    );
    let ready = heard.wait_for("READY=1", 0, Duration::from_secs(60 * time_scale()));
    let ready = ready.unwrap_or_else(|| panic!("no READY=1: {:?}", heard.all()));
    assert!(
        heard.all()[ready].contains("STATUS=profiling "),
        "{:?}",
        heard.all()
    );
    let text = http_get(metrics, "/metrics");
    assert!(text.contains("slotprof_target_attached 1"), "{text}");
    // CapEff of the daemon is the unit's set, nothing more.
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid())).unwrap_or_default();
    eprintln!(
        "{}",
        status
            .lines()
            .filter(|l| l.starts_with("Cap"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    std::thread::sleep(Duration::from_secs(2));
    unsafe { libc::kill(daemon.pid() as i32, libc::SIGHUP) };
    let reloading = heard
        .wait_for("RELOADING=1", ready + 1, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no RELOADING=1 after SIGHUP: {:?}", heard.all()));
    assert!(
        heard.all()[reloading].contains("MONOTONIC_USEC="),
        "{:?}",
        heard.all()
    );
    heard
        .wait_for("READY=1", reloading + 1, Duration::from_secs(30 * time_scale()))
        .unwrap_or_else(|| panic!("no READY=1 after the reload: {:?}", heard.all()));
    let _ = validator.wait();
    std::thread::sleep(Duration::from_millis(1500));
    let (status, said) = daemon.stop();
    assert!(status.success(), "slotprof run exited with {status}: {said}");
    heard
        .wait_for("STOPPING=1", 0, Duration::from_secs(5))
        .unwrap_or_else(|| panic!("no STOPPING=1: {:?}", heard.all()));
    let pings = heard.all().iter().filter(|m| m.as_str() == "WATCHDOG=1").count();
    // 25 slots of 400 ms and more at one ping per 0.5 s.
    assert!(pings >= 10, "{pings} watchdog pings: {:?}", heard.all());
    let slots = std::fs::read_dir(export.join("slots")).map_or(0, |d| d.count());
    assert!(
        slots >= 10,
        "{slots} slots exported under the unit's capabilities"
    );
    assert!(!said.contains("did not attach"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The packaged unit, byte for byte, under real systemd as PID 1. This
/// machine has none (its PID 1 is a sandbox's), so `cargo xtask test-vm`
/// boots a test VM with systemd as init for it (group "systemd"); anywhere
/// else the test says so and is skipped. It installs the unit, slotprof
/// and a configuration as the unit's header says, and checks what an
/// operator relies on: `systemctl start` fails when the probes cannot
/// attach (the unit without CAP_BPF) and returns once they are (active,
/// running, the status line), the sandbox is on (capabilities exactly the
/// unit's set, no new privileges, a seccomp filter, a mount namespace of
/// its own), the metrics answer over the unit's IP allow-list, slots are
/// exported into its StateDirectory, the watchdog is fed, `systemctl
/// reload` re-reads the file (a good one and a bad one, which is refused
/// while the daemon stays up), and `systemctl stop` ends it cleanly with no
/// BPF program left.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn the_packaged_unit_starts_profiles_reloads_and_stops_under_systemd() {
    let Some(_k) = kernel() else { return };
    let pid1 = std::fs::read_to_string("/proc/1/comm").unwrap_or_default();
    let pid1 = pid1.trim();
    if pid1 != "systemd" || std::env::var_os("SLOTPROF_TEST_UNDER_SYSTEMD").is_none() {
        skip(
            Need::Elsewhere,
            format!(
                "needs systemd as PID 1 (here PID 1 is {pid1:?}) and installs a unit: the test VM \
                 booted with systemd runs it (`sudo cargo xtask test-vm --test the_packaged_unit`)"
            ),
        );
        return;
    }
    let unit = include_str!("../../profiler/packaging/slotprof.service");
    let rpc = free_port_pair();
    let installed = InstalledUnit::install(unit, rpc);
    let log = Path::new(InstalledUnit::LOG);

    // Without CAP_BPF (and CAP_SYS_ADMIN): `systemctl start` must fail.
    let caps = unit_capabilities_named(unit);
    let lacking: Vec<&str> = caps
        .iter()
        .map(|c| c.as_str())
        .filter(|c| *c != "CAP_BPF" && *c != "CAP_SYS_ADMIN")
        .collect();
    installed.drop_in(
        "lacking",
        &format!(
            "[Service]\nCapabilityBoundingSet=~CAP_BPF CAP_SYS_ADMIN\nAmbientCapabilities=\n\
             AmbientCapabilities={}\nRestart=no\n",
            lacking.join(" ")
        ),
    );
    let dir = scratch("systemd");
    let scale = time_scale() as u32;
    let mut validator = start_validator(&dir, rpc, 60 * scale, &[]);
    let start = systemctl(&["start", "slotprof"]);
    let said = std::fs::read_to_string(log).unwrap_or_default();
    eprintln!("systemctl start without CAP_BPF: {start:?}\n{said}");
    assert!(
        !start.0,
        "systemctl start succeeded without CAP_BPF: {start:?}\n{said}"
    );
    assert!(said.contains("CAP_BPF"), "the log does not name CAP_BPF: {said}");
    assert_eq!(show("slotprof", "ActiveState"), "failed");
    installed.remove_drop_in("lacking");
    systemctl(&["reset-failed", "slotprof"]);

    // With the unit as shipped.
    let t = std::time::Instant::now();
    let start = systemctl(&["start", "slotprof"]);
    let said = std::fs::read_to_string(log).unwrap_or_default();
    assert!(start.0, "systemctl start slotprof failed: {start:?}\n{said}");
    eprintln!(
        "systemctl start returned after {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(show("slotprof", "ActiveState"), "active", "{said}");
    assert_eq!(show("slotprof", "SubState"), "running", "{said}");
    let status = show("slotprof", "StatusText");
    assert!(status.starts_with("profiling "), "StatusText={status}");
    let main_pid: u32 = show("slotprof", "MainPID").parse().unwrap();
    assert!(main_pid > 0);
    // The sandbox is on.
    let proc_status = std::fs::read_to_string(format!("/proc/{main_pid}/status")).unwrap();
    let field = |name: &str| {
        proc_status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let want = format!("{:016x}", capability_mask(&caps));
    eprintln!(
        "slotprof (pid {main_pid}): CapEff {} CapBnd {} NoNewPrivs {} Seccomp {}",
        field("CapEff:"),
        field("CapBnd:"),
        field("NoNewPrivs:"),
        field("Seccomp:")
    );
    assert_eq!(field("CapBnd:"), want, "the bounding set is not the unit's");
    assert_eq!(field("CapEff:"), want, "the effective set is not the unit's");
    assert_eq!(field("NoNewPrivs:"), "1");
    assert_eq!(field("Seccomp:"), "2", "no seccomp filter (SystemCallFilter)");
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    assert_ne!(
        ns(&main_pid.to_string()),
        ns("self"),
        "no mount namespace of its own (ProtectSystem, PrivateTmp)"
    );
    // The metrics, from outside the unit, through its IP allow-list.
    let metrics = http_get(installed.metrics, "/metrics");
    assert!(metrics.contains("slotprof_target_attached 1"), "{metrics}");
    // Slots land in the StateDirectory.
    let slots = Path::new("/var/lib/slotprof/slots");
    let count = || std::fs::read_dir(slots).map_or(0, |d| d.count());
    let until = std::time::Instant::now() + Duration::from_secs(60 * time_scale());
    while count() < 5 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
    }
    let before_reload = count();
    assert!(
        before_reload >= 5,
        "{before_reload} slots exported in 60 s: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    // The watchdog is fed (systemd stamps each WATCHDOG=1 it hears).
    let fed = show("slotprof", "WatchdogTimestampMonotonic");
    assert!(
        fed.parse::<u64>().is_ok_and(|us| us > 0),
        "systemd heard no watchdog ping: WatchdogTimestampMonotonic={fed}"
    );
    // A good reload: the same process, still running, still exporting.
    let reload = systemctl(&["reload", "slotprof"]);
    assert!(reload.0, "systemctl reload failed: {reload:?}");
    assert_eq!(show("slotprof", "MainPID"), main_pid.to_string());
    assert_eq!(show("slotprof", "ActiveState"), "active");
    // A bad file: refused, said, and the daemon stays.
    std::fs::write(InstalledUnit::CONFIG, "[target\n").unwrap();
    let reload = systemctl(&["reload", "slotprof"]);
    eprintln!("systemctl reload with a bad file: {reload:?}");
    std::thread::sleep(Duration::from_millis(500));
    let said = std::fs::read_to_string(log).unwrap_or_default();
    assert!(
        said.contains("the new configuration is refused"),
        "the bad file was not refused in the log: {said}"
    );
    assert_eq!(show("slotprof", "MainPID"), main_pid.to_string());
    assert_eq!(show("slotprof", "ActiveState"), "active");
    assert!(
        show("slotprof", "StatusText").contains("refused"),
        "StatusText does not say the file was refused"
    );
    installed.write_config();
    let until = std::time::Instant::now() + Duration::from_secs(30 * time_scale());
    while count() < before_reload + 3 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
    }
    let after = count();
    assert!(
        after >= before_reload + 3,
        "exports stopped after the reloads: {before_reload} -> {after}"
    );
    // Kernel frames are named: /proc/kallsyms shows the unit its addresses
    // (CAP_SYSLOG kept; ProtectKernelLogs=yes would drop it).
    let (mut named, mut unnamed) = (0usize, 0usize);
    for e in std::fs::read_dir(slots).unwrap().flatten() {
        let read = |name: &str| std::fs::read_to_string(e.path().join(name)).unwrap_or_default();
        let text = read("offcpu.folded") + &read("oncpu.folded");
        for frame in text
            .lines()
            .filter_map(|l| l.rsplit_once(' ').map(|(s, _)| s))
            .flat_map(|s| s.split(';'))
            .filter(|f| f.ends_with("_[k]") && !f.contains("not walked"))
        {
            if frame.starts_with("[unknown]") {
                unnamed += 1;
            } else {
                named += 1;
            }
        }
    }
    eprintln!("kernel frames in the exported stacks: {named} named, {unnamed} unnamed");
    assert!(
        named > 0 && unnamed * 10 <= named + unnamed,
        "kernel frames under the unit: {named} named, {unnamed} [unknown]: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    // Stop: clean, nothing left in the kernel.
    let stop = systemctl(&["stop", "slotprof"]);
    assert!(stop.0, "systemctl stop failed: {stop:?}");
    assert_eq!(show("slotprof", "ActiveState"), "inactive");
    assert_eq!(show("slotprof", "Result"), "success");
    assert_eq!(show("slotprof", "NRestarts"), "0");
    let left = slotprof_programs_left();
    assert!(
        left.is_empty(),
        "BPF programs left after systemctl stop: {left:?}"
    );
    eprintln!(
        "under systemd: start, {after} slots exported, two reloads (one refused), stop; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let _ = validator.kill();
    let _ = validator.wait();
    drop(installed);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `systemctl ARGS`: (succeeded, what it said).
fn systemctl(args: &[&str]) -> (bool, String) {
    let o = Command::new("systemctl")
        .args(args)
        .output()
        .expect("run systemctl");
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// One property of a unit (`systemctl show -p NAME --value`).
fn show(unit: &str, property: &str) -> String {
    systemctl(&["show", "-p", property, "--value", unit])
        .1
        .trim()
        .to_string()
}

/// The capabilities of the unit's CapabilityBoundingSet line.
fn unit_capabilities_named(unit: &str) -> Vec<String> {
    unit.lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet= in the unit")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The bit mask of capability names, as /proc/PID/status prints them.
fn capability_mask(caps: &[String]) -> u64 {
    caps.iter()
        .map(|c| {
            let bit = match c.as_str() {
                "CAP_DAC_READ_SEARCH" => 2,
                "CAP_SYS_PTRACE" => 19,
                "CAP_SYS_ADMIN" => 21,
                "CAP_SYS_RESOURCE" => 24,
                "CAP_SYSLOG" => 34,
                "CAP_PERFMON" => 38,
                "CAP_BPF" => 39,
                other => panic!("a capability this test does not know: {other}"),
            };
            1u64 << bit
        })
        .fold(0, |a, b| a | b)
}

/// The unit installed as its header says (binary, configuration, unit
/// file), with a drop-in that sends its output to a file (the test VM has
/// no journald); stopped and removed again when dropped, also when a check
/// fails.
struct InstalledUnit {
    metrics: u16,
    rpc: u16,
}

impl InstalledUnit {
    const CONFIG: &'static str = "/etc/slotprof/slotprof.toml";
    const UNIT: &'static str = "/etc/systemd/system/slotprof.service";
    const DROP_INS: &'static str = "/etc/systemd/system/slotprof.service.d";
    const BIN: &'static str = "/usr/local/bin/slotprof";
    const LOG: &'static str = "/run/slotprof-unit.log";

    fn install(unit: &str, rpc: u16) -> InstalledUnit {
        for d in ["/usr/local/bin", "/etc/slotprof", Self::DROP_INS] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::copy(slotprof(), Self::BIN).unwrap();
        std::fs::write(Self::UNIT, unit).unwrap();
        let me = InstalledUnit {
            metrics: free_port(),
            rpc,
        };
        me.write_config();
        me.drop_in(
            "output",
            &format!("[Service]\nStandardOutput=append:{}\n", Self::LOG),
        );
        me
    }

    /// The configuration: the synthetic validator over its RPC, every slot
    /// exported into the unit's StateDirectory (/var/lib/slotprof).
    fn write_config(&self) {
        let text = config_text(
            self.rpc,
            self.metrics,
            Path::new("/var/lib/slotprof"),
            "full = \"all\"\nfree_space_floor = \"64MiB\"",
        );
        std::fs::write(Self::CONFIG, text).unwrap();
    }

    fn drop_in(&self, name: &str, text: &str) {
        std::fs::write(format!("{}/{name}.conf", Self::DROP_INS), text).unwrap();
        assert!(systemctl(&["daemon-reload"]).0, "systemctl daemon-reload failed");
    }

    fn remove_drop_in(&self, name: &str) {
        let _ = std::fs::remove_file(format!("{}/{name}.conf", Self::DROP_INS));
        assert!(systemctl(&["daemon-reload"]).0, "systemctl daemon-reload failed");
    }
}

impl Drop for InstalledUnit {
    fn drop(&mut self) {
        systemctl(&["stop", "slotprof"]);
        systemctl(&["reset-failed", "slotprof"]);
        let _ = std::fs::remove_dir_all(Self::DROP_INS);
        let _ = std::fs::remove_file(Self::UNIT);
        let _ = std::fs::remove_file(Self::CONFIG);
        let _ = std::fs::remove_file(Self::BIN);
        systemctl(&["daemon-reload"]);
    }
}

/// CacheLinePingPong in `slotprof run`: per leader window (four slots'
/// samples together; one slot's are too few), placed in the window's last
/// slot. Against `stall-false-sharing` (two threads bumping adjacent
/// counters on one line) with every slot a leader slot at 499 Hz: the
/// program's shared line is found; its padded twin gives nothing.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn cache_line_ping_pong_is_found_per_leader_window_and_the_padded_twin_is_clean() {
    let Some(_k) = kernel() else { return };
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(Need::Cpus(2), "ping-pong needs two CPUs");
        return;
    }
    for padded in [false, true] {
        let dir = scratch(if padded {
            "run-pingpong-padded"
        } else {
            "run-pingpong"
        });
        let export = dir.join("export");
        let config = write_config(
            &dir,
            &format!(
                "[target]\ncomm = \"stall-false-sharing\"\n[sampling]\nfrequency_hz = 499\n\
                 [slots]\nsource = \"clock=400ms,leader=4/4\"\n[export]\ndir = \"{}\"\nfull = \"all\"\n\
                 [metrics]\nlisten = \"127.0.0.1:{}\"\n[phase_probe]\nenabled = false\n",
                export.display(),
                free_port()
            ),
        );
        let report = dir.join("truth.json");
        let seconds = (8 * time_scale()).to_string();
        let mut args = vec!["--mode", "counters", "--seconds", &seconds, "--report"];
        args.push(report.to_str().unwrap());
        if padded {
            args.push("--padded");
        }
        let mut program = Command::new(stall_program("stall-false-sharing"))
            .args(&args)
            .spawn()
            .expect("start stall-false-sharing");
        let daemon = Daemon::start(&config, &dir);
        let status = program.wait().unwrap();
        assert!(status.success(), "stall-false-sharing: {status}");
        // The last window's slots end, then the grace before a slot is
        // processed.
        std::thread::sleep(Duration::from_secs(3));
        let (status, said) = daemon.stop();
        assert!(status.success(), "slotprof run: {status}: {said}");
        let truth = read_json(&report);
        let found: Vec<serde_json::Value> = read_json(&export.join("findings.json"))
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["kind"] == "CacheLinePingPong")
            .cloned()
            .collect();
        eprintln!(
            "padded {padded}: {} CacheLinePingPong findings in slots {:?}",
            found.len(),
            found.iter().map(|f| f["slot"].as_u64()).collect::<Vec<_>>()
        );
        if padded {
            assert!(found.is_empty(), "the padded twin: {found:?}");
        } else {
            let line = truth["shared_line"].as_u64().unwrap();
            let on_line = found
                .iter()
                .filter(|f| f["magnitudes"]["line"].as_f64().map(|l| l as u64) == Some(line))
                .count();
            assert!(on_line >= 1, "no finding on the shared line {line:#x}: {found:?}");
            // Precision: every finding is on the program's shared line.
            assert_eq!(on_line, found.len(), "findings on other lines: {found:?}");
            // In a window's last slot (leader=4/4 from the session's
            // origin: windows are slots 4k..4k+3).
            for f in &found {
                let slot = f["slot"].as_u64().expect("a slot");
                assert_eq!(slot % 4, 3, "not a window's last slot: {f}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
