//! `slotprof explain`: which stall class costs this node its slots. The
//! reference incident ended with a statistic, not a flamegraph: blocks
//! built in the host's slow phase were 4.8 times as likely to be small. This
//! does that comparison over slotprof's own per-slot records: for each
//! exposure (a finding kind in the slot or the slot before, the slow phase,
//! the position in the leader window), the bad-slot rate with and without
//! it, their ratio with an exact 95% interval ([`stats`]) and the share of
//! bad slots it accounts for; per node and pooled.
//!
//! Input: the per-slot lines of an always-on export (`hours/*/slots.jsonl`)
//! or the `slots/*/slot.json` of attach/record sessions, several nodes at
//! once (one directory each). What makes a slot bad is the caller's rule
//! ([`Outcomes`]). Pure apart from reading those files.

pub mod html;
pub mod stats;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::{Path, PathBuf},
};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::slot_sources::blocks::{BlockOutcome, OUTCOMES_FILE};

/// One slot as explain reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotRow {
    /// The directory it came from (one per node).
    pub node: String,
    pub slot: u64,
    pub leader: bool,
    /// 0-3 within its leader window; None outside one.
    pub window_position: Option<u64>,
    pub duration_ms: f64,
    /// The finding kinds placed in it.
    pub kinds: BTreeSet<String>,
    /// "slow" or "fast" when the phase probe ran.
    pub phase: Option<String>,
    /// Its block, as `slotprof run` recorded it from the node's RPC.
    pub block: Option<BlockOutcome>,
    /// How the timeline of `explain.html` draws it.
    pub bar: crate::export::timeline_page::Bar,
}

/// The fields of a slot line explain reads (slot.json and slots.jsonl
/// lines have more).
#[derive(Deserialize)]
struct Line {
    number: u64,
    #[serde(default)]
    leader: bool,
    #[serde(default)]
    window: Option<u64>,
    #[serde(default)]
    duration_ms: f64,
    #[serde(default)]
    findings: Vec<LineFinding>,
    #[serde(default)]
    phase: Option<String>,
    #[serde(default)]
    start_ns: u64,
    #[serde(default)]
    aligned: bool,
    #[serde(default)]
    threads: Vec<LineThread>,
}

#[derive(Deserialize)]
struct LineFinding {
    kind: String,
    #[serde(default)]
    duration_ns: u64,
}

#[derive(Deserialize)]
struct LineThread {
    #[serde(default)]
    oncpu_ms: f64,
}

/// What reading a node's directory found.
#[derive(Debug, Default)]
pub struct Read {
    pub rows: Vec<SlotRow>,
    /// Lines that were not slot records, with where the first one was.
    pub bad_lines: u64,
    pub first_bad: Option<String>,
}

/// A slot file is a few KiB; an hour's lines a few MiB.
const MAX_FILE_BYTES: u64 = 256 << 20;

/// Reads every slot record under `dir` (an export or a session's output);
/// a slot seen twice (a session's slot.json and an hour's line) counts once.
pub fn read_node(dir: &Path) -> anyhow::Result<Read> {
    let node = dir
        .file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    let mut files: Vec<PathBuf> = Vec::new();
    for (sub, name) in [("hours", "slots.jsonl"), ("slots", "slot.json")] {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path().join(name);
            if p.is_file() {
                files.push(p);
            }
        }
    }
    anyhow::ensure!(
        !files.is_empty(),
        "{}: no slots found (expected hours/*/slots.jsonl from `slotprof run` or slots/*/slot.json \
         from `slotprof attach --slot-source ...`)",
        dir.display()
    );
    files.sort();
    let mut read = Read::default();
    let mut seen = BTreeMap::new();
    for f in files {
        // Named: a binary file said only "stream did not contain valid UTF-8".
        let text =
            crate::output::read_text_bounded(&f, MAX_FILE_BYTES).with_context(|| f.display().to_string())?;
        // A session's slot.json is one pretty-printed object; an hour's
        // file one object per line.
        let records: Vec<&str> = if f.extension().is_some_and(|e| e == "json") {
            vec![text.as_str()]
        } else {
            text.lines().filter(|l| !l.trim().is_empty()).collect()
        };
        for (i, r) in records.into_iter().enumerate() {
            match serde_json::from_str::<Line>(r) {
                Ok(l) => {
                    seen.insert(l.number, row(&node, l));
                }
                Err(e) => {
                    read.bad_lines += 1;
                    read.first_bad
                        .get_or_insert_with(|| format!("{}:{}: {e}", f.display(), i + 1));
                }
            }
        }
    }
    let blocks = read_blocks(dir, &mut read)?;
    read.rows = seen
        .into_values()
        .map(|mut r: SlotRow| {
            r.block = blocks.get(&r.slot).cloned();
            r
        })
        .collect();
    Ok(read)
}

