//! Sessions recorded once (as root, against the stall programs) and
//! replayed through the pipeline without a kernel: the tests that need no
//! root.
//!
//! A recording (`slotprof record --save-replay DIR`, or attach) holds what
//! the detectors were given: every event the aggregator counted, after the
//! user stacks were unwound (`events.bin.gz`, records as
//! `events::write_raw` writes them), and in `recording.json.gz` the slots,
//! the detector settings, the kernel's short futex counts, the names of
//! every stack the detectors asked for, and the findings the live session
//! made; for the cache-line detector, which reads the target's code to
//! decode the samples, the decoded accesses and the names it asked for.
//! [`detect`] and [`cache_lines`] run exactly what a session
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
    detectors::memory_access::MemoryAccess,
    detectors::{
        kvm_mmu_invalidation::{
            self,
            analysis::{Sysctls, VmInfo},
            HostFinding, HostSample, InvalidationCounts,
        },
        DetectorConfig, Finding,
    },
    kernel::events,
    pipeline::aggregate::Aggregator,
    pipeline::AddressLog,
    slots::{Buckets, Slot, Timeline},
    topology::Topology,
};

/// The recording's file of events (gzip).
pub const EVENTS: &str = "events.bin.gz";
/// The recording's description (gzip of JSON).
pub const RECORDING: &str = "recording.json.gz";

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
    /// What the cache-line detector was given (None in recordings made
    /// before it was kept).
    #[serde(default)]
    pub cache_lines: Option<CacheLineRecording>,
}

/// The cache-line detector's inputs: it reads the target's code to decode
/// the samples, which a recording does not keep, so the decoded accesses
/// are kept instead, with every name the detector asked for.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CacheLineRecording {
    pub topology: Topology,
    /// Every user-mode sample with registers: (time, thread).
    pub sampled: Vec<(u64, u32)>,
    pub accesses: Vec<MemoryAccess>,
    pub names: AddressLog,
    /// The live session's CacheLinePingPong findings.
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
pub const VERSION: u32 = 3;

/// Writes a recording into `dir` (created if needed).
pub fn write(dir: &Path, recording: &Recording, events: &[u8]) -> anyhow::Result<()> {
    write_gz(dir, EVENTS, events)?;
    write_gz(dir, RECORDING, &serde_json::to_vec(recording)?)
}

/// Writes `bytes`, gzipped, to `dir/name` (the directory created if needed).
fn write_gz(dir: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--save-replay: cannot create {}", dir.display()))?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(bytes)?;
    crate::output::write_atomic(&dir.join(name), &gz.finish()?)
}

/// A gzip file's contents, at most `limit` bytes of them.
fn gunzip(path: &Path, limit: u64) -> anyhow::Result<Vec<u8>> {
    let gz = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .take(limit)
        .read_to_end(&mut out)
        .with_context(|| format!("{}", path.display()))?;
    Ok(out)
}

/// A recording's description (`dir/name`, gzipped JSON) of this
/// version; another version is refused with what to do.
fn read_description<T: serde::de::DeserializeOwned>(
    dir: &Path,
    name: &str,
    version: impl Fn(&T) -> u32,
) -> anyhow::Result<T> {
    let text = gunzip(&dir.join(name), 256 << 20)?;
    let recording: T =
        serde_json::from_slice(&text).with_context(|| format!("{} is not a recording", dir.display()))?;
    let v = version(&recording);
    anyhow::ensure!(
        v == VERSION,
        "{}: recording version {v} (this slotprof reads {VERSION}): record it again",
        dir.display()
    );
    Ok(recording)
}

