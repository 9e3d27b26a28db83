//! The export directory of `slotprof run`: per-slot directories written
//! whole (a temporary directory, then a rename), leader windows, hourly
//! profiles, summary lines, the index; retention by bytes and by age
//! (oldest first) and a free-space floor below which nothing is written.
//!
//! Slot and window directories are not synced to disk: a validator's disk
//! is busy with its ledger, and a sync per file (a dozen per slot, 2-4
//! slots a second) forces journal commits it would wait behind. A power
//! loss can lose the last seconds of them (never a half directory: each
//! appears by one rename); the hourly files, the index and findings.json
//! are synced.
//!
//! Layout under the export directory:
//! - `slots/<n>/`: oncpu/offcpu .folded, profile.pb.gz, slot.json (slots
//!   with findings and leader slots, per `export.full`), and the .svg
//!   flamegraphs of a slot with findings; the others' are drawn from the
//!   .folded when the server (`metrics.listen`) is asked for them;
//! - `windows/<first>/`: a leader window's four slots together (its SVGs
//!   drawn as a slot's are);
//! - `hours/<YYYY-MM-DDTHH>/`: that hour's profiles (every slot) and
//!   slots.jsonl, one summary line per slot (every slot, exported or not);
//! - `findings.json` (the latest 1,000 findings), `index.html` (the latest
//!   300 exported slots).

use std::{
    collections::{BTreeMap, VecDeque},
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use anyhow::Context;
use flamegraphs::{pprof::ProfileMeta, FoldedSum};

use super::{SlotExport, SlotResult};
use crate::{
    detectors::Finding,
    export::report::{write_profiles, write_profiles_with, Draw, Parts, SlotLabels, WindowSlots},
    export::slot_export::{index_html, merged, summarize, window_json, SlotSummary},
    output::{append_whole, write_atomic},
    pipeline::aggregate::Profiles,
    slots::Slot,
};

/// Findings kept for findings.json and the index (every finding is in its
/// slot's slot.json and its hour's slots.jsonl as well). Small enough that
/// slotprof's memory stops growing within the first hour of a busy node.
const RECENT_FINDINGS: usize = 1_000;
/// Fully exported slots listed in the index.
const RECENT_SLOTS: usize = 300;
/// Threads of each listed slot kept for the index (its busiest).
const INDEX_THREADS: usize = 3;
/// How often the index, findings.json and the current hour are rewritten.
const REWRITE_EVERY: Duration = Duration::from_secs(5);
const HOUR_REWRITE_EVERY: Duration = Duration::from_secs(300);

/// One retained export entry (a directory), oldest first in the ledger.
#[derive(Debug)]
struct Entry {
    path: PathBuf,
    bytes: u64,
    created: SystemTime,
}

/// The current hour's aggregate.
struct Hour {
    name: String,
    /// Its slots' time: the first one's start and the last one's end
    /// (CLOCK_MONOTONIC ns), for the profile's time and duration.
    span: Option<(u64, u64)>,
    oncpu: FoldedSum,
    offcpu: FoldedSum,
    lines: Vec<String>,
    last_write: Option<std::time::Instant>,
}

/// Which slots get a full export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FullExport {
    All,
    FindingsAndLeader,
    Findings,
}

/// What the exporter is told by its driver (from the configuration's
/// `[export]`): where, which slots in full, and what to keep how long.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportPolicy {
    pub dir: PathBuf,
    pub full: FullExport,
    pub hourly: bool,
    pub retention_bytes: u64,
    pub retention_age: Duration,
    pub free_space_floor: u64,
}

pub struct Exporter {
    dir: PathBuf,
    policy: FullExport,
    hourly: bool,
    retention_bytes: u64,
    retention_age: Duration,
    floor: u64,
    ledger: VecDeque<Entry>,
    /// Bytes of the ledger's entries.
    total: u64,
    /// Bytes of findings.json and index.html.
    root_bytes: u64,
    /// Below the free-space floor now.
    paused: bool,
    /// Slots not written for want of space.
    pub skipped_low_space: u64,
    /// Writes that failed (a slot, a window, the hour, the index), and the
    /// slots among them: each counted, the export goes on.
    pub write_errors: u64,
    pub slots_failed: u64,
    /// Slots written whole, and as a summary line only (by policy).
    pub slots_exported: u64,
    pub slots_summarised: u64,
    /// The last slot exported (whole or as a line), and when (Unix s).
    pub last_exported: Option<(u64, f64)>,
    /// In a run of failed writes (said at its first, and when it ends).
    failing: bool,
    /// Entries removed by retention.
    pub removed: u64,
    recent: VecDeque<SlotSummary>,
    findings: VecDeque<Finding>,
    dirty: bool,
    last_rewrite: Option<std::time::Instant>,
    /// Open leader windows: their slots so far, their profiles (with
    /// their labels), and
    /// whether any of those slots had findings.
    windows: BTreeMap<u64, (Vec<Slot>, WindowSlots, bool)>,
    hour: Option<Hour>,
    /// CLOCK_MONOTONIC to wall clock, in ns.
    mono_to_unix: i128,
}

