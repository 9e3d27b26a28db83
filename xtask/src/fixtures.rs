//! `cargo xtask record-fixtures` (root): records the replay fixtures of
//! `tests/fixtures/replay/` from the stall programs under real probes
//! (`slotprof record --save-replay`), each with the program's own report
//! (`truth.json`). `profiler/tests/replay.rs` replays them in `cargo
//! test`, without root. Record again after a change to the event records,
//! the detectors' inputs or the recording format.

use std::path::Path;

use anyhow::{bail, Context};

/// One fixture: its name, the stall program and its arguments, and
/// slotprof's options.
struct Fixture {
    name: &'static str,
    program: &'static str,
    args: &'static [&'static str],
    slotprof: &'static [&'static str],
}

/// slotprof's options for the gap program and its smooth twin (as the
/// MainLoopGap e2e test runs them).
const GAPS_OPTIONS: &[&str] = &[
    "-F",
    "499",
    "--loop-symbol",
    "stall_loop_iteration",
    "--gap-threshold",
    "10ms",
    "--slot-source",
    "clock=400ms",
];

/// Short runs (the fixtures are committed): a few seconds each, every
/// one with clock slots so that the always-on replay has slots to cut.
const FIXTURES: &[Fixture] = &[
    Fixture {
        name: "gaps",
        program: "stall-gaps",
        args: &["--seconds", "3", "--gap-ms", "20"],
        slotprof: GAPS_OPTIONS,
    },
    Fixture {
        name: "gaps-smooth",
        program: "stall-gaps",
        args: &["--seconds", "2", "--smooth", "--slow-ms", "5"],
        slotprof: GAPS_OPTIONS,
    },
    Fixture {
        name: "lock",
        program: "stall-gaps",
        args: &["--seconds", "3", "--gap-ms", "50"],
        slotprof: &["--loop-thread", "main-loop", "--slot-source", "clock=400ms"],
    },
    Fixture {
        name: "purge-sync",
        program: "stall-alloc",
        args: &["--slots", "6"],
        slotprof: &["--slot-source", "clock=400ms"],
    },
    Fixture {
        name: "purge-background",
        program: "stall-alloc",
        args: &["--slots", "6", "--purge", "background"],
        slotprof: &["--slot-source", "clock=400ms"],
    },
    // Leader windows of 4 slots in every 8, for the always-on replay's
    // per-window cache-line pass.
    Fixture {
        name: "false-sharing",
        program: "stall-false-sharing",
        args: &["--mode", "counters", "--seconds", "4"],
        slotprof: &["-F", "499", "--slot-source", "clock=400ms,leader=4/8"],
    },
    Fixture {
        name: "false-sharing-padded",
        program: "stall-false-sharing",
        args: &["--mode", "counters", "--seconds", "4", "--padded"],
        slotprof: &["-F", "499", "--slot-source", "clock=400ms,leader=4/8"],
    },
];

pub fn run(root: &Path) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("recording loads eBPF programs: run `sudo cargo xtask record-fixtures`");
    }
    let dir = root.join("tests/fixtures/replay");
    let scratch = crate::private_temp_dir("slotprof-fixtures")?;
    for f in FIXTURES {
        let into = dir.join(f.name);
        let _ = std::fs::remove_dir_all(&into);
        std::fs::create_dir_all(&into)?;
        let out = scratch.join(f.name);
        let mut args: Vec<String> = vec![
            "record".into(),
            "--out".into(),
            out.display().to_string(),
            "--save-replay".into(),
            into.display().to_string(),
        ];
        args.extend(f.slotprof.iter().map(|s| s.to_string()));
        args.push("--".into());
        args.push(root.join("target/release").join(f.program).display().to_string());
        args.extend(f.args.iter().map(|s| s.to_string()));
        args.push("--report".into());
        args.push(into.join("truth.json").display().to_string());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        crate::run(
            root,
            &root.join("target/release/slotprof").display().to_string(),
            &argv,
        )
        .with_context(|| format!("recording the {} fixture", f.name))?;
        let bytes: u64 = std::fs::read_dir(&into)?
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum();
        eprintln!("xtask: fixture {}: {} KiB", f.name, bytes >> 10);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}