/// Reads a recording and its events (bounded: a recording is small).
pub fn read(dir: &Path) -> anyhow::Result<(Recording, Vec<u8>)> {
    let recording: Recording = read_description(dir, RECORDING, |r: &Recording| r.version)?;
    Ok((recording, gunzip(&dir.join(EVENTS), 1 << 30)?))
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

/// One aggregator over every recorded event: a session's window.
fn aggregate(events: &[u8]) -> Aggregator {
    let mut agg = Aggregator::new();
    for e in decode(events).0 {
        agg.ingest(&e);
    }
    agg
}

/// What a session runs on the recording: one aggregator over all of it,
/// the detectors over the session's slots.
pub fn detect(recording: &Recording, events: &[u8]) -> anyhow::Result<Vec<Finding>> {
    let agg = aggregate(events);
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
/// slot to end and are cut at slot ends (`slot_window::Pending`), one aggregator
/// and one detector pass per slot, a finding that began before its slot
/// placed in it.
pub fn always_on(recording: &Recording, events: &[u8]) -> anyhow::Result<Vec<Finding>> {
    let slots = recording
        .slots
        .as_ref()
        .context("the recording has no slots (record it with --slot-source)")?;
    let names = names(recording);
    let mut pending = crate::pipeline::slot_window::Pending::default();
    let log = crate::slot_sources::SharedSlotLog::default();
    for e in decode(events).0 {
        pending.push(&log, e);
    }
    let mut findings = Vec::new();
    let mut windows = crate::pipeline::LeaderWindows::default();
    let regs = recording
        .cache_lines
        .as_ref()
        .map(sampled_regs)
        .unwrap_or_default();
    let mut c = recording.started_ns;
    for slot in slots {
        let mut agg = Aggregator::new();
        pending.take_until(c, slot.end_ns, &mut agg);
        let timeline = Timeline::new(vec![slot.clone()]);
        let buckets = Buckets::new(Some(&timeline), c);
        let mut found = detect_with(recording, &names, &agg, &buckets)?;
        crate::pipeline::slot_window::place_in_slots(&mut found, &timeline, std::slice::from_ref(slot));
        findings.extend(found);
        if let Some(lines) = &recording.cache_lines {
            findings.extend(always_on_cache_lines(
                recording,
                lines,
                &regs,
                slot,
                &agg,
                &mut windows,
            ));
        }
        c = slot.end_ns;
    }
    Ok(findings)
}

/// What a session's cache-line detector makes of the recording: the
/// recorded accesses, each thread's share over all its samples.
pub fn cache_lines(recording: &Recording, events: &[u8]) -> anyhow::Result<Vec<Finding>> {
    let c = recording
        .cache_lines
        .as_ref()
        .context("the recording has no cache-line inputs (record it again)")?;
    let agg = aggregate(events);
    Ok(crate::pipeline::cache_line_findings(
        &c.accesses,
        c.sampled.iter().map(|s| s.1),
        recording.pid,
        &agg.thread_names(),
        &c.topology,
        recording.detectors.pingpong_threshold,
        &mut c.names.clone(),
    ))
}

/// What `slotprof run` does with the cache-line inputs: each leader
/// window's samples gathered over its slots (`pipeline::LeaderWindows`),
/// the detector over that window's accesses once its last slot is in, the
/// thread names those of the last slot's events.
fn always_on_cache_lines(
    recording: &Recording,
    c: &CacheLineRecording,
    regs: &[profiler_ebpf::UserRegs],
    slot: &Slot,
    agg: &Aggregator,
    windows: &mut crate::pipeline::LeaderWindows,
) -> Vec<Finding> {
    let mut out = Vec::new();
    for (last, samples) in windows.add(std::slice::from_ref(slot), regs) {
        let keys: std::collections::HashSet<(u64, u32)> = samples.iter().map(|r| (r.ts_ns, r.tid)).collect();
        let accesses: Vec<MemoryAccess> = c
            .accesses
            .iter()
            .filter(|a| keys.contains(&(a.ts_ns, a.tid)))
            .copied()
            .collect();
        let found = crate::pipeline::cache_line_findings(
            &accesses,
            samples.iter().map(|r| r.tid),
            recording.pid,
            &agg.thread_names(),
            &c.topology,
            recording.detectors.pingpong_threshold,
            &mut c.names.clone(),
        );
        out.extend(found.into_iter().map(|mut f| {
            f.slot = Some(last);
            f
        }));
    }
    out
}

/// The recorded samples as what `LeaderWindows` gathers (their time and
/// thread; the registers were decoded live, into the accesses).
fn sampled_regs(c: &CacheLineRecording) -> Vec<profiler_ebpf::UserRegs> {
    c.sampled
        .iter()
        .map(|&(ts_ns, tid)| {
            // SAFETY: UserRegs is plain old data; all zeroes is a valid value.
            let mut r: profiler_ebpf::UserRegs = unsafe { std::mem::zeroed() };
            r.ts_ns = ts_ns;
            r.tid = tid;
            r
        })
        .collect()
}

/// The file of a host recording (gzip of JSON).
pub const HOST_RECORDING: &str = "host-recording.json.gz";

/// What `slotprof host --save-replay` keeps: every probe record as the
/// live session classified it (fields, kernel path, VM), the kernel
/// stacks, the VM processes and sysctls the findings were made with.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostRecording {
    pub version: u32,
    /// Second 0 of the series (CLOCK_MONOTONIC ns).
    pub start_ns: u64,
    /// How long the session ran.
    pub seconds: f64,
    pub samples: Vec<HostSample>,
    pub stacks: Vec<Vec<String>>,
    pub vms: BTreeMap<u32, VmInfo>,
    pub sysctls: Sysctls,
    /// The live session's KvmMmuInvalidation findings.
    pub findings: serde_json::Value,
}

/// Writes a host recording into `dir` (created if needed).
pub fn write_host(dir: &Path, recording: &HostRecording) -> anyhow::Result<()> {
    write_gz(dir, HOST_RECORDING, &serde_json::to_vec(recording)?)
}

/// Reads a host recording.
pub fn read_host(dir: &Path) -> anyhow::Result<HostRecording> {
    read_description(dir, HOST_RECORDING, |r: &HostRecording| r.version)
}

/// What `slotprof host` makes of the recording: the samples counted as the
/// live session counted them, the KvmMmuInvalidation detector over the
/// counts. Returns the counts too (the series, the totals).
pub fn host(recording: &HostRecording) -> (InvalidationCounts, Vec<HostFinding>) {
    let mut counts = InvalidationCounts::new(recording.start_ns);
    counts.stacks = recording.stacks.clone();
    for s in &recording.samples {
        counts.ingest(s);
    }
    counts.end(recording.seconds);
    let found = kvm_mmu_invalidation::detect(&counts, &recording.vms, &recording.sysctls, recording.seconds);
    (counts, found)
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
            cache_lines: None,
        };
        let mut events = Vec::new();
        let s = crate::pipeline::aggregate::tests::sample_at(150, 4);
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