/// The block outcomes under `dir` (hours/*/outcomes.jsonl), by slot; bad
/// lines are counted in `read`.
fn read_blocks(dir: &Path, read: &mut Read) -> anyhow::Result<BTreeMap<u64, BlockOutcome>> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir.join("hours")) else {
        return Ok(out);
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path().join(OUTCOMES_FILE))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    for f in files {
        let text =
            crate::output::read_text_bounded(&f, MAX_FILE_BYTES).with_context(|| f.display().to_string())?;
        for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            match serde_json::from_str::<BlockOutcome>(l) {
                Ok(b) => {
                    out.insert(b.slot, b);
                }
                Err(e) => {
                    read.bad_lines += 1;
                    read.first_bad
                        .get_or_insert_with(|| format!("{}:{}: {e}", f.display(), i + 1));
                }
            }
        }
    }
    Ok(out)
}

fn row(node: &str, l: Line) -> SlotRow {
    let mut bar = crate::export::timeline_page::Bar {
        number: l.number,
        start_ns: l.start_ns,
        duration_ms: l.duration_ms,
        leader: l.leader,
        aligned: l.aligned,
        phase: l.phase.clone(),
        ..Default::default()
    };
    bar.parts[0] = l.threads.iter().map(|t| t.oncpu_ms).fold(0.0, f64::max);
    for f in &l.findings {
        bar.add_finding(&f.kind, f.duration_ns as f64 / 1e6);
    }
    SlotRow {
        node: node.to_string(),
        slot: l.number,
        leader: l.leader,
        window_position: l.window.map(|w| l.number.saturating_sub(w)),
        duration_ms: l.duration_ms,
        kinds: l.findings.into_iter().map(|f| f.kind).collect(),
        phase: l.phase,
        block: None,
        bar,
    }
}

/// What makes a slot bad.
#[derive(Clone, Debug)]
pub enum Outcomes {
    /// Slots longer than this many ms (a slow slot, measured here).
    LongerThan(f64),
    /// The operator's own judgement, per slot (`--outcomes FILE`).
    Given(HashMap<u64, bool>),
    /// The node's own blocks (`--blocks`): skipped, or under a number of
    /// compute units or (instead) of transactions.
    Blocks {
        cu_below: Option<u64>,
        tx_below: Option<u64>,
    },
}

impl Outcomes {
    /// What made a slot bad, in words (for the report).
    pub fn describe(&self) -> String {
        match self {
            Outcomes::LongerThan(ms) => format!("the slot lasted longer than {ms} ms"),
            Outcomes::Given(m) => format!(
                "the operator's outcomes ({} slots, {} bad)",
                m.len(),
                m.values().filter(|b| **b).count()
            ),
            Outcomes::Blocks { cu_below, tx_below } => format!(
                "the node's own blocks (getBlock from its RPC, recorded by `slotprof run`): skipped, or {}",
                match (cu_below, tx_below) {
                    (_, Some(t)) => format!("fewer than {t} transactions"),
                    (Some(c), None) => format!("under {c} compute units"),
                    (None, None) => "nothing else".into(),
                }
            ),
        }
    }

