//! BENCHMARKS.md's sections: their headings, the commit each was measured
//! at, and replacing one section in the file. Shared by `bench` and `soak`.

use std::{path::Path, process::Command};

/// Section headings (`--only NAME` replaces that section alone).
pub(crate) const STORM_HEADING: &str = "## Detector probes on a futex-heavy workload";

pub(crate) const RUN_HEADING: &str = "## Always-on memory and CPU (`slotprof run`)";

pub(crate) const OVERHEAD_HEADING: &str = "## Overhead on a CPU-bound PoH loop: slotprof and perf";

pub(crate) const USERSPACE_HEADING: &str = "## The aggregator and the symbolizer (userspace, one core)";

pub(crate) const VALIDATOR_HEADING: &str =
    "## On a real validator: solana-test-validator 4.4.0 under load, beside perf";

pub(crate) const PHASE_HEADING: &str = "## Phase probe (guest mode) on a CPU-bound PoH loop";

pub(crate) const HOST_HEADING: &str = "## Host mode during compaction";

/// Written by `cargo xtask soak`; a whole `bench` keeps it.
pub(crate) const SOAK_HEADING: &str = "## Fault soak";

/// Which commit a section was measured at: the short hash, and whether the
/// work tree had changes on top of it.
pub(crate) fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(hash) = git(&["rev-parse", "--short=7", "HEAD"]) else {
        return "an unknown commit (not a git checkout)".into();
    };
    // BENCHMARKS.md itself is not a change to what is measured (the
    // sections run one after another rewrite it).
    let dirty = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!BENCHMARKS.md",
    ])
    .is_some_and(|s| !s.is_empty());
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    format!(
        "commit `{hash}`{} ({date})",
        if dirty { " with uncommitted changes" } else { "" }
    )
}

/// A section with the commit it was measured at under its heading.
pub(crate) fn stamped(root: &Path, section: String) -> String {
    match section.split_once('\n') {
        Some((heading, rest)) => format!("{heading}\n\nMeasured at {}.\n{rest}", commit(root)),
        None => section,
    }
}

/// `md` with the section under `heading` replaced by `section` (inserted
/// before "## Reproduce" when it is not there yet).
pub(crate) fn splice(md: &str, heading: &str, section: &str) -> String {
    match md.find(heading) {
        Some(i) => {
            let rest = &md[i + heading.len()..];
            let end = rest.find("\n## ").map_or(md.len(), |j| i + heading.len() + j + 1);
            format!("{}{section}{}", &md[..i], &md[end..])
        }
        None => match md.find("## Reproduce") {
            Some(i) => format!("{}{section}{}", &md[..i], &md[i..]),
            None => md.to_string() + section,
        },
    }
}
