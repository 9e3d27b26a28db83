//! `cargo xtask fuzz [--seconds N] [TARGET...]`: coverage-guided fuzzing
//! (cargo-fuzz, libFuzzer) of what slotprof reads from outside, with the
//! committed corpus under `fuzz/corpus/TARGET` (each run adds what it
//! finds). `cargo xtask test --full` runs each target for 30 s.
//!
//! cargo-fuzz needs the nightly toolchain (for its instrumentation flags;
//! slotprof itself builds on stable): it is installed with rustup when
//! missing, and cargo-fuzz into `.tools/`.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context};

use crate::outcomes::{Outcome, Row};

/// Every fuzz target (`fuzz/fuzz_targets/NAME.rs`).
pub const TARGETS: [&str; 6] = [
    "rpc_answer",
    "slot_source",
    "config",
    "folded",
    "ring_records",
    "tracefs_format",
];

const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// `cargo xtask fuzz` itself: every target (or those named) for
/// `--seconds` each (default 600).
pub fn run(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let mut seconds = 600u64;
    let mut targets: Vec<&str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .context("--seconds N: a whole number of seconds")?
            }
            t => match TARGETS.iter().find(|k| **k == t) {
                Some(k) => targets.push(k),
                None => bail!("no fuzz target {t:?}: the targets are {}", TARGETS.join(", ")),
            },
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    tools(root)?;
    let rows: Vec<Row> = targets.iter().map(|t| target(root, t, seconds)).collect();
    match crate::outcomes::print_summary(&rows) {
        0 => Ok(()),
        n => bail!("{n} fuzz target(s) failed"),
    }
}

/// The 30-second run of every target for `cargo xtask test --full` (from its
/// committed corpus: what earlier runs found is replayed first): one row
/// each, skipped (with why) when the tools cannot be had here.
pub fn smoke(root: &Path) -> Vec<Row> {
    if let Err(e) = tools(root) {
        return TARGETS
            .iter()
            .map(|t| {
                row(
                    t,
                    Outcome::Skipped,
                    format!("cargo-fuzz cannot be had here: {e:#}"),
                )
            })
            .collect();
    }
    TARGETS.iter().map(|t| target(root, t, 30)).collect()
}

fn row(target: &str, outcome: Outcome, note: String) -> Row {
    Row {
        place: "host".into(),
        package: "slotprof-fuzz".into(),
        binary: "fuzz".into(),
        test: target.into(),
        outcome,
        note,
    }
}

fn path_with_tools(root: &Path) -> std::ffi::OsString {
    let mut paths = vec![root.join(".tools/bin")];
    paths.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(paths).unwrap_or_default()
}

/// The nightly toolchain and cargo-fuzz, installed when missing.
fn tools(root: &Path) -> anyhow::Result<()> {
    let listed = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .context("rustup")?;
    if !String::from_utf8_lossy(&listed.stdout)
        .lines()
        .any(|l| l.starts_with("nightly"))
    {
        crate::run(
            root,
            "rustup",
            &["toolchain", "install", "nightly", "--profile", "minimal"],
        )?;
    }
    if !root.join(".tools/bin/cargo-fuzz").exists() {
        let tools = root.join(".tools").display().to_string();
        crate::run(
            root,
            "cargo",
            &[
                "+nightly",
                "install",
                "cargo-fuzz",
                "--locked",
                "--version",
                CARGO_FUZZ_VERSION,
                "--root",
                &tools,
            ],
        )?;
    }
    Ok(())
}

/// One target for `seconds`: PASS when libFuzzer found nothing, FAIL with
/// its crash, leak, timeout or out-of-memory input otherwise.
fn target(root: &Path, name: &str, seconds: u64) -> Row {
    let artifacts = match crate::private_temp_dir(&format!("slotprof-fuzz-{name}")) {
        Ok(d) => d,
        Err(e) => return row(name, Outcome::Fail, format!("{e:#}")),
    };
    let corpus = root.join("fuzz/corpus").join(name);
    let _ = std::fs::create_dir_all(&corpus);
    let args: Vec<String> = [
        "+nightly",
        "fuzz",
        "run",
        "--sanitizer",
        "none",
        "--release",
        "--debug-assertions",
        name,
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        corpus.display().to_string(),
        "--".into(),
        format!("-max_total_time={seconds}"),
        "-rss_limit_mb=2048".into(),
        "-timeout=10".into(),
        format!("-artifact_prefix={}/", artifacts.display()),
        "-print_final_stats=1".into(),
    ])
    .collect();
    eprintln!("xtask: $ cargo {} (in fuzz/)", args.join(" "));
    let out = Command::new("cargo")
        .args(&args)
        .current_dir(root.join("fuzz"))
        .env("PATH", path_with_tools(root))
        .output();
    let found: Vec<PathBuf> = std::fs::read_dir(&artifacts)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    let result = match out {
        Err(e) => row(name, Outcome::Fail, format!("cannot run cargo fuzz: {e}")),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let runs = err
                .lines()
                .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|| "?".into());
            if o.status.success() && found.is_empty() {
                row(
                    name,
                    Outcome::Pass,
                    format!("{runs} inputs in {seconds} s, nothing found"),
                )
            } else {
                let summary = err
                    .lines()
                    .filter(|l| l.contains("SUMMARY") || l.contains("panicked at") || l.starts_with("=="))
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" | ");
                // Kept where a developer finds it: the input that failed.
                let kept = root.join("fuzz/artifacts").join(name);
                let _ = std::fs::create_dir_all(&kept);
                for f in &found {
                    if let Some(n) = f.file_name() {
                        let _ = std::fs::copy(f, kept.join(n));
                    }
                }
                row(
                    name,
                    Outcome::Fail,
                    format!(
                        "{} ({}); input kept in {} (reproduce: cd fuzz && cargo +nightly fuzz run -s none -O -a {name} <input>)",
                        if summary.is_empty() { "cargo fuzz failed".to_string() } else { summary },
                        o.status,
                        kept.display()
                    ),
                )
            }
        }
    };
    let _ = std::fs::remove_dir_all(&artifacts);
    eprintln!("xtask: fuzz {name}: {} {}", result.outcome.word(), result.note);
    result
}