/// How a slot was exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exported {
    Full,
    Summary,
    /// Below the free-space floor: counted, not written.
    Skipped,
    /// Its write failed (out of space below the floor's margin, out of
    /// descriptors, ...): counted, said, its temporary files removed.
    Failed,
}

fn dir_bytes(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    };
    rd.filter_map(Result::ok)
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                dir_bytes(&p)
            } else {
                e.metadata().map(|m| m.len()).unwrap_or(0)
            }
        })
        .sum()
}

/// Bytes free to an unprivileged writer on the file system holding `p`.
pub use crate::sys::free_bytes;

fn human(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

pub(crate) use crate::output::hour_name;

impl Exporter {
    /// One past the highest slot number in the export: its `slots/`
    /// directories and the last line of each hour's `slots.jsonl` (a slot
    /// not exported whole has only that line).
    pub fn next_slot_number(&self) -> u64 {
        let dirs = std::fs::read_dir(self.dir.join("slots"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok());
        let lines = std::fs::read_dir(self.dir.join("hours"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| last_line_number(&e.path().join("slots.jsonl")));
        let pending = self
            .hour
            .iter()
            .flat_map(|h| h.lines.last())
            .filter_map(|l| line_number(l));
        dirs.chain(lines)
            .chain(pending)
            .filter(|&n| n <= crate::slot_sources::MAX_SLOT)
            .max()
            .map_or(0, |n| n + 1)
    }

    /// Opens (creating) the export directory, removes what a crash left
    /// half-written, and takes stock of what is there for retention.
    pub fn open(config: &ExportPolicy) -> anyhow::Result<Self> {
        let dir = config.dir.clone();
        for sub in ["slots", "windows", "hours"] {
            std::fs::create_dir_all(dir.join(sub)).with_context(|| {
                format!(
                    "cannot create the export directory {} (set export.dir to a writable place)",
                    dir.join(sub).display()
                )
            })?;
        }
        // What a kill left half-written beside the whole files (the hidden
        // directories under slots/, windows/ and hours/ go below).
        crate::output::remove_temps(&dir);
        for h in std::fs::read_dir(dir.join("hours"))?.flatten() {
            crate::output::remove_temps(&h.path());
        }
        let mut found = Vec::new();
        for sub in ["slots", "windows", "hours"] {
            for e in std::fs::read_dir(dir.join(sub))?.filter_map(Result::ok) {
                let p = e.path();
                if e.file_name().to_string_lossy().starts_with('.') {
                    let _ = std::fs::remove_dir_all(&p);
                    continue;
                }
                let created = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::now());
                found.push(Entry {
                    bytes: dir_bytes(&p),
                    path: p,
                    created,
                });
            }
        }
        found.sort_by_key(|e| e.created);
        let total = found.iter().map(|e| e.bytes).sum();
        let unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as i128;
        let mut me = Self {
            dir,
            policy: config.full,
            hourly: config.hourly,
            retention_bytes: config.retention_bytes,
            retention_age: config.retention_age,
            floor: config.free_space_floor,
            ledger: found.into(),
            total,
            root_bytes: ["findings.json", "index.html"]
                .iter()
                .filter_map(|f| std::fs::metadata(config.dir.join(f)).ok())
                .map(|m| m.len())
                .sum(),
            paused: false,
            skipped_low_space: 0,
            write_errors: 0,
            slots_failed: 0,
            slots_exported: 0,
            slots_summarised: 0,
            last_exported: None,
            failing: false,
            removed: 0,
            recent: VecDeque::new(),
            findings: VecDeque::new(),
            dirty: true,
            last_rewrite: None,
            windows: BTreeMap::new(),
            hour: None,
            mono_to_unix: unix - crate::slots::monotonic_ns() as i128,
        };
        me.enforce_retention(None);
        Ok(me)
    }

    /// Takes a reloaded configuration's export policy (the directory stays).
    pub fn reconfigure(&mut self, config: &ExportPolicy) {
        if config.dir != self.dir {
            eprintln!(
                "slotprof: warning: export.dir changed to {}; it takes effect when slotprof restarts",
                config.dir.display()
            );
        }
        self.policy = config.full;
        self.hourly = config.hourly;
        self.retention_bytes = config.retention_bytes;
        self.retention_age = config.retention_age;
        self.floor = config.free_space_floor;
        self.enforce_retention(None);
    }

    /// Takes a write's outcome: a failure is counted and said when a run of
    /// failures begins (not once a slot while the disk stays full), and
    /// when writes work again. Whether it worked.
    fn attempt(&mut self, r: anyhow::Result<()>) -> bool {
        match r {
            Ok(()) => {
                if self.failing {
                    self.failing = false;
                    eprintln!(
                        "slotprof: the export is written again ({} writes failed so far)",
                        self.write_errors
                    );
                }
                true
            }
            Err(e) => {
                self.write_errors += 1;
                if !self.failing {
                    self.failing = true;
                    eprintln!(
                        "slotprof: warning: {e:#}; slotprof goes on with the next slot (failed writes are \
                         counted in slotprof_export_write_errors_total; said again when writes work again)"
                    );
                }
                false
            }
        }
    }

    /// Bytes the export holds.
    /// Nothing is written now: the file system is below its floor.
    pub fn paused(&self) -> bool {
        self.paused
    }

    pub fn bytes(&self) -> u64 {
        self.total + self.root_bytes
    }

    /// Whether there is room to write; says so when that changes.
    fn room(&mut self) -> bool {
        let free = free_bytes(&self.dir).unwrap_or(u64::MAX);
        let ok = free >= self.floor;
        if ok == self.paused {
            if ok {
                eprintln!(
                    "slotprof: export resumed: {} free on the export file system (floor {})",
                    human(free),
                    human(self.floor)
                );
            } else {
                eprintln!(
                    "slotprof: warning: export paused: only {} free on the file system of {} (floor {}, \
                     export.free_space_floor); slots are still counted and /metrics stays up; free space \
                     or lower export.retention_bytes",
                    human(free),
                    self.dir.display(),
                    human(self.floor)
                );
            }
            self.paused = !ok;
        }
        ok
    }

    fn record(&mut self, path: PathBuf) {
        let bytes = dir_bytes(&path);
        self.total += bytes;
        self.ledger.push_back(Entry {
            path,
            bytes,
            created: SystemTime::now(),
        });
    }

    /// Removes the oldest entries while the export (with its root files)
    /// is over its byte cap, and every entry older than the age limit;
    /// never `keep` nor the current hour's directory.
    fn enforce_retention(&mut self, keep: Option<&Path>) {
        self.make_room(keep, 0);
    }

    /// [`Self::enforce_retention`] leaving `headroom` bytes under the cap
    /// for what is about to be written.
    fn make_room(&mut self, keep: Option<&Path>, headroom: u64) {
        let now = SystemTime::now();
        let hour = self.hour.as_ref().map(|h| self.dir.join("hours").join(&h.name));
        let mut i = 0;
        while i < self.ledger.len() {
            let e = &self.ledger[i];
            let too_old = now.duration_since(e.created).unwrap_or_default() > self.retention_age;
            if !too_old && self.total + self.root_bytes + headroom <= self.retention_bytes {
                break; // under the cap, and younger entries follow
            }
            if Some(e.path.as_path()) == keep || Some(&e.path) == hour.as_ref() {
                i += 1;
                continue;
            }
            let e = self.ledger.remove(i).unwrap();
            let _ = std::fs::remove_dir_all(&e.path);
            self.total = self.total.saturating_sub(e.bytes);
            self.removed += 1;
            self.dirty = true;
        }
    }

    /// Writes `dir` whole: profiles and `json` into a hidden temporary
    /// directory beside it, then one rename.
    fn write_dir(
        dir: &Path,
        p: &Profiles,
        parts: Parts<'_>,
        meta: &ProfileMeta,
        subtitle: &str,
        draw: Draw,
        json: (&str, &[u8]),
    ) -> anyhow::Result<()> {
        let tmp =
            crate::output::temp_dir_beside(dir).with_context(|| format!("cannot write {}", dir.display()))?;
        let result = (|| {
            write_profiles_with(&tmp, p, parts, meta, subtitle, draw, crate::output::write_new)?;
            crate::output::write_new(&tmp.join(json.0), json.1)?;
            if dir.exists() {
                std::fs::remove_dir_all(dir)?;
            }
            std::fs::rename(&tmp, dir)?;
            anyhow::Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        result.with_context(|| format!("cannot write {}", dir.display()))
    }

    /// Exports one processed slot: in full or as a summary line, by policy.
    pub fn export(&mut self, r: &SlotResult<'_>) -> anyhow::Result<Exported> {
        let (slot, p, meta) = (r.slot, r.profiles, r.meta);
        let mut summary = summarize(r);
        let full = match self.policy {
            FullExport::All => true,
            FullExport::Findings => !summary.findings.is_empty(),
            FullExport::FindingsAndLeader => !summary.findings.is_empty() || slot.leader,
        };
        for f in &summary.findings {
            if self.findings.len() == RECENT_FINDINGS {
                self.findings.pop_front();
            }
            self.findings.push_back(f.clone());
            self.dirty = true;
        }
        let unix_s = ((slot.start_ns as i128 + self.mono_to_unix) / 1_000_000_000) as i64;
        self.hour_add(unix_s, p, &summary, meta);
        let labels = SlotLabels::of(slot, r.phase);
        self.window_add(slot, p, &labels, !summary.findings.is_empty(), meta);
        if !self.room() {
            self.skipped_low_space += 1;
            return Ok(Exported::Skipped);
        }
        if !full {
            return Ok(Exported::Summary);
        }
        // Room for a slot like the last one, before writing it.
        self.make_room(None, self.ledger.back().map_or(0, |e| e.bytes));
        let dir = self.dir.join("slots").join(slot.number.to_string());
        let sub = format!(
            "slot {}{}",
            slot.number,
            if slot.leader { " (leader)" } else { "" }
        );
        // A slot with findings is the one an operator opens: its
        // flamegraphs are drawn now; the others' when the server is asked.
        let draw = if summary.findings.is_empty() {
            Draw::OnRequest
        } else {
            Draw::Now
        };
        summary.flamegraphs_on_request = draw == Draw::OnRequest;
        let written = Self::write_dir(
            &dir,
            p,
            Parts::Slot(&labels),
            meta,
            &sub,
            draw,
            ("slot.json", &serde_json::to_vec_pretty(&summary)?),
        );
        if !self.attempt(written) {
            self.slots_failed += 1;
            return Ok(Exported::Failed);
        }
        self.record(dir.clone());
        if self.recent.len() == RECENT_SLOTS {
            self.recent.pop_front();
        }
        // The index shows a slot's three busiest threads (on-CPU first);
        // slot.json has them all. A node's 166 threads in each of 300
        // listed slots were 3 MB held for nothing.
        summary.threads.truncate(INDEX_THREADS);
        summary.threads.shrink_to_fit();
        self.recent.push_back(summary);
        self.dirty = true;
        self.enforce_retention(Some(&dir));
        Ok(Exported::Full)
    }

    /// Adds a leader slot to its window; writes windows that are complete
    /// (this slot is past them).
    fn window_add(
        &mut self,
        slot: &Slot,
        p: &Profiles,
        labels: &SlotLabels,
        findings: bool,
        meta: &ProfileMeta,
    ) {
        let done: Vec<u64> = self
            .windows
            .keys()
            .copied()
            .filter(|&w| slot.window != Some(w))
            .collect();
        for w in done {
            self.window_write(w, meta);
        }
        if let Some(w) = slot.window {
            let e = self
                .windows
                .entry(w)
                .or_insert_with(|| (Vec::new(), Vec::new(), false));
            e.0.push(slot.clone());
            e.2 |= findings;
            e.1.push((p.clone(), labels.clone()));
            if e.0.len() as u64 == crate::slots::SLOTS_PER_WINDOW {
                self.window_write(w, meta);
            }
        }
    }

    /// Writes a leader window (a failure is counted and said, not returned).
    fn window_write(&mut self, first: u64, meta: &ProfileMeta) {
        let r = self.try_window_write(first, meta);
        self.attempt(r);
    }

    fn try_window_write(&mut self, first: u64, meta: &ProfileMeta) -> anyhow::Result<()> {
        let Some((slots, each, findings)) = self.windows.remove(&first) else {
            return Ok(());
        };
        // The export policy holds for windows too: with `full = "findings"`
        // a window is written only if one of its slots had findings (a node
        // that leads often would otherwise render four slots' profiles
        // every 1.6 s that nobody asked for).
        if self.policy == FullExport::Findings && !findings {
            return Ok(());
        }
        if !self.room() {
            return Ok(());
        }
        self.make_room(None, self.ledger.back().map_or(0, |e| e.bytes));
        let dir = self.dir.join("windows").join(first.to_string());
        let numbers: Vec<u64> = slots.iter().map(|s| s.number).collect();
        let p = merged(each.iter().map(|(p, _)| p));
        let json = window_json(first, &slots, &p);
        Self::write_dir(
            &dir,
            &p,
            Parts::Window(&each),
            meta,
            &format!("leader window {numbers:?}"),
            if findings { Draw::Now } else { Draw::OnRequest },
            ("window.json", &serde_json::to_vec_pretty(&json)?),
        )?;
        self.record(dir.clone());
        self.enforce_retention(Some(&dir));
        Ok(())
    }

    fn hour_add(&mut self, unix_s: i64, p: &Profiles, summary: &SlotSummary, meta: &ProfileMeta) {
        let name = hour_name(unix_s);
        if self.hour.as_ref().is_some_and(|h| h.name != name) {
            let r = self.hour_write(meta);
            self.attempt(r);
            self.hour = None;
        }
        let h = self.hour.get_or_insert_with(|| Hour {
            name,
            span: None,
            oncpu: FoldedSum::new(),
            offcpu: FoldedSum::new(),
            lines: Vec::new(),
            last_write: None,
        });
        if self.hourly {
            h.oncpu.add(&p.oncpu);
            h.offcpu.add(&p.offcpu);
        }
        let (start, end) = (summary.slot.start_ns, summary.slot.end_ns);
        h.span = Some(h.span.map_or((start, end), |(a, b)| (a.min(start), b.max(end))));
        h.lines.push(serde_json::to_string(summary).unwrap_or_default());
        // Each slot's line as it comes (issue 42, case 5: lines batched 64
        // at a time were lost to a SIGKILL while their slot directories
        // were already there): a kill loses at most the slot in flight.
        let r = self.hour_lines_flush();
        self.attempt(r);
        if self
            .hour
            .as_ref()
            .and_then(|h| h.last_write)
            .is_none_or(|t| t.elapsed() >= HOUR_REWRITE_EVERY)
        {
            let r = self.hour_write(meta);
            self.attempt(r);
        }
    }

    /// Appends the hour's pending summary lines to its slots.jsonl (whole
    /// lines, one write).
    fn hour_lines_flush(&mut self) -> anyhow::Result<()> {
        let Some(h) = self.hour.as_mut() else {
            return Ok(());
        };
        if h.lines.is_empty() || self.paused {
            return Ok(());
        }
        let dir = self.dir.join("hours").join(&h.name);
        let fresh = !dir.exists();
        std::fs::create_dir_all(&dir)?;
        let mut text = h.lines.join("\n");
        text.push('\n');
        // Kept until written: a line that could not be (a full disk) is
        // written with the next.
        append_whole(&dir.join("slots.jsonl"), text.as_bytes())?;
        h.lines.clear();
        if fresh {
            self.record(dir);
        } else if let Some(e) = self.ledger.iter_mut().find(|e| e.path == dir) {
            e.bytes += text.len() as u64;
            self.total += text.len() as u64;
        }
        Ok(())
    }

    /// (Re)writes the current hour's profiles.
    fn hour_write(&mut self, meta: &ProfileMeta) -> anyhow::Result<()> {
        self.hour_lines_flush()?;
        if !self.hourly || self.paused {
            return Ok(());
        }
        let Some(h) = self.hour.as_mut() else {
            return Ok(());
        };
        h.last_write = Some(std::time::Instant::now());
        let dir = self.dir.join("hours").join(&h.name);
        let fresh = !dir.exists();
        // Summed by stack over the hour: no thread ids or CPUs (the slots'
        // and windows' profiles have them).
        let p = Profiles {
            oncpu: h.oncpu.to_folded(),
            offcpu: h.offcpu.to_folded(),
            ..Default::default()
        };
        // The hour's own time, not the process's.
        let mut meta = meta.clone();
        let mono_to_unix = self.mono_to_unix;
        if let Some((start, end)) = h.span {
            meta.time_nanos = (start as i128 + mono_to_unix) as i64;
            meta.duration_nanos = end.saturating_sub(start) as i64;
        }
        write_profiles(&dir, &p, Parts::Whole, &meta, &format!("hour {} UTC", h.name))?;
        drop(p);
        // The rendering's buffers (the hour's text, SVG and pprof: several
        // MB) back to the system now, not in up to 10 s.
        crate::sys::malloc_trim();
        let bytes = dir_bytes(&dir);
        if fresh {
            self.record(dir);
        } else if let Some(e) = self.ledger.iter_mut().find(|e| e.path == dir) {
            self.total = self.total - e.bytes + bytes;
            e.bytes = bytes;
        }
        self.enforce_retention(None);
        Ok(())
    }

    /// Rewrites findings.json and index.html when they changed (at most
    /// every few seconds unless `now`).
    pub fn refresh(&mut self, now: bool) {
        if !self.dirty || (!now && self.last_rewrite.is_some_and(|t| t.elapsed() < REWRITE_EVERY)) {
            return;
        }
        let r = self.try_refresh();
        self.attempt(r);
    }

    fn try_refresh(&mut self) -> anyhow::Result<()> {
        self.last_rewrite = Some(std::time::Instant::now());
        self.dirty = false;
        let findings: Vec<Finding> = self.findings.iter().cloned().collect();
        let findings_json = serde_json::to_vec_pretty(&findings)?;
        write_atomic(&self.dir.join("findings.json"), &findings_json)?;
        // Only slots still on disk are listed.
        let kept: std::collections::HashSet<&Path> = self.ledger.iter().map(|e| e.path.as_path()).collect();
        let slots_dir = self.dir.join("slots");
        let listed: Vec<&SlotSummary> = self
            .recent
            .iter()
            .filter(|s| kept.contains(slots_dir.join(s.slot.number.to_string()).as_path()))
            .collect();
        let recent_findings: Vec<Finding> = findings.iter().rev().take(500).rev().cloned().collect();
        let index = index_html(listed, &recent_findings);
        write_atomic(&self.dir.join("index.html"), index.as_bytes())?;
        self.root_bytes = (findings_json.len() + index.len()) as u64;
        self.enforce_retention(None);
        Ok(())
    }

    /// Writes everything pending: open windows, the hour, the index (each
    /// failure counted and said, the rest still tried).
    pub fn flush(&mut self, meta: &ProfileMeta) -> anyhow::Result<()> {
        let open: Vec<u64> = self.windows.keys().copied().collect();
        for w in open {
            self.window_write(w, meta);
        }
        let r = self.hour_write(meta);
        self.attempt(r);
        self.refresh(true);
        if std::env::var_os("SLOTPROF_DEBUG_LEDGER").is_some() {
            eprintln!(
                "ledger {} (+{} root) vs disk {}: {:?}",
                self.total,
                self.root_bytes,
                dir_bytes(&self.dir),
                self.ledger.iter().map(|e| (&e.path, e.bytes)).collect::<Vec<_>>()
            );
        }
        Ok(())
    }
}

impl SlotExport for Exporter {
    /// [`Exporter::export`], counted.
    fn slot(&mut self, r: &SlotResult<'_>) -> anyhow::Result<()> {
        let how = self.export(r)?;
        match how {
            Exported::Full => self.slots_exported += 1,
            Exported::Summary => self.slots_summarised += 1,
            // Counted where it happened, which knows why.
            Exported::Skipped | Exported::Failed => {}
        }
        if matches!(how, Exported::Full | Exported::Summary) {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.last_exported = Some((r.slot.number, now));
        }
        Ok(())
    }

    fn finish(&mut self, meta: &ProfileMeta) -> anyhow::Result<()> {
        self.flush(meta)
    }
}

/// The `number` of a slot summary line.
fn line_number(line: &str) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Numbered {
        number: u64,
    }
    serde_json::from_str::<Numbered>(line).ok().map(|n| n.number)
}

/// The number of the last whole line of a slots.jsonl (its last 64 KiB
/// read: a line is a few KiB).
fn last_line_number(path: &Path) -> Option<u64> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(64 << 10))).ok()?;
    let mut tail = Vec::new();
    f.take(64 << 10).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    text.lines().rev().find_map(line_number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hour_names_are_utc_calendar_hours() {
        assert_eq!(hour_name(0), "1970-01-01T00");
        assert_eq!(hour_name(1_796_000_000), "2026-11-30T00");
        assert_eq!(hour_name(951_782_400 + 3600 * 5), "2000-02-29T05");
    }

    #[test]
    fn case_2_a_link_planted_where_slots_jsonl_goes_is_refused_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, "root's\n").unwrap();
        let symlink = dir.path().join("a.jsonl");
        std::os::unix::fs::symlink(&outside, &symlink).unwrap();
        let e = append_whole(&symlink, b"{}\n").unwrap_err();
        assert!(format!("{e:#}").contains("symbolic link"), "{e:#}");
        let hard = dir.path().join("b.jsonl");
        std::fs::hard_link(&outside, &hard).unwrap();
        let e = append_whole(&hard, b"{}\n").unwrap_err();
        assert!(format!("{e:#}").contains("2 names"), "{e:#}");
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "root's\n");
        // slotprof's own file is appended to.
        let own = dir.path().join("c.jsonl");
        append_whole(&own, b"1\n").unwrap();
        append_whole(&own, b"2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&own).unwrap(), "1\n2\n");
    }

    /// Case 7: a write the file system cuts short (here RLIMIT_FSIZE, as a
    /// full disk would) leaves no torn line: the file is as it was. Run in
    /// a child process of this test (the limit is the process's).
    #[test]
    fn case_7_an_append_cut_short_leaves_the_file_as_it_was() {
        const CHILD: &str = "SLOTPROF_APPEND_CHILD";
        if let Some(path) = std::env::var_os(CHILD) {
            // SAFETY: plain libc calls on this process's own settings.
            unsafe {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let lim = libc::rlimit {
                    rlim_cur: 10,
                    rlim_max: libc::RLIM_INFINITY,
                };
                assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
            }
            let r = append_whole(Path::new(&path), b"0123456789abcdef\n");
            std::process::exit(if r.is_err() { 3 } else { 0 });
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slots.jsonl");
        std::fs::write(&path, "{}\n").unwrap();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "export::always_on::tests::case_7_an_append_cut_short_leaves_the_file_as_it_was",
            ])
            .env(CHILD, &path)
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(3), "the append past the limit must fail");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{}\n");
    }
}

