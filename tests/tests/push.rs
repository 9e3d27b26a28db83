//! `slotprof run` pushing to a fleet's profiling backend, against local
//! receivers that decode what arrives with the published formats:
//! Pyroscope's ingest request (`POST /ingest?name=...&from=...&until=...
//! &format=pprof`, the gzipped pprof in a multipart form's `profile`
//! field) and OTLP profiles over HTTP (`ExportProfilesServiceRequest`,
//! decoded with the OpenTelemetry proto package's messages).
//!
//! What arrives must equal what was written to disk: every slot's
//! samples (by profile type, stack, thread, CPU, slot, leader) in the
//! pushed profiles are exactly those of its `slots/<n>/profile.pb.gz`.
//! Receivers that are down, slow (10 s a request) or fail (500) for a
//! while must leave profiling as it was: the same slots exported, the
//! queues within their bound, the counts in /metrics.

mod common;

/// The application name slotprof pushes for the synthetic validator.
const APP: &str = "synthetic-validator";

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant},
};

use common::{pushed::*, *};
use slotprof_tests::http_receiver::{HttpReceiver, Request};

/// The slots the synthetic validator ran, but its last (the RPC never
/// sees it end).
fn truth_slots(dir: &Path) -> Vec<i64> {
    let truth = read_json(&dir.join("truth.json"));
    let slots: Vec<i64> = truth["slots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["slot"].as_i64().unwrap())
        .collect();
    slots[..slots.len() - 1].to_vec()
}

/// `go tool pprof` reads the always-on export's profiles (every hour's
/// and window's, the first slots') and every pushed Pyroscope profile.
fn go_tool_pprof_reads(test: &str, export: &Path, pushed: &[(Request, u16)]) {
    let Some(go) = go_binary() else {
        eprintln!("{test}: go tool pprof not run: no Go toolchain (apt-get install golang-go; `cargo xtask test` does)");
        return;
    };
    let mut files = Vec::new();
    for sub in ["hours", "windows"] {
        for e in std::fs::read_dir(export.join(sub)).unwrap().flatten() {
            files.push(e.path().join("profile.pb.gz"));
        }
    }
    let mut slots: Vec<_> = std::fs::read_dir(export.join("slots"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    slots.sort();
    files.extend(slots.iter().take(3).map(|d| d.join("profile.pb.gz")));
    let dir = export.parent().unwrap().join("pushed");
    std::fs::create_dir_all(&dir).unwrap();
    for (i, (req, _)) in pushed.iter().enumerate() {
        let f = dir.join(format!("{i}.pb.gz"));
        std::fs::write(&f, multipart_profile(req)).unwrap();
        files.push(f);
    }
    for f in &files {
        let raw = go_pprof(&go, &["-raw", f.to_str().unwrap()]);
        assert!(raw.contains("Samples:"), "{}: {raw}", f.display());
        go_pprof(&go, &["-top", f.to_str().unwrap()]);
    }
    row(
        test,
        "go tool pprof reads the export's and the pushed profiles",
        &format!("{} files", files.len()),
        "all",
        true,
    );
}

/// Every slot the validator ran is on disk (after it exits, the RPC
/// source may add a slot or two it estimates: those are exported too).
fn assert_slots_exported(test: &str, on_disk: &[i64], expected: &[i64]) {
    let missing: Vec<i64> = expected
        .iter()
        .filter(|s| !on_disk.contains(s))
        .copied()
        .collect();
    assert!(
        row(
            test,
            "the validator's slots exported to disk",
            &format!(
                "{} of {} ({} in all)",
                expected.len() - missing.len(),
                expected.len(),
                on_disk.len()
            ),
            "all",
            missing.is_empty()
        ),
        "profiling changed: slots {missing:?} were not exported"
    );
}

/// The synthetic validator's identity, as its RPC fixture gives it
/// (None while it is not up yet).
fn identity_of(rpc: u16) -> Option<String> {
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"getIdentity"}"#;
    let r = http_exchange(
        rpc,
        &format!(
            "POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )?;
    let json: serde_json::Value = serde_json::from_str(r.split_once("\r\n\r\n")?.1).ok()?;
    Some(json["result"]["identity"].as_str()?.to_string())
}

/// /metrics, when it answers.
fn try_scrape(port: u16) -> Option<BTreeMap<String, f64>> {
    http_exchange(
        port,
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .filter(|r| r.starts_with("HTTP/1.1 200"))?;
    Some(scrape(port))
}

/// One `slotprof run` session over `slots` slots with `[push]` set to
/// `push`: scrapes /metrics while the validator runs and until the target
/// is detached and the queues are empty (or `settle` passed); returns the
/// scrapes, the identity, the truth's slots, and what slotprof said.
struct Session {
    scrapes: Vec<BTreeMap<String, f64>>,
    identity: String,
    expected: Vec<i64>,
    said: String,
    export: std::path::PathBuf,
}

fn session(test: &str, slots: u32, push: &str, settle: Duration) -> Session {
    let dir = scratch(test);
    let export = dir.join("export");
    let (rpc, metrics) = (free_port_pair(), free_port());
    let config = write_config(
        &dir,
        &format!(
            "{}[push]\n{push}\n[push.labels]\ncluster = \"e2e\"\n[push.headers]\nX-Scope-OrgID = \"e2e-tenant\"\n",
            config_text(rpc, metrics, &export, "full = \"all\"")
        ),
    );
    let mut validator = start_validator(&dir, rpc, slots, &[]);
    let mut daemon = Daemon::start(&config, &dir);
    let mut scrapes = Vec::new();
    let mut identity = None;
    while validator.try_wait().unwrap().is_none() {
        if identity.is_none() {
            identity = identity_of(rpc);
        }
        if let Some(m) = try_scrape(metrics) {
            scrapes.push(m);
        }
        assert!(daemon.running(), "slotprof run died");
        std::thread::sleep(Duration::from_millis(250));
    }
    let until = Instant::now() + settle;
    loop {
        let m = scrape(metrics);
        let detached = m.get("slotprof_target_attached{}") == Some(&0.0);
        let empty = m
            .iter()
            .filter(|(k, _)| k.starts_with("slotprof_push_queue_bytes"))
            .all(|(_, v)| *v == 0.0);
        scrapes.push(m);
        if (detached && empty) || Instant::now() > until {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let (status, said) = daemon.stop();
    assert!(status.success(), "slotprof run exited with {status}");
    Session {
        scrapes,
        identity: identity.expect("the fixture's identity"),
        expected: truth_slots(&dir),
        said,
        export,
    }
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn pushed_profiles_equal_each_slot_on_disk_in_pyroscope_and_otlp() {
    let Some(_k) = kernel() else { return };
    let test = "pushed_profiles_equal_each_slot_on_disk";
    let (pyro, otlp) = (receiver(200, Duration::ZERO), receiver(200, Duration::ZERO));
    let s = session(
        "push-healthy",
        30,
        &format!(
            "pyroscope = \"http://127.0.0.1:{}\"\notlp = \"http://127.0.0.1:{}\"\nevery = \"2s\"",
            pyro.port, otlp.port
        ),
        Duration::from_secs(30),
    );
    let (disk, on_disk) = disk_content(&s.export);
    assert_slots_exported(test, &on_disk, &s.expected);
    let (pyro_reqs, otlp_reqs) = (pyro.requests(), otlp.requests());
    let pushed = pyroscope_content(&pyro_reqs, APP, Some(&s.identity));
    let otlp_got = otlp_received(&otlp_reqs, APP, Some(&s.identity));
    let sizes: Vec<usize> = pyro_reqs.iter().map(|(r, _)| r.body.len()).collect();
    eprintln!(
        "{} Pyroscope requests ({sizes:?} bytes), {} OTLP requests; {} slots, {} (slot, type, stack, labels) keys on disk",
        pyro_reqs.len(),
        otlp_reqs.len(),
        on_disk.len(),
        disk.len()
    );
    let last = s.scrapes.last().unwrap();
    for (ep, reqs) in [("pyroscope", &pyro_reqs), ("otlp", &otlp_reqs)] {
        let n = metric(last, &key("slotprof_push_batches_total", ep, Some("pushed")));
        assert!(
            row(
                test,
                &format!("{ep}: batches pushed (metrics) = requests received"),
                &format!("{n} vs {}", reqs.len()),
                "equal",
                n == reqs.len() as f64
            ),
            "{ep}: /metrics says {n} pushed, the receiver got {}",
            reqs.len()
        );
        for r in ["dropped", "rejected"] {
            assert_eq!(
                metric(last, &key("slotprof_push_batches_total", ep, Some(r))),
                0.0,
                "{ep} {r}"
            );
        }
        assert_eq!(
            metric(last, &key("slotprof_push_failed_attempts_total", ep, None)),
            0.0,
            "{ep}"
        );
    }
    assert!(
        pyro_reqs.len() >= 4,
        "a batch every 2 s of 12 s of slots: {} requests",
        pyro_reqs.len()
    );
    assert_eq!(slots_of(&pushed), on_disk, "the slots pushed to Pyroscope");
    assert!(
        row(
            test,
            "Pyroscope: every slot's samples equal its profile on disk",
            &format!("{} keys vs {}", pushed.len(), disk.len()),
            "equal",
            pushed == disk
        ),
        "what Pyroscope got differs from the disk: {}",
        differences(&pushed, &disk)
    );
    assert!(
        row(
            test,
            "OTLP: every slot's samples equal its profile on disk",
            &format!("{} keys vs {}", otlp_got.len(), disk.len()),
            "equal",
            otlp_got == disk
        ),
        "what the OTLP receiver got differs from the disk: {}",
        differences(&otlp_got, &disk)
    );
    // Python's OpenTelemetry proto package reads the same.
    match otlp_content_by_python(&otlp_reqs, &s.export.parent().unwrap().join("otlp")) {
        Ok(c) => assert!(
            row(
                test,
                "OTLP read by Python's opentelemetry-proto: equal to the disk",
                &format!("{} keys vs {}", c.len(), disk.len()),
                "equal",
                c == disk
            ),
            "Python's decoding differs from the disk: {}",
            differences(&c, &disk)
        ),
        Err(why) => eprintln!("{test}: OTLP not decoded by Python's opentelemetry-proto: {why}"),
    }
    // The configured header came with every request.
    for (r, _) in pyro_reqs.iter().chain(&otlp_reqs) {
        assert_eq!(r.header("x-scope-orgid"), Some("e2e-tenant"), "{}", r.target);
    }
    go_tool_pprof_reads(test, &s.export, &pyro_reqs);
    // The samples carry their thread and CPU, and on-CPU time is there.
    assert!(disk
        .keys()
        .any(|k| k.1 == "cpu/nanoseconds" && k.3.iter().any(|l| l.starts_with("cpu="))));
    assert!(disk
        .keys()
        .any(|k| k.3.iter().any(|l| l == "thread_name=bank-loop")));
    assert!(
        !s.said.contains(" failed (") && !s.said.contains("refused"),
        "no failure to say of a healthy push: {}",
        s.said
    );
    assert!(
        s.said.contains(&format!(
            "push to otlp http://127.0.0.1:{}/v1development/profiles: {} batches pushed, 0 dropped",
            otlp.port,
            otlp_reqs.len()
        )),
        "the counts are said at the end: {}",
        s.said
    );
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_receiver_down_or_slow_costs_its_bounded_queue_and_nothing_else() {
    let Some(_k) = kernel() else { return };
    let test = "a_receiver_down_or_slow";
    // Nothing listens on `down`.
    let down = free_port();
    let slow = receiver(200, Duration::from_secs(10));
    let queue = 4 << 10;
    let s = session(
        "push-down-slow",
        30,
        &format!(
            "pyroscope = \"http://127.0.0.1:{down}\"\notlp = \"http://127.0.0.1:{}\"\nevery = \"1s\"\nqueue = \"4KiB\"\ntimeout = \"30s\"",
            slow.port
        ),
        Duration::from_secs(3),
    );
    let (disk, on_disk) = disk_content(&s.export);
    assert_slots_exported(test, &on_disk, &s.expected);
    let last = s.scrapes.last().unwrap();
    assert_eq!(
        metric(last, "slotprof_slots_not_exported_total{reason=write_failed}"),
        0.0
    );
    // The queues never held more than their bound.
    let peak = |ep: &str| {
        s.scrapes
            .iter()
            .filter_map(|m| m.get(&key("slotprof_push_queue_bytes", ep, None)).copied())
            .fold(0.0, f64::max)
    };
    for ep in ["pyroscope", "otlp"] {
        assert_eq!(
            metric(last, &key("slotprof_push_queue_limit_bytes", ep, None)),
            queue as f64
        );
        assert!(
            row(
                test,
                &format!("{ep}: peak queue bytes"),
                &format!("{}", peak(ep)),
                &format!("<= {queue}"),
                peak(ep) <= queue as f64
            ),
            "{ep}'s queue held {} bytes, over its bound {queue}",
            peak(ep)
        );
    }
    // Down: every attempt failed, nothing pushed; the queue filled and
    // dropped its oldest.
    let failed = metric(
        last,
        &key("slotprof_push_failed_attempts_total", "pyroscope", None),
    );
    let pushed = metric(
        last,
        &key("slotprof_push_batches_total", "pyroscope", Some("pushed")),
    );
    let dropped = metric(
        last,
        &key("slotprof_push_batches_total", "pyroscope", Some("dropped")),
    );
    assert!(
        row(
            test,
            "down: failed attempts, pushed, dropped",
            &format!("{failed}, {pushed}, {dropped}"),
            ">= 3, 0, >= 1",
            failed >= 3.0 && pushed == 0.0 && dropped >= 1.0
        ),
        "down: {failed} failed attempts, {pushed} pushed, {dropped} dropped"
    );
    let said_down = s
        .said
        .matches(&format!("push to pyroscope http://127.0.0.1:{down}/ failed"))
        .count();
    assert_eq!(said_down, 1, "the failure is said once: {}", s.said);
    // Slow: the receiver took a batch every 10 s; what it took equals
    // the disk for its slots.
    let got = slow.requests();
    let otlp_got = otlp_received(&got, APP, Some(&s.identity));
    let pushed_slots = slots_of(&otlp_got);
    let otlp_pushed = metric(last, &key("slotprof_push_batches_total", "otlp", Some("pushed")));
    assert!(
        row(
            test,
            "slow: batches taken",
            &format!("{} (metrics {otlp_pushed})", got.len()),
            ">= 1",
            !got.is_empty()
        ),
        "the slow receiver got nothing"
    );
    assert!(!pushed_slots.is_empty());
    assert_eq!(
        otlp_got,
        only(&disk, &pushed_slots),
        "what the slow receiver took differs from the disk"
    );
    let rss_mib = |m: &BTreeMap<String, f64>| {
        m.get("process_resident_memory_bytes{}").copied().unwrap_or(0.0) / (1 << 20) as f64
    };
    let peak_rss = s.scrapes.iter().map(rss_mib).fold(0.0, f64::max);
    eprintln!(
        "down: {failed} failed attempts, {dropped} batches dropped, peak queue {} bytes; slow: {} taken, slots {:?}; peak RSS {peak_rss:.1} MiB",
        peak("pyroscope"),
        got.len(),
        pushed_slots
    );
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_receiver_failing_for_a_while_gets_every_slot_when_it_recovers() {
    let Some(_k) = kernel() else { return };
    let test = "a_receiver_failing_for_a_while";
    // `SLOTPROF_PUSH_OUTAGE_S=300` is the 5-minute check (outside CI).
    let outage = std::env::var("SLOTPROF_PUSH_OUTAGE_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15u64);
    let started = Instant::now();
    let failing = HttpReceiver::start(Box::new(move |_| {
        if started.elapsed() < Duration::from_secs(outage) {
            (500, Duration::ZERO)
        } else {
            (200, Duration::ZERO)
        }
    }))
    .unwrap();
    // Slots through the outage and a little past it.
    let slots = (outage * 5 / 2) as u32 + 10;
    let s = session(
        "push-failing",
        slots,
        &format!(
            "pyroscope = \"http://127.0.0.1:{0}\"\notlp = \"http://127.0.0.1:{0}\"\nevery = \"2s\"",
            failing.port
        ),
        // Backoff doubles to 60 s: the retry after the outage comes within a minute.
        Duration::from_secs(90),
    );
    let (disk, on_disk) = disk_content(&s.export);
    assert_slots_exported(test, &on_disk, &s.expected);
    let reqs = failing.requests();
    let (ok, failed): (Vec<_>, Vec<_>) = reqs.iter().cloned().partition(|(_, st)| *st == 200);
    let pyro: Vec<_> = ok
        .iter()
        .filter(|(r, _)| r.path() == "/ingest")
        .cloned()
        .collect();
    let otlp: Vec<_> = ok
        .iter()
        .filter(|(r, _)| r.path() != "/ingest")
        .cloned()
        .collect();
    let last = s.scrapes.last().unwrap();
    let attempts_failed: f64 = ["pyroscope", "otlp"]
        .iter()
        .map(|ep| metric(last, &key("slotprof_push_failed_attempts_total", ep, None)))
        .sum();
    assert!(
        row(
            test,
            "failed attempts (metrics) = 500s answered",
            &format!("{attempts_failed} vs {}", failed.len()),
            "equal, > 0",
            attempts_failed == failed.len() as f64 && !failed.is_empty()
        ),
        "{attempts_failed} failed attempts in /metrics, the receiver answered {} with 500",
        failed.len()
    );
    for ep in ["pyroscope", "otlp"] {
        assert_eq!(
            metric(last, &key("slotprof_push_batches_total", ep, Some("dropped"))),
            0.0,
            "{ep}"
        );
    }
    let pushed = pyroscope_content(&pyro, APP, Some(&s.identity));
    let otlp_got = otlp_received(&otlp, APP, Some(&s.identity));
    assert!(
        row(test, &format!("after {outage} s of 500s: every slot pushed, equal to disk"), &format!("{} and {} slots of {}", slots_of(&pushed).len(), slots_of(&otlp_got).len(), on_disk.len()), "all, equal", pushed == disk && otlp_got == disk),
        "after the outage the pushed profiles differ from the disk: Pyroscope slots {:?}, OTLP slots {:?}, disk {:?}",
        slots_of(&pushed),
        slots_of(&otlp_got),
        on_disk
    );
    assert!(s.said.contains("works again"), "the recovery is said: {}", s.said);
    // What the outage held in memory: the queues, and slotprof's RSS.
    let peak = |f: &dyn Fn(&BTreeMap<String, f64>) -> f64| s.scrapes.iter().map(f).fold(0.0, f64::max);
    let queued = peak(&|m| {
        m.iter()
            .filter(|(k, _)| k.starts_with("slotprof_push_queue_bytes"))
            .map(|(_, v)| v)
            .sum()
    });
    let rss = peak(&|m| m.get("process_resident_memory_bytes{}").copied().unwrap_or(0.0));
    eprintln!(
        "{} requests answered 500 over {outage} s, then {} Pyroscope and {} OTLP batches taken; \
         peak queued {:.0} KiB (both endpoints), peak RSS {:.1} MiB",
        failed.len(),
        pyro.len(),
        otlp.len(),
        queued / 1024.0,
        rss / (1 << 20) as f64
    );
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_recorded_sessions_slots_are_pushed_when_it_ends() {
    let Some(_k) = kernel() else { return };
    let test = "a_recorded_sessions_slots_are_pushed";
    let (pyro, otlp) = (receiver(200, Duration::ZERO), receiver(200, Duration::ZERO));
    let dir = scratch("push-record");
    let out = dir.join("out");
    let origin = slotprof_tests::monotonic_ns() + 1_500_000_000;
    let o = run_slotprof(&[
        "record",
        "--slot-source",
        &format!("clock=400ms,origin={origin},leader=4/8"),
        "--out",
        out.to_str().unwrap(),
        "--push-pyroscope",
        &format!("http://127.0.0.1:{}", pyro.port),
        "--push-otlp",
        &format!("http://127.0.0.1:{}", otlp.port),
        "--push-every",
        "1s",
        "--push-label",
        "cluster=e2e",
        "--",
        stall_program("synthetic-validator").to_str().unwrap(),
        "--slots",
        "12",
        "--origin-ns",
        &origin.to_string(),
    ]);
    assert!(o.status.success());
    let (disk, on_disk) = disk_content(&out);
    assert!(on_disk.len() >= 10, "slots on disk: {on_disk:?}");
    // A clock source knows no identity.
    let pushed = pyroscope_content(&pyro.requests(), APP, None);
    let otlp_got = otlp_received(&otlp.requests(), APP, None);
    assert!(
        row(
            test,
            "Pyroscope and OTLP: every slot's samples equal its profile on disk",
            &format!("{} and {} keys vs {}", pushed.len(), otlp_got.len(), disk.len()),
            "equal",
            pushed == disk && otlp_got == disk
        ),
        "pushed slots {:?} and {:?}, on disk {on_disk:?}",
        slots_of(&pushed),
        slots_of(&otlp_got)
    );
    // summary.json counts what went where.
    let summary = read_json(&out.join("summary.json"));
    let push = summary["push"].as_array().expect("summary.json's push");
    for (ep, got) in [
        ("pyroscope", pyro.requests().len()),
        ("otlp", otlp.requests().len()),
    ] {
        let e = push.iter().find(|e| e["endpoint"] == ep).unwrap();
        assert_eq!(e["pushed"].as_u64(), Some(got as u64), "{ep}: {e}");
        assert_eq!(e["dropped"].as_u64(), Some(0), "{ep}: {e}");
        assert!(got >= 4, "{ep}: a batch a second over ~5 s of slots: {got}");
    }
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains("push to otlp"),
        "the session says what it pushed: {said}"
    );
}