    /// Whether `r` was bad; None when there is no outcome for it.
    pub fn bad(&self, r: &SlotRow) -> Option<bool> {
        match self {
            Outcomes::LongerThan(ms) => Some(r.duration_ms > *ms),
            Outcomes::Given(m) => m.get(&r.slot).copied(),
            Outcomes::Blocks { cu_below, tx_below } => {
                let b = r.block.as_ref()?;
                if b.skipped {
                    return Some(true);
                }
                match (cu_below, tx_below) {
                    (_, Some(t)) => Some(b.transactions? < *t),
                    (Some(c), None) => Some(b.compute_units? < *c),
                    (None, None) => Some(false),
                }
            }
        }
    }

    /// Reads a JSON-lines file of `{"slot": N, "bad": true}` or
    /// `{"slot": N, "value": X}` (bad when below `threshold`, as the
    /// incident judged blocks by their compute units).
    pub fn read(path: &Path, threshold: Option<f64>) -> anyhow::Result<Self> {
        #[derive(Deserialize)]
        struct Given {
            slot: u64,
            bad: Option<bool>,
            value: Option<f64>,
        }
        let text = crate::output::read_text_bounded(path, MAX_FILE_BYTES)
            .with_context(|| format!("--outcomes {}", path.display()))?;
        let mut out = HashMap::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let g: Given = serde_json::from_str(line).with_context(|| {
                format!(
                    "--outcomes {}:{}: expected {{\"slot\": N, \"bad\": true}} or {{\"slot\": N, \"value\": X}}",
                    path.display(),
                    i + 1
                )
            })?;
            let bad = match (g.bad, g.value, threshold) {
                (Some(b), _, _) => b,
                (None, Some(v), Some(t)) => v < t,
                (None, Some(_), None) => anyhow::bail!(
                    "--outcomes {}:{}: a value needs --threshold (bad when below it)",
                    path.display(),
                    i + 1
                ),
                (None, None, _) => anyhow::bail!(
                    "--outcomes {}:{}: neither \"bad\" nor \"value\"",
                    path.display(),
                    i + 1
                ),
            };
            out.insert(g.slot, bad);
        }
        Ok(Outcomes::Given(out))
    }
}

/// One exposure's comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub exposure: String,
    #[serde(flatten)]
    pub ratio: stats::RateRatio,
    /// Plainly, when the counts cannot carry a conclusion.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The comparisons of one node, or of all pooled.
#[derive(Clone, Debug, Serialize)]
pub struct Table {
    pub node: String,
    /// Which slots were judged: "leader slots" (this node's blocks), or
    /// "all slots" when the data has no leader schedule (a clock slot
    /// source without `leader=`).
    pub judged: &'static str,
    /// Slots with an outcome, and the bad ones among them.
    pub slots: u64,
    pub bad: u64,
    /// Strongest first: by the interval's lower end.
    pub rows: Vec<Row>,
}

/// Fewer bad slots than this in all: no conclusion is drawn.
pub const MIN_BAD: u64 = 5;

/// The exposures of a slot, given the slot before it (same node).
fn exposures(r: &SlotRow, prev: Option<&SlotRow>) -> BTreeSet<String> {
    let mut e = BTreeSet::new();
    for k in &r.kinds {
        e.insert(format!("{k} in the slot"));
    }
    if let Some(p) = prev.filter(|p| p.slot + 1 == r.slot) {
        for k in &p.kinds {
            e.insert(format!("{k} in the slot before"));
        }
    }
    if r.phase.as_deref() == Some("slow") {
        e.insert("slow phase".into());
    }
    if let Some(i) = r.window_position {
        e.insert(format!("leader window slot {}", i + 1));
    }
    e
}

