//! The committed recordings of `tests/fixtures/replay/` (made by `sudo
//! cargo xtask record-fixtures` from the stall programs under real
//! probes), replayed without root or a kernel:
//! - through what a session runs: the findings must be exactly the ones the
//!   live session made when it was recorded;
//! - through what `slotprof run` runs, slot by slot: checked against the
//!   stall program's own report (`truth.json`), precision and recall, and
//!   the fixed twins stay silent.

use std::path::{Path, PathBuf};

use profiler::{detectors::Finding, pipeline::replay};
use serde_json::Value;

fn fixture(name: &str) -> (replay::Recording, Vec<u8>, Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/replay")
        .join(name);
    let (rec, events) = replay::read(&dir).unwrap_or_else(|e| {
        panic!(
            "{e:#}: the fixture {name} is missing or broken: `sudo cargo xtask record-fixtures` records it"
        )
    });
    let truth: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("truth.json")).unwrap()).unwrap();
    (rec, events, truth)
}

fn fixtures() -> Vec<String> {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/replay");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        // The host's recordings are replayed by their own tests.
        .filter(|e| e.path().join(replay::RECORDING).exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn of_kind<'a>(f: &'a [Finding], kind: &str) -> Vec<&'a Finding> {
    f.iter().filter(|f| f.kind.as_str() == kind).collect()
}

/// Every fixture: the session's path on the recording gives exactly the
/// findings the live session made.
#[test]
fn every_recording_replays_to_the_findings_its_session_made() {
    let names = fixtures();
    assert!(names.len() >= 5, "fixtures: {names:?}");
    for name in names {
        let (rec, events, _) = fixture(&name);
        let (decoded, bad) = replay::decode(&events);
        assert!(
            !decoded.is_empty() && bad == 0,
            "{name}: {} events, {bad} undecodable",
            decoded.len()
        );
        let found = replay::detect(&rec, &events).unwrap();
        let got = as_written(&found);
        assert_eq!(
            got, rec.findings,
            "{name}: the replay's findings differ from the live session's"
        );
        eprintln!(
            "{name}: {} events, {} findings, as live",
            decoded.len(),
            found.len()
        );
    }
}

/// MainLoopGap slot by slot: every injected gap over the threshold is
/// found in the slot it began in (or, across a slot's end, the next); no
/// finding where the program injected nothing (5% allowed: a gap the
/// machine made, such as a wait for a CPU, is real but not in the report).
#[test]
fn always_on_finds_the_injected_gaps_in_their_slots() {
    let (rec, events, truth) = fixture("gaps");
    let found = replay::always_on(&rec, &events).unwrap();
    let gaps = of_kind(&found, "MainLoopGap");
    let threshold = rec.detectors.gap_threshold_ns;
    let injected: Vec<(u64, u64, &str)> = truth["gaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["start_ns"].as_u64().unwrap(),
                g["end_ns"].as_u64().unwrap(),
                g["kind"].as_str().unwrap(),
            )
        })
        .filter(|(s, e, _)| e - s >= threshold)
        .collect();
    assert!(
        injected.len() >= 5,
        "{} injected gaps over the threshold",
        injected.len()
    );
    let slots = rec.slots.as_ref().unwrap();
    let mut found_n = 0;
    for (s, e, _kind) in &injected {
        let hit = gaps
            .iter()
            .find(|f| f.start_ns <= *e && f.start_ns + f.duration_ns >= *s);
        let Some(hit) = hit else { continue };
        found_n += 1;
        // In the slot it began in; one that spans a slot's end is found
        // when the later slot is processed (the earlier one is exported by
        // then) and placed there.
        let slot_at = |t: u64| {
            slots
                .iter()
                .find(|x| x.start_ns <= t && t < x.end_ns)
                .map(|x| x.number)
        };
        let (began, ended) = (slot_at(hit.start_ns), slot_at(hit.start_ns + hit.duration_ns - 1));
        assert!(
            hit.slot == began || hit.slot == ended,
            "a gap at {s} placed in slot {:?}, not {began:?} where it began or {ended:?} where it ended",
            hit.slot
        );
    }
    eprintln!(
        "always-on replay: {found_n} of {} injected gaps found, {} MainLoopGap findings",
        injected.len(),
        gaps.len()
    );
    assert!(
        found_n as f64 >= 0.9 * injected.len() as f64,
        "always-on replay found {found_n} of {} injected gaps",
        injected.len()
    );
    let stray = gaps
        .iter()
        .filter(|f| {
            !truth["gaps"].as_array().unwrap().iter().any(|g| {
                let (s, e) = (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap());
                f.start_ns < e + 1_000_000 && s < f.start_ns + f.duration_ns + 1_000_000
            })
        })
        .count();
    assert!(
        stray * 20 <= gaps.len().max(1),
        "{stray} of {} always-on gaps match no injected gap",
        gaps.len()
    );
}

