//! Per-slot profiles under real probes, against a synthetic validator that
//! reports its own slot boundaries and does extra work in every 4th slot.

mod common;

use std::path::Path;

use common::*;
use slotprof_tests::monotonic_ns;

/// Runs the synthetic validator under `slotprof record` with `source`
/// (which may use `{origin}`), returns (output dir, program report).
fn run_validator(test: &str, source: &str, slots: u32) -> (std::path::PathBuf, serde_json::Value) {
    let dir = scratch(test);
    let report = dir.join("report.json");
    let out = dir.join("out");
    // Start the slots a little in the future, so both sides share the origin.
    let origin = monotonic_ns() + 500_000_000;
    let source = source.replace("{origin}", &origin.to_string());
    let o = run_slotprof(&[
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
    ]);
    assert!(o.status.success());
    (out, read_json(&report))
}

/// Checks slot boundaries against the program's and that `heavy_slot_work`
/// dominates exactly the heavy slots.
fn check_slots(out: &Path, truth: &serde_json::Value) {
    let mut checked = 0;
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
            assert!(
                on.total_where(|f| f.ends_with("process_slot")) > 0,
                "slot {n}: no process_slot"
            );
        }
        checked += 1;
    }
    assert!(checked >= 8);
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
        eprintln!("SKIPPED: no Chromium (apt-get install chromium; `cargo xtask test` does)");
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
