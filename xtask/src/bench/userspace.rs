//! The aggregator's and the symbolizer's own throughput (cargo bench).

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{bail, Context};
use serde_json::Value;

use super::*;

/// `cargo bench -p PACKAGE --bench NAME -- ARGS`: its last stdout line, as JSON.
pub(super) fn cargo_bench(root: &Path, package: &str, name: &str, args: &[&str]) -> anyhow::Result<Value> {
    let out = Command::new("cargo")
        .args(["bench", "-q", "-p", package, "--bench", name, "--"])
        .args(args)
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("cargo bench -p {package} --bench {name} failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON from the bench")?;
    Ok(serde_json::from_str(line)?)
}

/// The aggregator on a recorded stream (no kernel), and the symbolizer.
pub(super) fn userspace_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    // A dense stream: every switch of the futex storm (no minimum), 999 Hz.
    let stream = scratch.join("storm.events");
    let status = Command::new(bin(root, "slotprof"))
        .args(["record", "-F", "999", "--min-offcpu", "0ms", "--out"])
        .arg(scratch.join("stream-out"))
        .arg("--save-events")
        .arg(&stream)
        .arg("--")
        .arg(bin(root, "futex-storm"))
        .args(["--seconds", "3"])
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("recording the event stream failed ({status})");
    }
    let agg = cargo_bench(root, "profiler", "aggregate", &[stream.to_str().unwrap()])?;
    let sym = cargo_bench(root, "symbolizer", "symbolize", &["2000"])?;
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let mut md = String::new();
    let _ = writeln!(md, "{USERSPACE_HEADING}\n");
    let _ = writeln!(md, "The aggregator on a recorded stream: `slotprof record -F 999 --min-offcpu 0ms --save-events FILE -- futex-storm --seconds 3` (every context switch of the storm, {} events), replayed by `cargo bench -p profiler --bench aggregate -- FILE` (profiler/benches/aggregate.rs): decoding and ingestion, then slot bucketing (400 ms slots, off-CPU intervals split at boundaries) and the detectors; stacks are not symbolized there (below). Median of 7 passes.\n", agg["events"]);
    let _ = writeln!(md, "| stage | time | events/s |\n|---|---|---|");
    let n = f(&agg, "events");
    let _ = writeln!(
        md,
        "| decode + ingest | {:.1} ms | {:.1} M |",
        1e3 * f(&agg, "ingest_s"),
        n / f(&agg, "ingest_s") / 1e6
    );
    let _ = writeln!(
        md,
        "| slot bucketing ({} slots) | {:.1} ms | |",
        agg["slots"],
        1e3 * f(&agg, "bucket_s")
    );
    let _ = writeln!(md, "| detectors | {:.1} ms | |", 1e3 * f(&agg, "detect_s"));
    let _ = writeln!(
        md,
        "| all | {:.1} ms | **{:.1} M** (target >= 2 M) |\n",
        1e3 * (f(&agg, "ingest_s") + f(&agg, "bucket_s") + f(&agg, "detect_s")),
        f(&agg, "events_per_s") / 1e6
    );
    let _ = writeln!(md, "Symbolization (`cargo bench -p symbolizer --bench symbolize`, symbolizer/benches/symbolize.rs) of {} unique function addresses in a Rust binary with debug info (inlined frames resolved) and {} kernel text addresses: cold is a new symbolizer (parsing the ELF/DWARF or kallsyms on the way), warm is {} other addresses once parsed, cached is the same addresses again.\n", sym["user_addresses"], sym["kernel_addresses"], sym["user_addresses"]);
    let _ = writeln!(md, "| | cold | warm | cached |\n|---|---|---|---|");
    let per = |k: &str, count: &str| 1e6 * f(&sym, k) / f(&sym, count).max(1.0);
    let _ = writeln!(
        md,
        "| user ({} named of {}) | {:.0} ms ({:.1} us each) | {:.0} ms ({:.1} us) | {:.2} ms ({:.2} us) |",
        sym["user_named"],
        sym["user_addresses"],
        1e3 * f(&sym, "user_cold_s"),
        per("user_cold_s", "user_addresses"),
        1e3 * f(&sym, "user_warm_s"),
        per("user_warm_s", "user_addresses"),
        1e3 * f(&sym, "user_cached_s"),
        per("user_cached_s", "user_addresses")
    );
    let _ = writeln!(
        md,
        "| kernel | {:.0} ms ({:.1} us each) | {:.0} ms ({:.1} us) | {:.2} ms ({:.2} us) |\n",
        1e3 * f(&sym, "kernel_cold_s"),
        per("kernel_cold_s", "kernel_addresses"),
        1e3 * f(&sym, "kernel_warm_s"),
        per("kernel_warm_s", "kernel_addresses"),
        1e3 * f(&sym, "kernel_cached_s"),
        per("kernel_cached_s", "kernel_addresses")
    );
    Ok(md)
}