/// The smooth twin: no gap of an injected kind slot by slot either.
#[test]
fn always_on_finds_no_injected_kind_on_the_smooth_twin() {
    let (rec, events, _) = fixture("gaps-smooth");
    let found = replay::always_on(&rec, &events).unwrap();
    let invented: Vec<&Finding> = of_kind(&found, "MainLoopGap")
        .into_iter()
        .filter(|f| {
            f.cause.as_deref() == Some("lock wait (futex)")
                || f.stack.iter().any(|s| {
                    ["drop_big_bank", "injected_sleep", "wait_for_bank_lock"]
                        .iter()
                        .any(|n| s.contains(n))
                })
        })
        .collect();
    assert!(invented.is_empty(), "{invented:?}");
}

/// LockContention slot by slot: in slots where the program waited for its
/// bank lock, and nowhere else.
#[test]
fn always_on_finds_lock_contention_only_where_the_program_waited() {
    let (rec, events, truth) = fixture("lock");
    let found = replay::always_on(&rec, &events).unwrap();
    let locks = of_kind(&found, "LockContention");
    assert!(!locks.is_empty(), "no LockContention slot by slot");
    let slots = rec.slots.as_ref().unwrap();
    let waited: Vec<u64> = truth["gaps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["kind"] == "lock")
        .flat_map(|g| {
            let (s, e) = (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap());
            slots
                .iter()
                .filter(move |x| x.start_ns < e && s < x.end_ns)
                .map(|x| x.number)
        })
        .collect();
    for f in &locks {
        assert!(
            f.slot.is_some_and(|n| waited.contains(&n)),
            "LockContention in slot {:?}, where the program waited for no lock (it did in {waited:?})",
            f.slot
        );
    }
}

/// SyncAllocatorPurge slot by slot: on the sync twin in most slots, on
/// the background twin never.
#[test]
fn always_on_finds_purges_on_the_sync_twin_only() {
    let (rec, events, truth) = fixture("purge-sync");
    let found = replay::always_on(&rec, &events).unwrap();
    let purges = of_kind(&found, "SyncAllocatorPurge");
    assert!(purges.len() >= 4, "{} purge findings slot by slot", purges.len());
    let pid = truth["pid"].as_u64().unwrap() as u32;
    assert!(purges.iter().all(|f| f.tid == pid), "a purge off the hot thread");
    let (rec, events, _) = fixture("purge-background");
    let found = replay::always_on(&rec, &events).unwrap();
    assert!(
        of_kind(&found, "SyncAllocatorPurge").is_empty(),
        "the background twin: {found:?}"
    );
}

/// CacheLinePingPong, the session's way: the recorded accesses give
/// exactly the live session's cache-line findings; the top line is the
/// one the program shared (its own report), found at both counters' sites;
/// the padded twin stays silent.
#[test]
fn cache_lines_replay_to_the_live_findings_on_the_programs_shared_line() {
    let (rec, events, truth) = fixture("false-sharing");
    let lines = rec
        .cache_lines
        .as_ref()
        .expect("the fixture keeps the cache-line inputs");
    let found = replay::cache_lines(&rec, &events).unwrap();
    assert_eq!(
        as_written(&found),
        lines.findings,
        "the replay's cache-line findings differ from the live session's"
    );
    let top = found
        .first()
        .expect("no CacheLinePingPong on the shared counters");
    assert_eq!(
        top.magnitudes["line"] as u64,
        truth["shared_line"].as_u64().unwrap(),
        "{top:?}"
    );
    assert!(
        top.stack.iter().any(|s| s.contains("bump_a")) && top.stack.iter().any(|s| s.contains("bump_b")),
        "{:?}",
        top.stack
    );
    eprintln!(
        "false-sharing: {} accesses from {} samples, {} findings, as live",
        lines.accesses.len(),
        lines.sampled.len(),
        found.len()
    );

    let (rec, events, _) = fixture("false-sharing-padded");
    let lines = rec.cache_lines.as_ref().unwrap();
    assert!(lines.accesses.len() > 100, "{} accesses", lines.accesses.len());
    let found = replay::cache_lines(&rec, &events).unwrap();
    assert!(found.is_empty(), "padded twin: {found:?}");
    assert_eq!(lines.findings, serde_json::json!([]));
}

/// CacheLinePingPong the always-on way: per leader window (four slots in
/// every eight here), placed in the window's last slot, on the shared line
/// only; the padded twin's windows stay silent.
#[test]
fn always_on_finds_the_shared_line_per_leader_window() {
    let (rec, events, truth) = fixture("false-sharing");
    let slots = rec.slots.as_ref().unwrap();
    let found = replay::always_on(&rec, &events).unwrap();
    let lines = of_kind(&found, "CacheLinePingPong");
    let window_ends: Vec<u64> = slots
        .iter()
        .filter(|s| s.window.is_some_and(|w| s.number == w + 3))
        .map(|s| s.number)
        .collect();
    assert!(
        !window_ends.is_empty(),
        "no whole leader window in {} slots",
        slots.len()
    );
    assert!(
        !lines.is_empty(),
        "no CacheLinePingPong in {} windows",
        window_ends.len()
    );
    for f in &lines {
        assert!(
            f.slot.is_some_and(|s| window_ends.contains(&s)),
            "a cache-line finding in slot {:?}, not a window's last ({window_ends:?})",
            f.slot
        );
        assert_eq!(
            f.magnitudes["line"] as u64,
            truth["shared_line"].as_u64().unwrap(),
            "a finding on a line the program did not share: {f:?}"
        );
    }
    eprintln!(
        "always-on cache lines: {} findings in {} whole windows",
        lines.len(),
        window_ends.len()
    );
    let (rec, events, _) = fixture("false-sharing-padded");
    let found = replay::always_on(&rec, &events).unwrap();
    assert!(
        of_kind(&found, "CacheLinePingPong").is_empty(),
        "padded twin: {found:?}"
    );
}

fn host_fixture(name: &str) -> (replay::HostRecording, Value) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/replay")
        .join(name);
    let rec = replay::read_host(&dir).unwrap_or_else(|e| {
        panic!(
            "{e:#}: the fixture {name} is missing or broken: `sudo cargo xtask record-fixtures` records it"
        )
    });
    let truth: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("truth.json")).unwrap()).unwrap();
    (rec, truth)
}