/// A node's slots as its timeline draws them, each judged as the table
/// judges it (leader slots only, when the data knows them).
fn bars(rows: &[SlotRow], outcomes: &Outcomes) -> Vec<crate::export::timeline_page::Bar> {
    let leaders_known = rows.iter().any(|r| r.leader);
    rows.iter()
        .map(|r| {
            let mut b = r.bar.clone();
            b.bad = (r.leader || !leaders_known).then(|| outcomes.bad(r)).flatten();
            b
        })
        .collect()
}

/// Compares bad-slot rates with and without each exposure seen.
pub fn table(node: &str, rows: &[SlotRow], outcomes: &Outcomes) -> Table {
    // A node's blocks are its leader slots: only those are judged, when
    // the data knows them.
    let leaders_known = rows.iter().any(|r| r.leader);
    let mut judged: Vec<(BTreeSet<String>, bool)> = Vec::new();
    let mut prev: Option<&SlotRow> = None;
    for r in rows {
        let e = exposures(r, prev.filter(|p| p.node == r.node));
        if r.leader || !leaders_known {
            if let Some(bad) = outcomes.bad(r) {
                judged.push((e, bad));
            }
        }
        prev = Some(r);
    }
    let all: BTreeSet<String> = judged.iter().flat_map(|(e, _)| e.iter().cloned()).collect();
    let total = judged.len() as u64;
    let bad = judged.iter().filter(|(_, b)| *b).count() as u64;
    let mut out: Vec<Row> = all
        .into_iter()
        .map(|name| {
            let (mut a, mut n1, mut c, mut n0) = (0, 0, 0, 0);
            for (e, b) in &judged {
                if e.contains(&name) {
                    n1 += 1;
                    a += u64::from(*b);
                } else {
                    n0 += 1;
                    c += u64::from(*b);
                }
            }
            let ratio = stats::rate_ratio(a, n1, c, n0);
            let note = if bad < MIN_BAD {
                Some(format!(
                    "{bad} bad slots in all: too few to conclude (at least {MIN_BAD})"
                ))
            } else if n1 == 0 || n0 == 0 {
                Some("every slot or none has it: nothing to compare".into())
            } else {
                None
            };
            Row {
                exposure: name,
                ratio,
                note,
            }
        })
        .collect();
    out.sort_by(|x, y| {
        let key = |r: &Row| r.ratio.low.unwrap_or(0.0);
        key(y)
            .total_cmp(&key(x))
            .then_with(|| x.exposure.cmp(&y.exposure))
    });
    Table {
        node: node.to_string(),
        judged: if leaders_known {
            "leader slots"
        } else {
            "all slots"
        },
        slots: total,
        bad,
        rows: out,
    }
}

/// The table as text, the way a terminal shows it.
pub fn render(t: &Table) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {} slots judged ({}), {} bad ({:.2}%)",
        t.node,
        t.slots,
        t.judged,
        t.bad,
        100.0 * t.bad as f64 / t.slots.max(1) as f64
    );
    let _ = writeln!(
        s,
        "  {:<44} {:>13} {:>13} {:>9} {:>17} {:>8}",
        "exposure", "bad/with", "bad/without", "ratio", "95% CI", "share"
    );
    let num = |v: Option<f64>| match v {
        Some(x) if x.is_infinite() => "inf".to_string(),
        Some(x) => format!("{x:.2}"),
        None => "-".to_string(),
    };
    for r in &t.rows {
        let q = &r.ratio;
        let _ = writeln!(
            s,
            "  {:<44} {:>13} {:>13} {:>9} {:>17} {:>7}{}",
            r.exposure,
            format!("{}/{}", q.exposed_bad, q.exposed),
            format!("{}/{}", q.unexposed_bad, q.unexposed),
            num(q.ratio),
            format!("{}-{}", num(q.low), num(q.high)),
            // A share of bad slots is claimed only where the interval
            // says the exposure raises the risk.
            match q.attributable_share {
                Some(a) if stats::raises_risk(q) => format!("{:.0}%", a * 100.0),
                Some(_) => "n.s.".into(),
                None => "-".into(),
            },
            if stats::raises_risk(q) {
                "  <- raises the risk"
            } else {
                ""
            }
        );
        if let Some(n) = &r.note {
            let _ = writeln!(s, "      {n}");
        }
    }
    s
}

