//! `slotprof diff A B`: a differential flamegraph of two slots, windows or
//! sessions.

use std::path::{Path, PathBuf};

use anyhow::Context;
use flamegraphs::{svg, Folded};

/// Reads the folded profile behind `input`: a `.folded` file, or a slot,
/// window or session directory (its `oncpu.folded`, or `offcpu.folded`).
pub fn load(input: &Path, offcpu: bool) -> anyhow::Result<(PathBuf, Folded)> {
    let path = if input.is_dir() {
        input.join(if offcpu { "offcpu.folded" } else { "oncpu.folded" })
    } else {
        input.to_path_buf()
    };
    let text = crate::output::read_text_bounded(&path, MAX_FOLDED_BYTES).with_context(|| {
        format!(
            "cannot read {}: give a slot, window or session directory (e.g. OUT/slots/1234) or a .folded file",
            path.display()
        )
    })?;
    let folded =
        Folded::parse(&text).with_context(|| format!("{} is not a folded-stacks file", path.display()))?;
    Ok((path, folded))
}

/// The largest folded file read (a day of a validator's stacks is tens of MB).
const MAX_FOLDED_BYTES: u64 = 1 << 30;

/// Writes the differential SVG of `before` -> `after` to `out`.
pub fn run(before: &Path, after: &Path, offcpu: bool, normalize: bool, out: &Path) -> anyhow::Result<String> {
    let (bp, b) = load(before, offcpu)?;
    let (ap, a) = load(after, offcpu)?;
    let unit = if offcpu { "ns" } else { "samples" };
    let opts = svg::SvgOptions {
        title: format!("{} -> {}", label(before), label(after)),
        subtitle: Some(format!(
            "width: after; red grew, blue shrank{}",
            if normalize {
                " (before scaled to after's total)"
            } else {
                ""
            }
        )),
        count_name: unit.into(),
        palette: "hot".into(),
    };
    let bytes = svg::render_diff(&b, &a, normalize, &opts)?;
    crate::output::write_atomic(out, &bytes)?;
    Ok(format!(
        "{}: {} {unit}\n{}: {} {unit}\nwrote {}",
        bp.display(),
        b.total(),
        ap.display(),
        a.total(),
        out.display()
    ))
}

/// "slots/1234" for a slot directory, else the path.
fn label(p: &Path) -> String {
    let parts: Vec<_> = p.components().rev().take(2).collect();
    if parts.len() == 2 {
        format!(
            "{}/{}",
            parts[1].as_os_str().to_string_lossy(),
            parts[0].as_os_str().to_string_lossy()
        )
    } else {
        p.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diffs_two_slot_dirs_and_explains_bad_input() {
        let dir = std::env::temp_dir().join(format!("slotprof-diff-{}", std::process::id()));
        for (slot, n) in [("1", 10), ("2", 30)] {
            let d = dir.join("slots").join(slot);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("oncpu.folded"), format!("t;main;work {n}\nt;main 5\n")).unwrap();
        }
        let out = dir.join("d.svg");
        let msg = run(&dir.join("slots/1"), &dir.join("slots/2"), false, false, &out).unwrap();
        assert!(msg.contains("15 samples") && msg.contains("35 samples"), "{msg}");
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.contains("slots/1 -&gt; slots/2") || svg.contains("slots/1 -> slots/2"));
        let err = format!(
            "{:#}",
            run(&dir.join("nope"), &dir.join("slots/2"), false, false, &out).unwrap_err()
        );
        assert!(err.contains("give a slot, window or session directory"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_device_and_counts_past_u64_are_errors_not_hangs_or_wraps() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("d.svg");
        let ok = dir.path().join("ok.folded");
        std::fs::write(&ok, "a;b 1\n").unwrap();
        let err = format!(
            "{:#}",
            run(Path::new("/dev/zero"), &ok, false, false, &out).unwrap_err()
        );
        assert!(err.contains("not a regular file"), "{err}");
        let huge = dir.path().join("huge.folded");
        std::fs::write(&huge, format!("a;b {}\na;c {}\n", u64::MAX, u64::MAX)).unwrap();
        let err = format!("{:#}", run(&huge, &ok, false, false, &out).unwrap_err());
        assert!(err.contains("past 2^64"), "{err}");
        std::fs::write(&huge, format!("a;b {}\na;b 1\n", u64::MAX)).unwrap();
        let err = format!("{:#}", run(&huge, &ok, false, false, &out).unwrap_err());
        assert!(err.contains("past 2^64"), "{err}");
    }
}