/// KvmMmuInvalidation: `slotprof host` watched a real KVM guest with 256
/// MiB of locked memory while compaction was asked for by hand. The
/// replay gives exactly the live findings; the one finding is the guest's,
/// from manual compaction, and its pages are at least the guest frames
/// that moved (by the guest's own pagemap, less 5%; a page can be
/// invalidated without moving, never moved without being invalidated) and
/// no more than the invalidations the recording holds.
#[test]
fn host_replays_to_the_live_kvm_finding_with_the_guests_moved_pages() {
    let (rec, truth) = host_fixture("kvm-compaction");
    let (counts, found) = replay::host(&rec);
    assert_eq!(
        as_written(&found),
        rec.findings,
        "the replay's KVM findings differ from the live session's"
    );
    let moved = truth["pages_moved"].as_u64().unwrap();
    assert!(moved > 1000, "compaction moved only {moved} guest pages");
    assert_eq!(found.len(), 1, "{found:?}");
    let f = &found[0];
    assert_eq!(f.finding.pid, truth["pid"].as_u64().unwrap() as u32);
    assert_eq!(f.finding.cause.as_deref(), Some("manual-compaction"));
    let pages = f.finding.magnitudes["pages"] as u64;
    assert!(
        pages as f64 >= 0.95 * moved as f64 && pages <= counts.totals.invalidated_pages,
        "finding {pages} pages, guest moved {moved}, {} invalidated in all",
        counts.totals.invalidated_pages
    );
    eprintln!(
        "kvm-compaction: {} samples, {} invalidated pages, finding {pages} pages, guest moved {moved}",
        rec.samples.len(),
        counts.totals.invalidated_pages
    );
}

/// The fixed twin: vm.compact_unevictable_allowed=0, the same manual
/// compaction ran (its compaction events are in the recording) and moved
/// none of the locked guest's pages: no finding.
#[test]
fn host_replay_of_the_locked_guest_with_unevictable_off_finds_nothing() {
    let (rec, truth) = host_fixture("kvm-locked-untouched");
    let (counts, found) = replay::host(&rec);
    assert_eq!(truth["pages_moved"].as_u64(), Some(0));
    assert!(
        counts.totals.compaction_runs > 0,
        "the twin's compaction did not run: {:?}",
        counts.totals
    );
    assert!(found.is_empty(), "{found:?}");
    assert_eq!(rec.findings, serde_json::json!([]));
}

/// Findings as a recording holds them: written as JSON text and read back
/// (serde_json's default float parsing can land one ulp off the value
/// written, e.g. 469.90000000000003 reads as 469.9: compared as text read
/// the same way, equal values stay equal).
fn as_written<T: serde::Serialize>(found: &T) -> serde_json::Value {
    serde_json::from_str(&serde_json::to_string(found).unwrap()).unwrap()
}
