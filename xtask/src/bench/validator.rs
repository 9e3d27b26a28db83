//! The real node's section (`cargo xtask validator --bench`).

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{bail, Context};

use super::*;

/// The real node (`cargo xtask validator`) under a real client's load:
/// slots a second alone, under `slotprof attach` and under perf's DWARF
/// call graphs (interleaved rounds), each BPF program's cost at this
/// node's switch rate, then `slotprof run` following it for
/// `--run-minutes`. Measured by tests/src/bin/validator-bench.rs; without
/// the node's binary the section says why and what to do.
pub(super) fn validator_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let mut md = format!("{VALIDATOR_HEADING}\n\n");
    let node = match crate::validator::binary(root) {
        Ok(b) => b,
        Err(e) => {
            let _ = writeln!(md, "Not measured: {e:#}.\n");
            return Ok(md);
        }
    };
    let load = crate::validator::loadgen(root)?;
    let perf = perf_binary(root);
    let minutes = RUN_MINUTES.load(std::sync::atomic::Ordering::Relaxed).to_string();
    let mut cmd = Command::new(bin(root, "validator-bench"));
    cmd.arg("--slotprof")
        .arg(bin(root, "slotprof"))
        .args(["--run-minutes", &minutes, "--scratch"])
        .arg(scratch)
        .env("SLOTPROF_VALIDATOR", &node)
        .env("SLOTPROF_LOADGEN", &load)
        .stderr(std::process::Stdio::inherit());
    if let Some(p) = &perf {
        cmd.arg("--perf").arg(p);
    }
    let out = cmd
        .output()
        .context("cannot run target/release/validator-bench")?;
    if !out.status.success() {
        bail!("validator-bench failed (its messages are above)");
    }
    md.push_str(&String::from_utf8_lossy(&out.stdout));
    Ok(md)
}
