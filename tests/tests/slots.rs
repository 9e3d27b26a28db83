//! Per-slot profiles under real probes, against a synthetic validator that
//! reports its own slot boundaries and does extra work in every 4th slot.

mod common;

use std::path::Path;

use common::*;
use slotprof_tests::monotonic_ns;

/// Runs the synthetic validator under `slotprof record` with `source`
/// (which may use `{origin}`), returns (output dir, program report).
fn run_validator(test: &str, source: &str, slots: u32) -> (std::path::PathBuf, serde_json::Value) {
    let (out, truth, _) = run_validator_with(test, source, slots, &[]);
    (out, truth)
}

/// [`run_validator`] with extra program arguments; also returns slotprof's stderr.
fn run_validator_with(
    test: &str,
    source: &str,
    slots: u32,
    extra: &[&str],
) -> (std::path::PathBuf, serde_json::Value, String) {
    let dir = scratch(test);
    let report = dir.join("report.json");
    let out = dir.join("out");
    // Start the slots a little in the future, so both sides share the origin.
    let origin = monotonic_ns() + 500_000_000;
    let source = source.replace("{origin}", &origin.to_string());
    let o = run_slotprof(
        &vec![
            "record",
            "--slot-source",
            &source,
            "--out",
            out.to_str().unwrap(),
            "--",
            stall_program("synthetic-validator").to_str().unwrap(),
            "--slots",
            &slots.to_string(),
            "--origin-ns",
            &origin.to_string(),
            "--report",
            report.to_str().unwrap(),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
    );
    assert!(o.status.success());
    (
        out,
        read_json(&report),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Checks slot boundaries against the program's and that `heavy_slot_work`
/// dominates exactly the heavy slots.
fn check_slots(out: &Path, truth: &serde_json::Value) {
    let mut checked = 0;
    let mut light_work = 0;
    for s in truth["slots"].as_array().unwrap() {
        let n = s["slot"].as_u64().unwrap();
        let dir = out.join("slots").join(n.to_string());
        assert!(dir.is_dir(), "slot {n} has no directory");
        let sj = read_json(&dir.join("slot.json"));
        let start = sj["start_ns"].as_i64().unwrap();
        let began = s["began_ns"].as_i64().unwrap();
        assert!(
            (start - began).abs() < 10_000_000,
            "slot {n}: boundary {start} vs program {began}"
        );
        let on = read_folded(&dir.join("oncpu.folded"));
        let heavy = on.total_where(|f| f.ends_with("heavy_slot_work"));
        let total = on.total();
        if s["heavy"].as_bool().unwrap() {
            assert!(
                heavy * 2 > total,
                "heavy slot {n}: heavy_slot_work has {heavy} of {total} samples"
            );
        } else {
            assert_eq!(heavy, 0, "light slot {n} has heavy_slot_work samples");
            // A light slot holds ~40 ms of work: a few samples at 99 Hz,
            // sometimes none, so this is counted over all light slots.
            light_work += on.total_where(|f| f.ends_with("process_slot"));
        }
        checked += 1;
    }
    assert!(checked >= 8);
    assert!(light_work > 0, "no process_slot samples in any light slot");
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn clock_slots_match_the_programs_own_and_heavy_slots_stand_out() {
    let Some(_k) = kernel() else { return };
    let (out, truth) = run_validator("clock", "clock=400ms,origin={origin},leader=4/8", 12);
    check_slots(&out, &truth);

    // Leader windows: slots 0-3 and 8-11 by leader=4/8.
    let windows: Vec<String> = std::fs::read_dir(out.join("windows"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(windows, ["0", "8"]);
    let w = read_json(&out.join("windows/0/window.json"));
    assert_eq!(w["slots"], serde_json::json!([0, 1, 2, 3]));

    // trace.json: one track per thread plus the slot tracks.
    let trace = read_json(&out.join("trace.json"));
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("bank-loop (")), "{names:?}");
    assert!(
        names.contains(&"slots") && names.contains(&"leader windows"),
        "{names:?}"
    );
    let slot_events = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "slot")
        .count();
    assert!(slot_events >= 12);

    // index.html lists every slot.
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    for s in truth["slots"].as_array().unwrap() {
        let n = s["slot"].as_u64().unwrap();
        assert!(
            html.contains(&format!("href=\"slots/{n}/oncpu.svg\"")),
            "slot {n} missing from index.html"
        );
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn index_html_renders_in_chromium_and_sorts() {
    let Some(_k) = kernel() else { return };
    let Some(chromium) = chromium() else {
        skip(
            Need::Chromium,
            "no Chromium (apt-get install chromium; `cargo xtask test` does)",
        );
        return;
    };
    let (out, truth) = run_validator("html", "clock=300ms,origin={origin}", 5);
    let index = out.join("index.html");
    let (dom, console) = render_in_chromium(&chromium, &index);
    assert!(console.is_empty(), "console messages: {console:?}");
    let slots = truth["slots"].as_array().unwrap();
    for s in slots {
        let n = s["slot"].as_u64().unwrap();
        assert!(
            dom.contains(&format!("href=\"slots/{n}/oncpu.svg\"")),
            "slot {n} not in the rendered page"
        );
    }
    // The timeline drew every slot, with the on-CPU part and the rest of
    // each slot in its pixels.
    let canvas = dom
        .split("<canvas id=\"timeline\"")
        .nth(1)
        .and_then(|r| r.split('>').next())
        .expect("the timeline's canvas");
    let attr = |name: &str| {
        canvas
            .split(&format!("{name}=\""))
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or_default()
            .to_string()
    };
    let rows = dom.matches("/oncpu.svg\">on-CPU</a>").count();
    let colours = attr("data-colours");
    assert!(
        row(
            "index.html",
            "timeline: slots drawn, colours in its pixels",
            &format!("{} of {rows}; {colours}", attr("data-slots")),
            "every slot; on-CPU and the rest of the slot",
            attr("data-slots") == rows.to_string() && colours.contains("part0") && colours.contains("rest")
        ),
        "{canvas}"
    );
    // The sorting script works: click the slot column twice (descending).
    let probe = out.join("index-selftest.html");
    let html = std::fs::read_to_string(&index).unwrap().replace(
        "</body>",
        "<script>var th = document.querySelector('#slots th'); th.click(); th.click();\n\
         var d = document.createElement('div'); d.id = 'selftest';\n\
         d.textContent = 'first=' + document.querySelector('#slots tbody tr').cells[0].textContent + ';';\n\
         document.body.appendChild(d);</script></body>",
    );
    std::fs::write(&probe, html).unwrap();
    let (dom, console) = render_in_chromium(&chromium, &probe);
    assert!(console.is_empty(), "console messages: {console:?}");
    let last = slots.iter().filter_map(|s| s["slot"].as_u64()).max().unwrap();
    let shown_first: u64 = dom
        .split("id=\"selftest\">first=")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|n| n.parse().ok())
        .expect("selftest ran");
    assert!(
        shown_first >= last,
        "sorted descending, first row is slot {shown_first}"
    );
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

/// Leader windows the fixture's schedule gives for the program's slots
/// (it leads the first 4 of every 8 slots of the epoch).
fn expected_windows(truth: &serde_json::Value) -> Vec<String> {
    let epoch_start = 345_600_000u64;
    let mut w: Vec<String> = truth["slots"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["slot"].as_u64())
        .filter(|n| (n - epoch_start) % 8 < 4)
        .map(|n| (n - n % 4).to_string())
        .collect();
    w.dedup();
    w
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().file_name().into_string().unwrap()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn rpc_slots_and_leader_windows_follow_the_validator() {
    let Some(_k) = kernel() else { return };
    let port = free_port_pair().to_string();
    let (out, truth, stderr) = run_validator_with(
        "rpc",
        &format!("rpc=http://127.0.0.1:{port}"),
        12,
        &["--rpc-port", &port, "--first-slot", "345600102"],
    );
    check_slots(&out, &truth);
    for s in truth["slots"].as_array().unwrap() {
        let sj = read_json(&out.join("slots").join(s["slot"].to_string()).join("slot.json"));
        assert_eq!(
            sj["aligned"], true,
            "slot {} not aligned with a healthy RPC",
            s["slot"]
        );
        let leader = (s["slot"].as_u64().unwrap() - 345_600_000) % 8 < 4;
        assert_eq!(sj["leader"], leader, "slot {}", s["slot"]);
    }
    assert_eq!(dir_names(&out.join("windows")), expected_windows(&truth));
    assert!(!stderr.contains("slot source"), "unexpected warning: {stderr}");
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn rpc_going_away_mid_run_marks_slots_unaligned_and_warns_once() {
    let Some(_k) = kernel() else { return };
    let port = free_port_pair().to_string();
    let first = 345_600_200u64;
    let (out, truth, stderr) = run_validator_with(
        "rpc-stop",
        &format!("rpc=http://127.0.0.1:{port}"),
        10,
        &[
            "--rpc-port",
            &port,
            "--first-slot",
            &first.to_string(),
            "--rpc-stop-after",
            "5",
        ],
    );
    // Profiling went on: every slot of the program has its profile.
    check_slots(&out, &truth);
    for s in truth["slots"].as_array().unwrap() {
        let n = s["slot"].as_u64().unwrap();
        let sj = read_json(&out.join("slots").join(n.to_string()).join("slot.json"));
        if n < first + 4 {
            assert_eq!(
                sj["aligned"], true,
                "slot {n} was announced and should be aligned"
            );
        }
        if n >= first + 5 {
            assert_eq!(sj["aligned"], false, "slot {n} came after the RPC stopped");
        }
    }
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("slot source")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("stopped answering") && warnings[0].contains("unaligned"));
    let s = read_json(&out.join("summary.json"));
    assert!(s["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w.as_str().unwrap().contains("stopped answering")));
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn uprobe_slots_follow_the_programs_slot_function() {
    let Some(_k) = kernel() else { return };
    // Counter numbering (no RPC): the program's slots start at 0 too.
    let bin = stall_program("synthetic-validator");
    let source = format!("uprobe={}:synthetic_validator_start_slot", bin.display());
    let (out, truth) = run_validator("uprobe", &source, 12);
    check_slots(&out, &truth);
    let s = read_json(&out.join("summary.json"));
    let probe = s["probes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["program"] == "slotprof_slot")
        .cloned();
    assert_eq!(probe.unwrap()["attached"], true);
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn uprobe_slots_take_numbers_and_leaders_from_rpc() {
    let Some(_k) = kernel() else { return };
    let port = free_port_pair().to_string();
    let bin = stall_program("synthetic-validator");
    let source = format!(
        "uprobe={}:synthetic_validator_start_slot,rpc=http://127.0.0.1:{port}",
        bin.display()
    );
    let (out, truth, _) = run_validator_with(
        "uprobe-rpc",
        &source,
        12,
        &["--rpc-port", &port, "--first-slot", "345600300"],
    );
    check_slots(&out, &truth);
    assert_eq!(dir_names(&out.join("windows")), expected_windows(&truth));
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

/// `go tool pprof` (Go from the system's packages), or None.
fn go_binary() -> Option<std::path::PathBuf> {
    ["/usr/bin/go", "/usr/lib/go/bin/go", "/usr/local/go/bin/go"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
}

/// `go tool pprof ARGS`: its stdout, or a panic with its stderr.
fn go_pprof(go: &Path, args: &[&str]) -> String {
    let o = std::process::Command::new(go)
        .args(["tool", "pprof"])
        .args(args)
        // Go's tools want a writable home for their cache.
        .env("HOME", std::env::temp_dir())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "go tool pprof {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Each sample type's total in a pprof file, by its type name.
fn pprof_totals(path: &Path) -> std::collections::BTreeMap<String, i64> {
    let p = flamegraphs::pprof::decode_gzip(&std::fs::read(path).unwrap()).unwrap();
    p.sample_type
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                p.string_table[t.ty as usize].clone(),
                p.sample.iter().map(|s| s.value[i]).sum(),
            )
        })
        .collect()
}

/// Every profile slotprof writes (the session's, each slot's, each leader
/// window's) is read by `go tool pprof` (`-raw`, `-top`, `-traces`,
/// `-tags`), with `samples/count`, `cpu/nanoseconds` and
/// `offcpu/nanoseconds`, each sample labelled with its thread (and in a
/// slot's and a window's with its slot, leader flag); in a window,
/// `-tagfocus slot=N` selects exactly slot N's samples: their totals equal
/// slot N's own profile's.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn go_tool_pprof_reads_every_profile_and_a_slot_label_selects_that_slot_in_its_window() {
    let Some(_k) = kernel() else { return };
    let Some(go) = go_binary() else {
        skip(
            Need::Tool("go"),
            "no Go toolchain for `go tool pprof` (apt-get install golang-go; `cargo xtask test` does)",
        );
        return;
    };
    let (out, _truth) = run_validator("pprof", "clock=400ms,origin={origin},leader=4/8", 8);
    let mut files = vec![out.join("profile.pb.gz")];
    for dir in ["slots", "windows"] {
        for e in std::fs::read_dir(out.join(dir)).unwrap() {
            files.push(e.unwrap().path().join("profile.pb.gz"));
        }
    }
    for f in &files {
        let name = f.strip_prefix(&out).unwrap().display().to_string();
        let totals = pprof_totals(f);
        assert_eq!(
            totals.keys().map(String::as_str).collect::<Vec<_>>(),
            ["cpu", "offcpu", "samples"],
            "{name}"
        );
        let raw = go_pprof(&go, &["-raw", f.to_str().unwrap()]);
        assert!(raw.contains("Samples:"), "{name}: {raw}");
        go_pprof(&go, &["-top", f.to_str().unwrap()]);
        go_pprof(&go, &["-traces", f.to_str().unwrap()]);
        let tags = go_pprof(&go, &["-tags", f.to_str().unwrap()]);
        assert!(tags.contains("thread_name"), "{name}: {tags}");
        if !name.starts_with("profile") {
            assert!(tags.contains("slot") && tags.contains("leader"), "{name}: {tags}");
        }
    }
    eprintln!("go tool pprof read all {} profiles", files.len());
    // Window 0 holds slots 0-3 (leader=4/8).
    let window = out.join("windows/0/profile.pb.gz");
    let mut selected = 0;
    for n in 0..4 {
        let own = out.join(format!("slots/{n}/profile.pb.gz"));
        let want = pprof_totals(&own);
        let picked = scratch(&format!("pprof-slot-{n}")).join("picked.pb.gz");
        go_pprof(
            &go,
            &[
                "-proto",
                "-tagfocus",
                &format!("slot={n}"),
                "-output",
                picked.to_str().unwrap(),
                window.to_str().unwrap(),
            ],
        );
        let got = pprof_totals(&picked);
        assert!(
            row(
                "pprof",
                &format!("window 0, -tagfocus slot={n}: totals vs slot {n}'s own profile"),
                &format!("{got:?} vs {want:?}"),
                "equal",
                got == want
            ),
            "slot {n}"
        );
        selected += usize::from(want["samples"] > 0);
        let _ = std::fs::remove_dir_all(picked.parent().unwrap());
    }
    assert!(selected >= 2, "only {selected} of window 0's slots had samples");
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}
