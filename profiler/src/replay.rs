//! Sessions recorded once (as root, against the stall programs) and
//! replayed through the pipeline without a kernel: the tests that need no
//! root.
//!
//! A recording (`slotprof record --save-replay DIR`, or attach) holds what
//! the detectors were given: every event the aggregator counted, after the
//! user stacks were unwound (`events.bin.gz`, records as
//! `events::write_raw` writes them), and in `recording.json` the slots,
//! the detector settings, the kernel's short futex counts, the names of
//! every stack the detectors asked for, and the findings the live session
//! made (the cache-line detector's left out: it reads the target's code,
//! which a recording does not keep). [`detect`] runs exactly what a session
//! runs on them; [`always_on`] runs them slot by slot as `slotprof run`
//! does (the same event splitting at slot ends, one aggregator per slot).
//!
//! Not here: symbolizing (names are recorded as they were resolved) and
//! the kernel side (stack maps, threads asleep at the end).

use std::{
    collections::{BTreeMap, HashMap},
    io::{Read, Write},
    path::Path,
};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::{
    aggregate::Aggregator,
    detectors::{Buckets, DetectorConfig, Finding},
    events,
    slots::{Slot, Timeline},
};

/// The recording's file of events (gzip).
pub const EVENTS: &str = "events.bin.gz";
/// The recording's description.
pub const RECORDING: &str = "recording.json";

/// What a session recorded for replay.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recording {
    /// Bumped when the format or a record's layout changes.
    pub version: u32,
    /// The command it recorded, for the reader.
    pub command: String,
    pub pid: u32,
    /// When the session began (CLOCK_MONOTONIC ns): where the buckets
    /// begin without a slot source.
    pub started_ns: u64,
    /// The session's slots; None without a slot source.
    pub slots: Option<Vec<Slot>>,
    pub detectors: DetectorConfig,
    /// Short futex waits the kernel counted: (address, waits, ns).
    pub short_futex: Vec<(u64, u64, u64)>,
    /// Every stack the detectors named.
    pub names: Vec<NamedStack>,
    /// What the live session found (without CacheLinePingPong).
    pub findings: serde_json::Value,
}

/// Frames of one stack, root first, as the live session named them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NamedStack {
    pub tgid: u32,
    pub id: i32,
    pub kernel: bool,
    pub frames: Vec<String>,
}

/// The version [`write`] writes and [`read`] accepts.
pub const VERSION: u32 = 1;

/// Writes a recording into `dir` (created if needed).
pub fn write(dir: &Path, recording: &Recording, events: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--save-replay: cannot create {}", dir.display()))?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(events)?;
    crate::output::write_atomic(&dir.join(EVENTS), &gz.finish()?)?;
    crate::output::write_atomic(&dir.join(RECORDING), &serde_json::to_vec_pretty(recording)?)?;
    Ok(())
}

/// Reads a recording and its events (bounded: a recording is small).
pub fn read(dir: &Path) -> anyhow::Result<(Recording, Vec<u8>)> {
    let text = crate::output::read_text_bounded(&dir.join(RECORDING), 64 << 20)?;
    let recording: Recording =
        serde_json::from_str(&text).with_context(|| format!("{} is not a recording", dir.display()))?;
    anyhow::ensure!(
        recording.version == VERSION,
        "{}: recording version {} (this slotprof reads {VERSION}): record it again",
        dir.display(),
        recording.version
    );
    let gz =
        std::fs::File::open(dir.join(EVENTS)).with_context(|| format!("{}", dir.join(EVENTS).display()))?;
    let mut events = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .take(1 << 30)
        .read_to_end(&mut events)
        .with_context(|| format!("{}", dir.join(EVENTS).display()))?;
    Ok((recording, events))
}

/// The recorded events, decoded (records that do not decode are skipped
/// and counted in the second value).
pub fn decode(events: &[u8]) -> (Vec<events::Event>, u64) {
    let mut bad = 0;
    let decoded = events::read_raw(events)
        .into_iter()
        .filter_map(|r| {
            let e = events::decode(r);
            bad += u64::from(e.is_none());
            e
        })
        .collect();
    (decoded, bad)
}

