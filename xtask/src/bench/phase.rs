//! The phase probe's own cost on a CPU-bound PoH loop.

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{bail, Context};
use serde_json::Value;

use super::*;

/// The guest-mode phase probe's cost to a CPU-bound PoH-like loop on every
/// CPU (the worst case: the probe's bursts take CPU time from it directly).
pub(super) fn phase_probe_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let variants: [(&str, Option<&[&str]>); 3] = [
        ("alone", None),
        ("slotprof record (all probes)", Some(&[])),
        (
            "slotprof record --phase-probe (1 ms every 100 ms per CPU)",
            Some(&["--phase-probe"]),
        ),
    ];
    let report = scratch.join("poh.json");
    let poh = bin(root, "poh-loop");
    let poh_args = ["--seconds", SECONDS, "--report", report.to_str().unwrap()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..ROUNDS {
        for (i, (name, opts)) in variants.iter().enumerate() {
            let status = match opts {
                None => Command::new(&poh).args(poh_args).status()?,
                Some(opts) => Command::new(bin(root, "slotprof"))
                    .args(["record", "--out", scratch.join("poh-out").to_str().unwrap()])
                    .args(*opts)
                    .arg("--")
                    .arg(&poh)
                    .args(poh_args)
                    .stdout(std::process::Stdio::null())
                    .status()?,
            };
            if !status.success() {
                bail!("{name} failed ({status})");
            }
            let r: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
            let rate = r["hashes_per_s"].as_f64().context("poh report")?;
            eprintln!(
                "xtask: bench round {} {name:<60} {:>8.1} M hashes/s",
                round + 1,
                rate / 1e6
            );
            rates[i].push(rate);
        }
    }
    let medians: Vec<f64> = rates.iter().map(|r| median(r.clone())).collect();
    let mut md = String::new();
    let _ = writeln!(md, "{PHASE_HEADING}\n");
    let _ = writeln!(md, "`poh-loop` (tests/src/bin/poh-loop.rs): one sha256 chain per CPU, as a leader's PoH thread runs, for {SECONDS} s. The phase probe runs its own 1 ms sha256 burst every 100 ms pinned on each CPU, so by construction it takes 1% of each CPU; this measures what the loop loses.\n");
    let _ = writeln!(
        md,
        "| variant | M hashes/s (median) | ratio to alone | all rounds |"
    );
    let _ = writeln!(md, "|---|---|---|---|");
    for (i, (name, _)) in variants.iter().enumerate() {
        let all: Vec<String> = rates[i].iter().map(|r| format!("{:.1}", r / 1e6)).collect();
        let _ = writeln!(
            md,
            "| {name} | {:.1} | {:.3} | {} |",
            medians[i] / 1e6,
            medians[i] / medians[0],
            all.join(", ")
        );
    }
    let _ = writeln!(
        md,
        "\nThe phase probe alone: ratio {:.3} between the last two rows (expected ~0.99).\n",
        medians[2] / medians[1]
    );
    Ok(md)
}