/// What `explain.json` holds.
#[derive(Debug, Serialize)]
pub struct Report {
    pub version: &'static str,
    /// What made a slot bad.
    pub outcomes: String,
    /// One per node, then all nodes pooled (when more than one).
    pub tables: Vec<Table>,
    /// Lines that were not slot records, per node.
    pub bad_lines: BTreeMap<String, u64>,
}

/// `slotprof explain`: reads each node's slots, compares, returns the text
/// to print; writes `explain.json` into `out` when given.
pub fn run(dirs: &[PathBuf], outcomes: &Outcomes, out: Option<&Path>) -> anyhow::Result<String> {
    let mut tables = Vec::new();
    let mut pooled = Vec::new();
    let mut bad_lines = BTreeMap::new();
    let mut timelines = Vec::new();
    let mut text = format!("bad slots: {}\n", outcomes.describe());
    for d in dirs {
        let read = read_node(d)?;
        if let Some(first) = &read.first_bad {
            text.push_str(&format!(
                "slotprof: warning: {} lines that are not slot records skipped (first: {first})\n",
                read.bad_lines
            ));
        }
        let Some(node) = read.rows.first().map(|r| r.node.clone()) else {
            continue;
        };
        bad_lines.insert(node.clone(), read.bad_lines);
        let t = table(&node, &read.rows, outcomes);
        anyhow::ensure!(
            t.slots > 0,
            "{}: none of its {} slots has an outcome (are the --outcomes slot numbers this node's?)",
            d.display(),
            read.rows.len()
        );
        text.push_str(&render(&t));
        tables.push(t);
        timelines.push((node, bars(&read.rows, outcomes)));
        pooled.extend(read.rows);
    }
    if dirs.len() > 1 {
        let t = table("all nodes", &pooled, outcomes);
        text.push_str(&render(&t));
        tables.push(t);
    }
    if let Some(out) = out {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        let report = Report {
            version: crate::VERSION,
            outcomes: outcomes.describe(),
            tables,
            bad_lines,
        };
        let path = out.join("explain.json");
        crate::output::write_atomic(&path, &serde_json::to_vec_pretty(&report)?)?;
        text.push_str(&format!("  {}\n", path.display()));
        let path = out.join("explain.html");
        let page = html::page(&report.outcomes, &timelines, &report.tables);
        crate::output::write_atomic(&path, page.as_bytes())?;
        text.push_str(&format!("  {}\n", path.display()));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: u64, kinds: &[&str], phase: Option<&str>, ms: f64) -> SlotRow {
        SlotRow {
            node: "a".into(),
            slot: n,
            leader: true,
            window_position: Some(n % 4),
            duration_ms: ms,
            kinds: kinds.iter().map(|k| k.to_string()).collect(),
            phase: phase.map(str::to_string),
            block: None,
            bar: Default::default(),
        }
    }

    /// 400 slots: MainLoopGap in every 4th, and those are long 3 times in
    /// 4 (the others 1 in 50); LockContention in every 5th, harmless.
    fn rows() -> Vec<SlotRow> {
        (0..400u64)
            .map(|n| {
                let gap = n % 4 == 1;
                let lock = n % 5 == 0;
                let long = if gap { n % 16 != 1 } else { n % 50 == 7 };
                let mut kinds = Vec::new();
                if gap {
                    kinds.push("MainLoopGap");
                }
                if lock {
                    kinds.push("LockContention");
                }
                slot(
                    n,
                    &kinds,
                    Some(if n % 2 == 0 { "slow" } else { "fast" }),
                    if long { 500.0 } else { 400.0 },
                )
            })
            .collect()
    }

    #[test]
    fn the_costly_class_ranks_first_and_the_harmless_one_does_not_raise_the_risk() {
        let t = table("a", &rows(), &Outcomes::LongerThan(450.0));
        assert_eq!(t.slots, 400);
        let first = &t.rows[0];
        assert_eq!(first.exposure, "MainLoopGap in the slot", "{}", render(&t));
        assert!(stats::raises_risk(&first.ratio));
        // With: 75 of 100 bad; without: the 1-in-50 ones that are not gap
        // slots (7, 107, 207, 307: 4 of 300).
        assert_eq!((first.ratio.exposed_bad, first.ratio.exposed), (75, 100));
        assert_eq!((first.ratio.unexposed_bad, first.ratio.unexposed), (4, 300));
        let lock = t
            .rows
            .iter()
            .find(|r| r.exposure == "LockContention in the slot")
            .unwrap();
        assert!(!stats::raises_risk(&lock.ratio), "{}", render(&t));
        assert!(
            lock.ratio.low.unwrap() < 1.0 && lock.ratio.high.unwrap() > 1.0 || lock.ratio.high.unwrap() < 1.0
        );
        // The slot after a gap slot is not longer for it (window slot 3 is).
        let after = t
            .rows
            .iter()
            .find(|r| r.exposure == "MainLoopGap in the slot before")
            .unwrap();
        assert!(!stats::raises_risk(&after.ratio), "{}", render(&t));
        assert!(render(&t).contains("<- raises the risk"));
    }

    #[test]
    fn only_leader_slots_are_judged_when_the_schedule_is_known() {
        let mut rows = rows();
        // Every third slot another node's: long or not, not this node's block.
        for r in rows.iter_mut().filter(|r| r.slot % 3 == 0) {
            r.leader = false;
            r.duration_ms = 900.0;
        }
        let t = table("a", &rows, &Outcomes::LongerThan(450.0));
        assert_eq!(t.judged, "leader slots");
        assert_eq!(t.slots, rows.iter().filter(|r| r.leader).count() as u64);
        // Without any leader slot: all of them, said.
        rows.iter_mut().for_each(|r| r.leader = false);
        let t = table("a", &rows, &Outcomes::LongerThan(450.0));
        assert_eq!((t.judged, t.slots), ("all slots", 400));
        assert!(
            render(&t).contains("400 slots judged (all slots)"),
            "{}",
            render(&t)
        );
    }

    #[test]
    fn too_few_bad_slots_say_so() {
        let rows: Vec<SlotRow> = (0..50)
            .map(|n| slot(n, &[], None, if n == 3 { 900.0 } else { 400.0 }))
            .collect();
        let t = table("a", &rows, &Outcomes::LongerThan(450.0));
        assert_eq!(t.bad, 1);
        assert!(t
            .rows
            .iter()
            .all(|r| r.note.as_deref().is_some_and(|n| n.contains("too few"))));
    }

    #[test]
    fn outcomes_from_a_file_by_flag_or_value_and_bad_lines_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("o.jsonl");
        std::fs::write(&f, "{\"slot\": 1, \"bad\": true}\n{\"slot\": 2, \"value\": 6500000}\n\n{\"slot\": 3, \"value\": 9e6}\n").unwrap();
        let Outcomes::Given(m) = Outcomes::read(&f, Some(7e6)).unwrap() else {
            panic!()
        };
        assert_eq!((m[&1], m[&2], m[&3]), (true, true, false));
        let e = Outcomes::read(&f, None).unwrap_err().to_string();
        assert!(e.contains("--threshold"), "{e}");
        std::fs::write(&f, "{\"slot\": 1}\n").unwrap();
        assert!(Outcomes::read(&f, None).is_err());
    }

    #[test]
    fn a_binary_file_where_slot_lines_go_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let hour = dir.path().join("node/hours/2026-12-05T14");
        std::fs::create_dir_all(&hour).unwrap();
        std::fs::write(hour.join("slots.jsonl"), b"{\"number\":1}\n\xff\xfe\x00binary").unwrap();
        let e = format!("{:#}", read_node(&dir.path().join("node")).unwrap_err());
        assert!(
            e.contains("slots.jsonl") && e.contains("not text (byte 13 is not UTF-8)"),
            "{e}"
        );
    }

    #[test]
    fn a_node_is_read_from_an_export_and_a_session_and_bad_lines_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node-a");
        std::fs::create_dir_all(node.join("hours/2026-12-05T14")).unwrap();
        std::fs::create_dir_all(node.join("slots/12")).unwrap();
        std::fs::write(
            node.join("hours/2026-12-05T14/slots.jsonl"),
            "{\"number\":10,\"leader\":true,\"window\":8,\"duration_ms\":401.0,\"findings\":[{\"kind\":\"MainLoopGap\"}],\"phase\":\"slow\"}\nnot json\n{\"number\":11,\"duration_ms\":399.0}\n",
        )
        .unwrap();
        std::fs::write(
            node.join("slots/12/slot.json"),
            "{\n  \"number\": 12,\n  \"duration_ms\": 420.5\n}",
        )
        .unwrap();
        let r = read_node(&node).unwrap();
        assert_eq!(r.rows.iter().map(|r| r.slot).collect::<Vec<_>>(), [10, 11, 12]);
        assert_eq!(r.rows[0].window_position, Some(2));
        assert!(r.rows[0].kinds.contains("MainLoopGap"));
        assert_eq!(r.rows[0].node, "node-a");
        assert_eq!(r.bad_lines, 1);
        assert!(r.first_bad.unwrap().contains("slots.jsonl:2"));
        let e = read_node(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no slots found"), "{e}");
    }

    #[test]
    fn blocks_recorded_by_run_are_read_and_judged_skipped_or_small() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node-b");
        let hour = node.join("hours/2026-12-05T15");
        std::fs::create_dir_all(&hour).unwrap();
        std::fs::write(
            hour.join("slots.jsonl"),
            (20..24)
                .map(|n| format!("{{\"number\":{n},\"leader\":true,\"duration_ms\":400.0}}\n"))
                .collect::<String>(),
        )
        .unwrap();
        std::fs::write(
            hour.join(OUTCOMES_FILE),
            "{\"slot\":20,\"source\":\"rpc getBlock\",\"skipped\":true}\n\
             {\"slot\":21,\"source\":\"rpc getBlock\",\"skipped\":false,\"transactions\":3,\"compute_units\":6000000}\n\
             {\"slot\":22,\"source\":\"rpc getBlock\",\"skipped\":false,\"transactions\":900,\"compute_units\":9000000}\n\
             {\"slot\": \"x\"}\n",
        )
        .unwrap();
        let r = read_node(&node).unwrap();
        assert_eq!(r.bad_lines, 1);
        let by_cu = Outcomes::Blocks {
            cu_below: Some(7_000_000),
            tx_below: None,
        };
        let judged: Vec<_> = r.rows.iter().map(|row| by_cu.bad(row)).collect();
        // 20 skipped, 21 small, 22 full, 23 has no outcome (not judged).
        assert_eq!(judged, [Some(true), Some(true), Some(false), None]);
        let by_tx = Outcomes::Blocks {
            cu_below: None,
            tx_below: Some(2),
        };
        let judged: Vec<_> = r.rows.iter().map(|row| by_tx.bad(row)).collect();
        assert_eq!(judged, [Some(true), Some(false), Some(false), None]);
        assert!(
            by_cu.describe().contains("under 7000000 compute units"),
            "{}",
            by_cu.describe()
        );
    }
}