/// Names from the recording: (tgid, id, kernel) -> frames.
fn names(recording: &Recording) -> HashMap<(u32, i32, bool), Vec<String>> {
    recording
        .names
        .iter()
        .map(|n| ((n.tgid, n.id, n.kernel), n.frames.clone()))
        .collect()
}

/// What a session runs on the recording: one aggregator over all of it,
/// the detectors over the session's slots.
pub fn detect(recording: &Recording, events: &[u8]) -> anyhow::Result<Vec<Finding>> {
    let mut agg = Aggregator::new();
    for e in decode(events).0 {
        agg.ingest(&e);
    }
    let timeline = recording.slots.clone().map(Timeline::new);
    let buckets = Buckets::new(timeline.as_ref(), recording.started_ns);
    detect_with(recording, &names(recording), &agg, &buckets)
}

/// The detectors over `agg` with the recording's settings and names.
fn detect_with(
    recording: &Recording,
    names: &HashMap<(u32, i32, bool), Vec<String>>,
    agg: &Aggregator,
    buckets: &Buckets,
) -> anyhow::Result<Vec<Finding>> {
    Ok(crate::pipeline::detect_named(
        agg,
        recording.pid,
        &recording.short_futex,
        &recording.detectors,
        buckets,
        &mut |tgid, id, kernel| names.get(&(tgid, id, kernel)).cloned().unwrap_or_default(),
    )?)
}

/// What `slotprof run` does with the recording: events wait for their
/// slot to end and are cut at slot ends (`run::Pending`), one aggregator
/// and one detector pass per slot, a finding that began before its slot
/// placed in it.
pub fn always_on(recording: &Recording, events: &[u8]) -> anyhow::Result<Vec<Finding>> {
    let slots = recording
        .slots
        .as_ref()
        .context("the recording has no slots (record it with --slot-source)")?;
    let names = names(recording);
    let mut pending = crate::slot_window::Pending::default();
    let log = crate::slot_sources::SharedSlotLog::default();
    for e in decode(events).0 {
        pending.push(&log, e);
    }
    let mut findings = Vec::new();
    let mut c = recording.started_ns;
    for slot in slots {
        let mut agg = Aggregator::new();
        pending.take_until(c, slot.end_ns, &mut agg);
        let timeline = Timeline::new(vec![slot.clone()]);
        let buckets = Buckets::new(Some(&timeline), c);
        let mut found = detect_with(recording, &names, &agg, &buckets)?;
        crate::slot_window::place_in_slots(&mut found, &timeline, std::slice::from_ref(slot));
        findings.extend(found);
        c = slot.end_ns;
    }
    Ok(findings)
}

/// Records the names a live detector pass asks for.
#[derive(Default)]
pub struct NameLog {
    seen: BTreeMap<(u32, i32, bool), Vec<String>>,
}

impl NameLog {
    pub fn note(&mut self, tgid: u32, id: i32, kernel: bool, frames: &[String]) {
        self.seen
            .entry((tgid, id, kernel))
            .or_insert_with(|| frames.to_vec());
    }

    pub fn into_names(self) -> Vec<NamedStack> {
        self.seen
            .into_iter()
            .map(|((tgid, id, kernel), frames)| NamedStack {
                tgid,
                id,
                kernel,
                frames,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recording_round_trips_through_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let rec = Recording {
            version: VERSION,
            command: "record".into(),
            pid: 7,
            started_ns: 100,
            slots: None,
            detectors: DetectorConfig::default(),
            short_futex: vec![(1, 2, 3)],
            names: vec![NamedStack {
                tgid: 7,
                id: 4,
                kernel: false,
                frames: vec!["main".into()],
            }],
            findings: serde_json::json!([]),
        };
        let mut events = Vec::new();
        let s = crate::aggregate::tests::sample_at(150, 4);
        events::write_raw(&mut events, &s.to_bytes()).unwrap();
        write(dir.path(), &rec, &events).unwrap();
        let (back, ev) = read(dir.path()).unwrap();
        assert_eq!(back.pid, 7);
        assert_eq!(back.names[0].frames, ["main"]);
        let (decoded, bad) = decode(&ev);
        assert_eq!((decoded.len(), bad), (1, 0));
        // Another version is refused with what to do.
        let mut old = rec.clone();
        old.version = VERSION + 1;
        write(dir.path(), &old, &events).unwrap();
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("record it again"), "{e}");
    }
}
