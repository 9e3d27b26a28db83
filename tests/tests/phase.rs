//! The guest-side phase probe against a square-wave CPU competitor on the
//! probed CPU (3 s on, 2 s off): it must find the 5 s period and the 60%
//! slow share.

mod common;

use common::*;

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn square_wave_competitor_gives_period_and_slow_share() {
    let Some(_k) = kernel() else { return };
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(
            Need::Cpus(2),
            "needs two CPUs (the competitor and the probe share CPU 1)",
        );
        return;
    }
    let dir = scratch("phase");
    let out = dir.join("out");
    // 20 ms bursts: on this kernel a waking probe preempts a CPU hog in the
    // same VM, so a 1 ms burst barely feels it (a host-side slowdown slows
    // every instruction and shows at 1 ms).
    let o = run_slotprof(&[
        "record",
        "--phase-probe",
        "--phase-cpus",
        "1",
        "--phase-burst",
        "20ms",
        "--no-detector-probes",
        "--out",
        out.to_str().unwrap(),
        "--",
        stall_program("square-wave").to_str().unwrap(),
        "--cpu",
        "1",
        "--on",
        "3",
        "--off",
        "2",
        "--seconds",
        "20",
    ]);
    assert!(o.status.success());
    let s = read_json(&out.join("summary.json"));
    let cpu = &s["phase_probe"]["cpus"][0];
    eprintln!("{cpu}");
    assert_eq!(cpu["cpu"], 1);
    let period = cpu["period_s"].as_f64().expect("a period");
    let share = cpu["slow_share"].as_f64().unwrap();
    assert!((period - 5.0).abs() <= 0.5, "period {period} s");
    assert!((share - 0.6).abs() <= 0.1, "slow share {share}");
    assert!(cpu["verdict"].as_str().unwrap().contains("repeating every"));
    let _ = std::fs::remove_dir_all(&dir);
}
