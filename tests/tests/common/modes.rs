//! Folded against exact off-CPU recording: two sessions on one process
//! at once, and their off-CPU time compared per thread and per stack over
//! the slots both wrote.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use super::read_folded;

/// Attaches twice at once to `pid` for `duration` with the same slot
/// source and arguments, `--offcpu exact` and `--offcpu folded`; returns
/// their outputs under `dir` (exact, folded). Both sessions must cut the
/// same slots: a clock source with a fixed origin (each session polling an
/// RPC itself places its boundaries up to a poll apart).
pub fn exact_and_folded(
    pid: u32,
    duration: &str,
    source: &str,
    extra: &[&str],
    dir: &Path,
) -> (PathBuf, PathBuf) {
    let pid = pid.to_string();
    let session = |mode: &str| {
        let out = dir.join(mode);
        let child = Command::new(super::slotprof())
            .args(["attach", "--pid", &pid, "--duration", duration, "--offcpu", mode])
            .args(extra)
            .args(["--slot-source", source, "--out"])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        (out, child)
    };
    let (exact_out, exact) = session("exact");
    let (folded_out, folded) = session("folded");
    for (mode, child) in [("exact", exact), ("folded", folded)] {
        let o = child.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "the {mode} session failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    (exact_out, folded_out)
}

/// One thread's or stack's off-CPU time in both sessions.
pub struct Diff {
    pub name: String,
    pub folded_ns: u64,
    pub exact_ns: u64,
}

impl Diff {
    /// How far folded is from exact, as a fraction of exact.
    pub fn off(&self) -> f64 {
        (self.folded_ns as f64 - self.exact_ns as f64).abs() / self.exact_ns.max(1) as f64
    }

    /// "name: F ms folded, E ms exact (P%)", P with `digits` decimals.
    pub fn describe(&self, digits: usize) -> String {
        format!(
            "{}: {:.1} ms folded, {:.1} ms exact ({:.digits$}%)",
            self.name,
            self.folded_ns as f64 / 1e6,
            self.exact_ns as f64 / 1e6,
            self.off() * 100.0
        )
    }
}

/// What [`compare`] compared.
pub struct Compared {
    /// The slots compared: those both sessions wrote, less two at each end.
    pub window: Vec<u64>,
    /// Threads with at least the minimum exact off-CPU time in the window.
    pub threads: Vec<Diff>,
    /// Those threads' stacks with at least 1% of their thread's time.
    pub stacks: Vec<Diff>,
}

impl Compared {
    /// The largest stack difference (0 with none compared).
    pub fn worst_stack(&self) -> f64 {
        self.stacks.iter().map(Diff::off).fold(0.0, f64::max)
    }
}

/// Compares the two sessions' off-CPU time over the slots both wrote (at
/// least `min_slots` of them, else it panics): every thread with
/// `min_thread_ns` or more in exact, and its stacks of 1% or more.
pub fn compare(exact: &Path, folded: &Path, min_slots: usize, min_thread_ns: u64) -> Compared {
    let both: Vec<u64> = slot_numbers(exact)
        .intersection(&slot_numbers(folded))
        .copied()
        .collect();
    assert!(both.len() > min_slots, "too few slots in both sessions: {both:?}");
    let window = both[2..both.len() - 2].to_vec();
    let (e_threads, e_stacks) = offcpu_in_slots(exact, &window);
    let (f_threads, f_stacks) = offcpu_in_slots(folded, &window);
    let threads = e_threads
        .iter()
        .filter(|(_, &e)| e >= min_thread_ns)
        .map(|(t, &e)| Diff {
            name: t.clone(),
            folded_ns: f_threads.get(t).copied().unwrap_or(0),
            exact_ns: e,
        })
        .collect();
    let stacks = e_stacks
        .iter()
        .filter(|(stack, &e)| {
            let thread = stack.split(';').next().unwrap_or("");
            let of_thread = e_threads.get(thread).copied().unwrap_or(0);
            of_thread >= min_thread_ns && e as f64 >= 0.01 * of_thread as f64
        })
        .map(|(stack, &e)| Diff {
            name: stack.clone(),
            folded_ns: f_stacks.get(stack).copied().unwrap_or(0),
            exact_ns: e,
        })
        .collect();
    Compared {
        window,
        threads,
        stacks,
    }
}

/// Per thread (the folded stack's root) and per stack: off-CPU time in
/// the slots `numbers` of the session in `out`.
fn offcpu_in_slots(out: &Path, numbers: &[u64]) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let (mut threads, mut stacks) = (BTreeMap::new(), BTreeMap::new());
    for n in numbers {
        let f = out.join("slots").join(n.to_string()).join("offcpu.folded");
        if !f.exists() {
            continue;
        }
        for (stack, v) in read_folded(&f).iter() {
            let thread = stack.split(';').next().unwrap_or("").to_string();
            *threads.entry(thread).or_insert(0) += v;
            *stacks.entry(stack.to_string()).or_insert(0) += v;
        }
    }
    (threads, stacks)
}

/// The slot numbers a session wrote.
fn slot_numbers(out: &Path) -> BTreeSet<u64> {
    std::fs::read_dir(out.join("slots"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}
