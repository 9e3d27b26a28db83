//! The guest-side phase probe against a square-wave CPU competitor on the
//! probed CPU (3 s on, 2 s off): it must find the 5 s period and the 60%
//! slow share; with the default 1 ms burst it says what it sees; with no
//! competitor it reports no slow phase.

mod common;

use common::*;

fn two_cpus() -> bool {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(
            Need::Cpus(2),
            "needs two CPUs (the competitor and the probe share CPU 1)",
        );
        return false;
    }
    true
}

/// `slotprof record --phase-probe` on CPU 1 (with `--phase-burst BURST`
/// when given) around `command`; returns the summary's verdict for CPU 1.
fn phase_of(test: &str, burst: Option<&str>, command: &[&str]) -> serde_json::Value {
    let dir = scratch(test);
    let out = dir.join("out");
    let mut args = vec!["record", "--phase-probe", "--phase-cpus", "1"];
    if let Some(b) = burst {
        args.extend(["--phase-burst", b]);
    }
    args.extend(["--no-detector-probes", "--out", out.to_str().unwrap(), "--"]);
    args.extend(command);
    let o = run_slotprof(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = read_json(&out.join("summary.json"));
    let cpu = s["phase_probe"]["cpus"][0].clone();
    eprintln!("{test}: {cpu}");
    assert_eq!(
        cpu["cpu"], 1,
        "no phase-probe result for CPU 1: {}",
        s["phase_probe"]
    );
    let _ = std::fs::remove_dir_all(&dir);
    cpu
}

fn square_wave(seconds: &str) -> [String; 9] {
    [
        stall_program("square-wave").display().to_string(),
        "--cpu".into(),
        "1".into(),
        "--on".into(),
        "3".into(),
        "--off".into(),
        "2".into(),
        "--seconds".into(),
        seconds.into(),
    ]
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn square_wave_competitor_gives_period_and_slow_share() {
    let Some(_k) = kernel() else { return };
    if !two_cpus() {
        return;
    }
    // 20 ms bursts: on this kernel a waking probe preempts a CPU hog in the
    // same VM, so a 1 ms burst barely feels it (a host-side slowdown slows
    // every instruction and shows at 1 ms; the next test says what 1 ms
    // sees here).
    let wave = square_wave("20");
    let cpu = phase_of(
        "phase",
        Some("20ms"),
        &wave.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let period = cpu["period_s"].as_f64().expect("a period");
    let share = cpu["slow_share"].as_f64().unwrap();
    assert!((period - 5.0).abs() <= 0.5, "period {period} s");
    assert!((share - 0.6).abs() <= 0.1, "slow share {share}");
    assert!(cpu["verdict"].as_str().unwrap().contains("repeating every"));
}

/// The default burst (1 ms) against the same competitor: a CPU hog in the
/// same guest is preempted by the waking probe, so what 1 ms sees of it is
/// stated (in the test's output and the results), not bounded; the probe
/// must still have run its windows and given a verdict.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn the_default_one_ms_burst_states_what_it_sees_of_the_competitor() {
    let Some(_k) = kernel() else { return };
    if !two_cpus() {
        return;
    }
    let wave = square_wave("20");
    let cpu = phase_of(
        "phase-1ms",
        None,
        &wave.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let windows = cpu["windows"].as_u64().unwrap_or(0);
    let verdict = cpu["verdict"].as_str().unwrap_or("").to_string();
    row(
        "phase probe, default 1 ms burst",
        "what it sees of a 3 s on / 2 s off competitor in the same guest",
        &format!(
            "{verdict} (slowdown {:.1}%, {windows} windows)",
            cpu["slowdown"].as_f64().unwrap_or(0.0) * 100.0
        ),
        "stated, not bounded",
        true,
    );
    // 20 s at one window per 100 ms: ~200 windows.
    assert!(windows >= 100, "{windows} phase windows in 20 s");
    assert!(!verdict.is_empty(), "no verdict: {cpu}");
}

/// The negative twin: no competitor, the same 20 ms bursts: no slow phase.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_steady_cpu_reports_no_slow_phase() {
    let Some(_k) = kernel() else { return };
    if !two_cpus() {
        return;
    }
    let cpu = phase_of("phase-steady", Some("20ms"), &["/bin/sleep", "20"]);
    let verdict = cpu["verdict"].as_str().unwrap_or("");
    assert!(verdict.starts_with("no slow phase"), "steady CPU: {cpu}");
}