#[cfg(test)]
mod ledger_tests {
    use super::*;

    fn du(p: &Path) -> u64 {
        std::fs::read_dir(p)
            .unwrap()
            .flatten()
            .map(|e| {
                if e.path().is_dir() {
                    du(&e.path())
                } else {
                    e.metadata().unwrap().len()
                }
            })
            .sum()
    }

    #[test]
    fn the_ledger_matches_the_disk_and_the_cap_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let config = crate::config::Config::parse(&format!(
            "[target]\npid = 1\n[export]\ndir = \"{}\"\nfull = \"all\"\nretention_bytes = \"256KiB\"\n",
            dir.display()
        ))
        .unwrap();
        let mut e = Exporter::open(&config.export_policy()).unwrap();
        let meta = plain_meta();
        for n in 0..40u64 {
            let mut p = Profiles::default();
            for k in 0..200 {
                p.oncpu
                    .add(["main", &format!("f{k}"), &format!("g{}", k + n % 3)], 1 + k);
            }
            let slot = Slot {
                number: n,
                start_ns: n * 400_000_000,
                end_ns: (n + 1) * 400_000_000,
                leader: n % 8 < 4,
                window: (n % 8 < 4).then(|| n - n % 4),
                aligned: true,
            };
            e.export(&result(&slot, &p, &[], &meta)).unwrap();
            e.refresh(true);
            assert_eq!(e.bytes(), du(&dir), "after slot {n}");
        }
        e.flush(&meta).unwrap();
        assert_eq!(e.bytes(), du(&dir), "after the flush");
        // The cap made it remove slots (index.html, with its timeline,
        // is some 20 KiB of the 256).
        assert!(e.removed > 0, "nothing removed: the cap was not reached");
        assert!(du(&dir) <= 256 << 10, "{} over the cap", du(&dir));
        // An hour's profile covers its slots' time: all 40 (16 s), or
        // whole slots of them where the 16 s crossed an hour.
        for h in std::fs::read_dir(dir.join("hours")).unwrap() {
            let path = h.unwrap().path().join("profile.pb.gz");
            let p = flamegraphs::pprof::decode_gzip(&std::fs::read(&path).unwrap()).unwrap();
            let d = p.duration_nanos;
            assert!(
                d > 0 && d <= 40 * 400_000_000 && d % 400_000_000 == 0,
                "{}: duration {d}",
                path.display()
            );
            assert!(p.time_nanos > 0);
        }
    }

    fn result<'a>(
        slot: &'a Slot,
        p: &'a Profiles,
        findings: &'a [Finding],
        meta: &'a ProfileMeta,
    ) -> SlotResult<'a> {
        SlotResult {
            slot,
            profiles: p,
            findings,
            phase: None,
            memory_pressure: None,
            meta,
            period_ns: 1,
        }
    }

    /// Slot `n` of a node leading every slot, in windows of four.
    fn leader_slot(n: u64) -> Slot {
        Slot {
            number: n,
            start_ns: n * 400_000_000,
            end_ns: (n + 1) * 400_000_000,
            leader: true,
            window: Some(n - n % 4),
            aligned: true,
        }
    }

    /// A finding placed in `slot`.
    fn lock_finding(slot: &Slot) -> Finding {
        Finding {
            kind: crate::detectors::FindingKind::LockContention,
            slot: Some(slot.number),
            pid: 1,
            tid: 1,
            thread: "t".into(),
            start_ns: slot.start_ns,
            duration_ns: 1,
            magnitudes: Default::default(),
            cause: None,
            stack: vec![],
            waker_stack: vec![],
            ran_instead: Vec::new(),
            explanation: String::new(),
            advice: String::new(),
        }
    }

    /// Profile metadata with nothing in it.
    fn plain_meta() -> ProfileMeta {
        ProfileMeta {
            time_nanos: 0,
            duration_nanos: 0,
            period_type: None,
            period: 1,
            comments: vec![],
        }
    }

    /// An exporter into `dir` with `export.full = full`, no hourly
    /// profiles, and plain profile metadata.
    fn exporter_in(dir: &Path, full: &str) -> (Exporter, ProfileMeta) {
        let config = crate::config::Config::parse(&format!(
            "[target]\npid = 1\n[export]\ndir = \"{}\"\nfull = \"{full}\"\nhourly_profiles = false\n",
            dir.display()
        ))
        .unwrap();
        let meta = plain_meta();
        (Exporter::open(&config.export_policy()).unwrap(), meta)
    }

    #[test]
    fn case_11_a_restart_numbers_its_slots_after_those_in_the_export() {
        let dir = tempfile::tempdir().unwrap();
        let (e, _) = exporter_in(dir.path(), "all");
        assert_eq!(e.next_slot_number(), 0, "an empty export starts at 0");
        std::fs::create_dir_all(dir.path().join("slots/7")).unwrap();
        std::fs::create_dir_all(dir.path().join("slots/not-a-number")).unwrap();
        let hour = dir.path().join("hours/2026-12-07T03");
        std::fs::create_dir_all(&hour).unwrap();
        // Slots 10-12 had only their summary lines; a torn last line is
        // passed over.
        std::fs::write(
            hour.join("slots.jsonl"),
            "{\"number\":10}\n{\"number\":11}\n{\"number\":12}\n{\"numb",
        )
        .unwrap();
        let (e, _) = exporter_in(dir.path(), "all");
        assert_eq!(e.next_slot_number(), 13);
        // And a clock source numbers from there.
        let t = crate::slots::Timeline::clock_from(
            Duration::from_millis(400),
            (1_000, 13),
            None,
            1_000,
            801_000_000,
        );
        let numbers: Vec<u64> = t.slots().iter().map(|s| s.number).collect();
        assert_eq!(numbers, [13, 14, 15]);
    }

    #[test]
    fn with_full_findings_only_windows_with_a_finding_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let (mut e, meta) = exporter_in(dir.path(), "findings");
        // Three leader windows (0, 4, 8); a finding only in slot 5.
        for n in 0..12u64 {
            let mut p = Profiles::default();
            p.oncpu.add(["main", "f"], 1);
            let slot = leader_slot(n);
            let findings = if n == 5 { vec![lock_finding(&slot)] } else { vec![] };
            e.export(&result(&slot, &p, &findings, &meta)).unwrap();
        }
        e.flush(&meta).unwrap();
        let names = |sub: &str| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(dir.path().join(sub))
                .unwrap()
                .flatten()
                .map(|d| d.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names("windows"), ["4"]);
        assert_eq!(names("slots"), ["5"]);
    }

    /// A slot with findings gets its SVGs drawn; a leader slot without
    /// gets only its .folded (drawn by the server when asked), says so in
    /// slot.json, and is marked in the index; windows follow their slots.
    #[test]
    fn only_slots_and_windows_with_findings_get_their_flamegraphs_drawn() {
        let dir = tempfile::tempdir().unwrap();
        let (mut e, meta) = exporter_in(dir.path(), "findings-and-leader");
        for n in 0..8u64 {
            let mut p = Profiles::default();
            p.oncpu.add(["main", "f"], 1);
            p.offcpu.add(["main", "wait"], 1_000);
            let slot = leader_slot(n);
            let findings = if n == 1 { vec![lock_finding(&slot)] } else { vec![] };
            e.export(&result(&slot, &p, &findings, &meta)).unwrap();
        }
        e.flush(&meta).unwrap();
        let d = dir.path();
        for (sub, drawn) in [
            ("slots/1", true),
            ("slots/2", false),
            ("windows/0", true),
            ("windows/4", false),
        ] {
            for kind in ["oncpu", "offcpu"] {
                assert!(
                    d.join(sub).join(format!("{kind}.folded")).is_file(),
                    "{sub}: no {kind}.folded"
                );
                assert_eq!(
                    d.join(sub).join(format!("{kind}.svg")).is_file(),
                    drawn,
                    "{sub}: {kind}.svg drawn should be {drawn}"
                );
            }
        }
        let json = |n: u64| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(d.join(format!("slots/{n}/slot.json"))).unwrap()).unwrap()
        };
        assert_eq!(json(2)["flamegraphs_on_request"], true);
        assert!(json(1).get("flamegraphs_on_request").is_none());
        let index = std::fs::read_to_string(d.join("index.html")).unwrap();
        assert_eq!(
            index
                .matches("drawn by slotprof's server when opened from it")
                .count(),
            7
        );
        assert!(index.contains("Flamegraphs drawn on request"));
    }

    #[test]
    fn a_failed_slot_write_is_counted_and_the_next_slot_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (mut e, meta) = exporter_in(dir.path(), "all");
        let slot = |n: u64| Slot {
            number: n,
            start_ns: n * 400_000_000,
            end_ns: (n + 1) * 400_000_000,
            leader: false,
            window: None,
            aligned: true,
        };
        let mut p = Profiles::default();
        p.oncpu.add(["main", "f"], 1);
        // `slots/` replaced by a file: every write into it fails (as on a
        // full disk or without descriptors), and nothing is left behind.
        let slots = dir.path().join("slots");
        std::fs::remove_dir(&slots).unwrap();
        std::fs::write(&slots, b"in the way").unwrap();
        for n in 0..3 {
            assert_eq!(
                e.export(&result(&slot(n), &p, &[], &meta)).unwrap(),
                Exported::Failed
            );
        }
        assert_eq!((e.slots_failed, e.write_errors), (3, 3));
        std::fs::remove_file(&slots).unwrap();
        std::fs::create_dir(&slots).unwrap();
        assert_eq!(
            e.export(&result(&slot(3), &p, &[], &meta)).unwrap(),
            Exported::Full
        );
        assert!(slots.join("3").join("slot.json").exists());
        e.flush(&meta).unwrap();
        assert_eq!(e.slots_failed, 3);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|d| d.file_name().to_string_lossy().contains(".tmp."))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn what_a_kill_left_half_written_is_removed_when_the_export_is_opened_again() {
        let dir = tempfile::tempdir().unwrap();
        let hour = dir.path().join("hours/2026-12-07T06");
        std::fs::create_dir_all(&hour).unwrap();
        let temps = [
            dir.path().join(".findings.json.tmp.0123456789abcdef"),
            hour.join(".oncpu.svg.tmp.fedcba9876543210"),
        ];
        for t in &temps {
            std::fs::write(t, b"half").unwrap();
        }
        let half_dir = dir.path().join("slots/.7.tmp.00000000000000ff");
        std::fs::create_dir_all(half_dir.join("x")).unwrap();
        // Not slotprof's temporaries: kept.
        let kept = [
            dir.path().join(".keep"),
            hour.join(".x.tmp.0123"),
            hour.join("slots.jsonl"),
        ];
        for k in &kept {
            std::fs::write(k, b"mine").unwrap();
        }
        let _ = exporter_in(dir.path(), "all");
        for t in temps.iter().chain([&half_dir]) {
            assert!(!t.exists(), "{} left", t.display());
        }
        for k in &kept {
            assert!(k.exists(), "{} removed", k.display());
        }
    }
}
