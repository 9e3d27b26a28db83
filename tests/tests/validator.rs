//! slotprof on a real Agave node (`solana-test-validator` 4.4.0 of
//! `../shared/validator/`): the short checks `cargo xtask test` runs
//! whenever the binary is there (`SLOTPROF_VALIDATOR`, set by xtask), and
//! the long ones of `cargo xtask validator --test`
//! (`SLOTPROF_VALIDATOR_LONG=1`).
//!
//! Ground truth is the node's own: its slot stream, read over its RPC by
//! the test (independently of slotprof's slot source), and its threads.

mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use common::*;

/// The first test's name in the results table.
const T1: &str = "a minute under load";
use slotprof_tests::{
    metrics_receiver::MetricsReceiver,
    monotonic_ns,
    validator::{binary, Load, Node},
};

/// The client load of the loaded checks, transactions a second (the node
/// here confirmed 200/s in a 15 s try, all of them).
const LOAD_RATE: u32 = 100;

/// The node, or why the test cannot run (printed as SKIPPED).
fn node() -> Option<Node> {
    let bin = match binary() {
        Ok(b) => b,
        Err(why) => {
            skip(Need::Validator, why);
            return None;
        }
    };
    Some(Node::start(&bin, 3, Duration::from_secs(180)).unwrap_or_else(|e| panic!("{e}")))
}

/// The node sending its metrics to a receiver here, or why the test
/// cannot run (printed as SKIPPED).
fn node_with_metrics() -> Option<(Node, MetricsReceiver)> {
    let bin = match binary() {
        Ok(b) => b,
        Err(why) => {
            skip(Need::Validator, why);
            return None;
        }
    };
    let metrics = MetricsReceiver::start().unwrap();
    let node = Node::start_with_env(
        &bin,
        3,
        Duration::from_secs(180),
        &[("SOLANA_METRICS_CONFIG", &metrics.config())],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    Some((node, metrics))
}

/// The node's slot stream as the test sees it: `getSlot` every 20 ms, the
/// CLOCK_MONOTONIC time each slot number was first seen.
struct SlotWatch {
    seen: Arc<Mutex<BTreeMap<u64, u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SlotWatch {
    fn start(rpc_port: u16) -> SlotWatch {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let asked = monotonic_ns();
                let slot = slotprof_tests::validator::rpc_call(
                    rpc_port,
                    "getSlot",
                    serde_json::json!([{"commitment": "processed"}]),
                );
                if let Ok(Some(n)) = slot.map(|v| v.as_u64()) {
                    s.lock().unwrap().entry(n).or_insert(asked);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        SlotWatch {
            seen,
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> BTreeMap<u64, u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// Runs slotprof with `args`, returning its exit status, stderr and peak
/// RSS in bytes (wait4's ru_maxrss).
fn slotprof_with_rss(args: &[&str]) -> (bool, String, u64) {
    let dir = private_dir("stderr");
    slotprof_with_rss_to(args, &dir.join("stderr"))
}

/// [`slotprof_with_rss`] with its stderr in `err_path` (which another
/// thread may watch while it runs).
fn slotprof_with_rss_to(args: &[&str], err_path: &Path) -> (bool, String, u64) {
    // Reaped by wait4 below (for its rusage), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(slotprof())
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(err_path).unwrap())
        .spawn()
        .expect("run slotprof");
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4");
    let stderr = std::fs::read_to_string(err_path).unwrap_or_default();
    eprintln!("slotprof {args:?}:\n{stderr}");
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    (ok, stderr, usage.ru_maxrss as u64 * 1024)
}

/// A private scratch directory (mkdtemp), removed when dropped: also when
/// a check fails, so a failing run leaves nothing behind.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn private_dir(what: &str) -> Scratch {
    Scratch(slotprof_tests::private_temp_dir(&format!("slotprof-e2e-validator-{what}")).unwrap())
}

/// Frames a thread's first user frame may be named (glibc's and Rust
/// std's thread starts; `_start` and `__libc_start_main` for main).
const THREAD_ENTRIES: &[&str] = &["start_thread", "clone3", "__clone", "_start", "__libc_start_main"];

/// The share of `folded`'s weight whose user chain reaches a thread entry
/// (one of the three outermost user frames), and the median user depth.
fn reach(folded: &flamegraphs::Folded) -> (f64, usize) {
    let (mut total, mut reached) = (0u64, 0u64);
    let mut misses: BTreeMap<String, u64> = BTreeMap::new();
    let mut depths: Vec<(usize, u64)> = Vec::new();
    for (stack, w) in folded.iter() {
        let user: Vec<&str> = stack
            .split(';')
            .skip(1) // the thread name
            .filter(|f| !f.ends_with("_[k]") && !f.starts_with('['))
            .collect();
        total += w;
        if user
            .iter()
            .take(3)
            .any(|f| THREAD_ENTRIES.iter().any(|e| f.contains(e)))
        {
            reached += w;
        } else {
            // Why not: slotprof's marker at the outer end, or the
            // outermost frame it reached.
            let why = stack
                .split(';')
                .skip(1)
                .find(|f| f.starts_with('['))
                .or(user.first().copied())
                .unwrap_or("(no user frames)");
            *misses.entry(why.to_string()).or_default() += w;
        }
        depths.push((user.len(), w));
    }
    let mut misses: Vec<(u64, String)> = misses.into_iter().map(|(k, v)| (v, k)).collect();
    misses.sort_by(|a, b| b.cmp(a));
    for (w, why) in misses.iter().take(5) {
        eprintln!("  not reaching the entry: {w} {why}");
    }
    depths.sort();
    let mut acc = 0;
    let median = depths
        .iter()
        .find(|(_, w)| {
            acc += w;
            acc * 2 >= total
        })
        .map_or(0, |(d, _)| *d);
    (reached as f64 / total.max(1) as f64, median)
}

/// Slots of an output directory: number -> slot.json.
fn slots_of(out: &Path) -> BTreeMap<u64, serde_json::Value> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(out.join("slots"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(n) = e.file_name().to_string_lossy().parse::<u64>() {
            m.insert(n, read_json(&e.path().join("slot.json")));
        }
    }
    m
}

/// CLOCK_REALTIME minus CLOCK_MONOTONIC now, in ns (metrics points carry
/// the node's realtime; slotprof's slots the monotonic clock).
fn realtime_minus_monotonic() -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    let real = ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128;
    real - monotonic_ns() as i128
}

/// The node's own per-slot series in its metrics: for each measurement
/// with a `slot` integer field, slot -> the point's time on the
/// monotonic clock (the first point per slot).
fn metric_slot_series(metrics: &MetricsReceiver) -> BTreeMap<String, BTreeMap<u64, u64>> {
    let offset = realtime_minus_monotonic();
    let mut out = BTreeMap::new();
    for m in metrics.measurements() {
        let mut series = BTreeMap::new();
        for p in metrics.points(&m) {
            let Some(slot) = p.int("slot").filter(|&s| s > 0) else {
                continue;
            };
            let mono = p.unix_ns as i128 - offset;
            if mono > 0 {
                series.entry(slot as u64).or_insert(mono as u64);
            }
        }
        if series.len() >= 10 {
            out.insert(m, series);
        }
    }
    out
}

/// The node's slot starts: its `replay_stage-new_leader` point per slot.
fn new_leader_series(series: &BTreeMap<String, BTreeMap<u64, u64>>) -> &BTreeMap<u64, u64> {
    series.get("replay_stage-new_leader").unwrap_or_else(|| {
        panic!(
            "no replay_stage-new_leader points from the node: {:?}",
            series.keys()
        )
    })
}

/// `field` ("start_ns" or "end_ns") of each slot minus `truth`'s time for
/// it (ms): median, largest |difference|, count.
fn offsets(
    slots: &BTreeMap<u64, serde_json::Value>,
    truth: &BTreeMap<u64, u64>,
    field: &str,
) -> (f64, f64, usize) {
    let mut d: Vec<f64> = slots
        .iter()
        .filter_map(|(n, s)| Some((s[field].as_u64()?, truth.get(n)?)))
        .map(|(t, u)| (t as f64 - *u as f64) / 1e6)
        .collect();
    d.sort_by(|x, y| x.partial_cmp(y).unwrap());
    if d.is_empty() {
        return (f64::NAN, f64::NAN, 0);
    }
    let max = d.iter().map(|x| x.abs()).fold(0.0, f64::max);
    (d[d.len() / 2], max, d.len())
}

/// The short real-node checks (CI): the node on a fresh ledger; one 60 s
/// attach with the RPC slot source; one 20 s attach with the uprobe slot
/// source, named as a user writes it from the source.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_real_node_attached_for_a_minute_with_both_slot_sources() {
    let Some(_k) = kernel() else { return };
    // The node's own metrics, to a receiver here: its per-slot timestamps.
    let Some((node, metrics)) = node_with_metrics() else {
        return;
    };
    let bin = binary().expect("the node's binary");
    let pid = node.pid().to_string();
    let url = node.rpc_url();

    // 1. RPC slot source, 60 s, with the node's slot stream beside it,
    // under a real client's load (100 transactions a second: transfers,
    // Memo and SPL Token calls) that starts a few seconds before.
    let out = private_dir("rpc");
    let load_dir = private_dir("load");
    let load =
        Load::start(&node, LOAD_RATE, 70, &load_dir.join("report.json")).unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_secs(5));
    let watch = SlotWatch::start(node.rpc_port);
    let (ok, stderr, rss) = slotprof_with_rss(&[
        "attach",
        "--pid",
        &pid,
        "--duration",
        "60s",
        "--slot-source",
        &format!("rpc={url}"),
        "--probe-stats",
        "--out",
        out.to_str().unwrap(),
    ]);
    let truth = watch.finish();
    assert!(ok, "slotprof attach failed: {stderr}");
    // The node's metrics beside slotprof's slots (before the load's
    // settling wait: the same clock offset).
    let series = metric_slot_series(&metrics);
    let (points, names) = metrics.counts();
    eprintln!(
        "node metrics: {points} points of {names} measurements ({} rejected); per-slot series:",
        metrics.rejected()
    );
    let slots_now = slots_of(&out);
    for (m, truth) in &series {
        let (s_med, s_max, n) = offsets(&slots_now, truth, "start_ns");
        let (e_med, e_max, _) = offsets(&slots_now, truth, "end_ns");
        eprintln!(
            "  {m}: {} slots; over {n} of slotprof's: start - point median {s_med:.1} ms (max |{s_max:.1}|), \
             end - point median {e_med:.1} ms (max |{e_max:.1}|)",
            truth.len()
        );
    }
    // The node starts each slot it leads with a `replay_stage-new_leader`
    // point (beside `bank-new_from_parent-heights`): the RPC source's
    // slot starts are within 5 ms of it (measured: median 0.7 ms, max 4.6).
    let new_leader = new_leader_series(&series);
    let (s_med, s_max, n) = offsets(&slots_now, new_leader, "start_ns");
    assert!(
        row(
            T1,
            "RPC slot starts - node's replay_stage-new_leader",
            &format!("median {s_med:.1} ms, max |{s_max:.1}| ms, {n} slots"),
            "|median| <= 5 ms over >= 60 slots",
            n >= 60 && s_med.abs() <= 5.0
        ),
        "RPC slot starts vs the node's replay_stage-new_leader: median {s_med} ms over {n} slots"
    );
    let report = load.finish().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("client load: {}", report.json);
    // The load ran as offered and the node took it.
    assert!(
        report.reached_rate >= report.offered_rate * 0.9 && report.send_errors * 100 <= report.sent,
        "the client load fell short: {}",
        report.json
    );
    assert!(
        row(
            T1,
            "client load confirmed",
            &format!(
                "{} of {} sent at {} tx/s, {} failed",
                report.confirmed, report.sent, report.reached_rate, report.failed
            ),
            ">= 95%, none failed",
            report.confirmed * 100 >= report.sent * 95 && report.failed == 0
        ),
        "the node did not confirm the load: {}",
        report.json
    );
    let slots = slots_of(&out);
    eprintln!(
        "RPC source: {} slots exported, the node showed {} in the same time; peak RSS {:.1} MiB",
        slots.len(),
        truth.len(),
        rss as f64 / (1 << 20) as f64
    );
    // Slot numbers are the node's, every one a leader slot (a one-node
    // cluster leads every slot).
    assert!(
        slots.len() >= 60,
        "only {} slots in 60 s (~2.3/s expected)",
        slots.len()
    );
    let unknown: Vec<u64> = slots.keys().filter(|n| !truth.contains_key(n)).copied().collect();
    assert!(
        row(
            T1,
            "RPC slot numbers the node never had",
            &format!("{} of {}", unknown.len(), slots.len()),
            "0",
            unknown.is_empty()
        ),
        "slots the node never had: {unknown:?}"
    );
    let (first, last) = (*slots.keys().next().unwrap(), *slots.keys().last().unwrap());
    let missed: Vec<u64> = truth
        .keys()
        .filter(|n| **n >= first && **n <= last && !slots.contains_key(n))
        .copied()
        .collect();
    assert!(
        missed.len() * 20 <= slots.len(),
        "slots the node had that slotprof did not export: {missed:?}"
    );
    let not_leader: Vec<u64> = slots
        .iter()
        .filter(|(_, s)| s["leader"] != true)
        .map(|(n, _)| *n)
        .collect();
    assert!(not_leader.is_empty(), "slots not marked leader: {not_leader:?}");
    // getSlot ("processed") names a slot once its bank is done, at about
    // the slot's end: slotprof's slot ends are compared with that.
    let (median, max, n) = offsets(&slots, &truth, "end_ns");
    eprintln!(
        "RPC source: slot ends minus the test's first sight of each slot over getSlot: median {median:.1} ms, \
         max |{max:.1}| ms over {n} slots"
    );
    assert!(
        row(
            T1,
            "RPC slot ends - the test's own getSlot",
            &format!("median {median:.1} ms, max |{max:.1}| ms, {n} slots"),
            "|median| < 100 ms",
            n >= 60 && median.abs() < 100.0
        ),
        "RPC slot ends vs the node's: median {median} ms"
    );
    // Memory: the target (128 MiB) is the bench's; this bounds a
    // regression (1,019 MiB before the trace was streamed, 145 MiB before
    // the intervals went to a file, 107 MiB after).
    assert!(
        row(
            T1,
            "slotprof peak RSS",
            &format!("{:.1} MiB", rss as f64 / 1048576.0),
            "< 256 MiB (target 128: the bench)",
            rss < 256 << 20
        ),
        "peak RSS {} MiB",
        rss >> 20
    );

    // Stacks: the node has no frame pointers; slotprof unwinds by CFI.
    let on = read_folded(&out.join("oncpu.folded"));
    let off = read_folded(&out.join("offcpu.folded"));
    let (on_reach, on_depth) = reach(&on);
    let (off_reach, off_depth) = reach(&off);
    eprintln!(
        "stacks: on-CPU {:.1}% of {} samples reach the thread entry (median {on_depth} user frames); \
         off-CPU {:.1}% of time (median {off_depth})",
        on_reach * 100.0,
        on.total(),
        off_reach * 100.0
    );
    assert!(on.total() > 1000, "{} on-CPU samples in 60 s", on.total());
    // The bar: 95%. With a 16 KiB copy, 60 s runs here reached
    // 95.5-97.4% idle and 92.8-94.2% under this load, the rest ending in
    // `[stack copy ended]` (replay, banking and RocksDB stacks are deeper);
    // the copy is 32 KiB since.
    let min_reach = 0.95;
    assert!(
        row(
            T1,
            "on-CPU samples reaching the thread entry",
            &format!(
                "{:.1}% of {} (median {on_depth} frames)",
                on_reach * 100.0,
                on.total()
            ),
            &format!(">= {:.0}%", min_reach * 100.0),
            on_reach >= min_reach
        ),
        "on-CPU samples reaching the thread entry: {:.1}%",
        on_reach * 100.0
    );
    row(
        T1,
        "off-CPU time reaching the thread entry",
        &format!("{:.1}% (median {off_depth} frames)", off_reach * 100.0),
        "reported",
        true,
    );

    let summary = read_json(&out.join("summary.json"));
    let findings = read_json(&out.join("findings.json"));
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for f in findings.as_array().unwrap() {
        *kinds
            .entry(f["kind"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    eprintln!("findings in {} slots: {kinds:?}", slots.len());
    for f in findings.as_array().unwrap() {
        eprintln!("  {} in slot {}: {}", f["kind"], f["slot"], f["explanation"]);
    }
    eprintln!("lost: {}", summary["lost"]);
    // A healthy idle node: findings are rare. With 2 ms LockContention and
    // no timeout rule, 70 findings in 134 slots (waits for work and
    // harmless few-ms waits); the target, 1 per 100 slots, is for
    // the 10-minute run (`cargo xtask validator --test`). What is left
    // here are real lock waits of 10+ ms, mostly behind holders preempted
    // on this 2-vCPU machine.
    let total: usize = kinds.values().sum();
    // Measured 7-9% of slots here (9 and 11 findings in ~120 slots, 5 of
    // them once in one slot where the node stalled for 236 ms): the bound
    // catches the flood (53% of slots before), not the target.
    assert!(
        row(
            T1,
            "findings on a healthy node",
            &format!("{total} in {} slots {kinds:?}", slots.len()),
            "<= 15 per 100 slots (target 1: the 10-minute runs)",
            total * 100 <= slots.len() * 15
        ),
        "{total} findings in {} slots of a healthy node",
        slots.len()
    );
    // Stacks lost to map collisions: at most 0.1% of the stacks unwound.
    let lost = summary["lost"]["stacks"].as_u64().unwrap();
    let walked = summary["unwinding"]["stacks"].as_u64().unwrap();
    assert!(
        row(
            T1,
            "stacks lost",
            &format!("{lost} of {walked} unwound"),
            "<= 0.1%",
            lost * 1000 <= walked
        ),
        "{lost} stacks lost of {walked}"
    );
    for cause in [
        "ring_buffer_full",
        "offcpu_map_full",
        "syscall_map_full",
        "malformed_records",
    ] {
        assert_eq!(summary["lost"][cause], 0, "events lost: {}", summary["lost"]);
    }

    // 2. The uprobe slot source, named as in the source code, numbered by
    // RPC; its boundaries beside the node's slot stream.
    let out = private_dir("uprobe");
    let watch = SlotWatch::start(node.rpc_port);
    let (ok, stderr, _) = slotprof_with_rss(&[
        "attach",
        "--pid",
        &pid,
        "--duration",
        "20s",
        "--slot-source",
        &format!("uprobe={}:PohRecorder::set_bank,rpc={url}", bin.display()),
        "--out",
        out.to_str().unwrap(),
    ]);
    let truth = watch.finish();
    assert!(ok, "slotprof attach with the uprobe source failed: {stderr}");
    let slots = slots_of(&out);
    let (median, max, n) = offsets(&slots, &truth, "end_ns");
    eprintln!(
        "uprobe source: {} slots; slot ends (the next set_bank) minus the test's first sight of each slot: \
         median {median:.1} ms, max |{max:.1}| ms over {n} slots",
        slots.len()
    );
    assert!(
        slots.len() >= 20,
        "only {} slots in 20 s with the uprobe source",
        slots.len()
    );
    let unknown: Vec<u64> = slots.keys().filter(|n| !truth.contains_key(n)).copied().collect();
    assert!(
        row(
            T1,
            "uprobe slot numbers the node never had",
            &format!("{} of {}", unknown.len(), slots.len()),
            "0",
            unknown.is_empty()
        ),
        "uprobe slots the node never had: {unknown:?}"
    );
    // The node's own slot starts: its `replay_stage-new_leader` point for
    // each slot it leads, sent every ~10 s. `PohRecorder::set_bank` runs
    // 12-16 ms after it on this node (the bank is made first, then PoH's
    // write lock taken): the uprobe source's starts are that much later
    // than the metric's and the RPC source's. Bounded, not hidden.
    std::thread::sleep(Duration::from_secs(11));
    let series = metric_slot_series(&metrics);
    let new_leader = new_leader_series(&series);
    let (s_med, s_max, n) = offsets(&slots, new_leader, "start_ns");
    eprintln!(
        "uprobe source: slot starts minus the node's replay_stage-new_leader points: median {s_med:.2} ms, \
         max |{s_max:.1}| ms over {n} slots"
    );
    assert!(
        row(
            T1,
            "uprobe (PohRecorder::set_bank) starts - node's replay_stage-new_leader",
            &format!("median {s_med:.1} ms, max |{s_max:.1}| ms, {n} slots"),
            "0..30 ms (set_bank follows the bank's creation)",
            n >= 15 && (0.0..=30.0).contains(&s_med)
        ),
        "uprobe slot starts vs the node's metrics: median {s_med} ms over {n} slots"
    );
    assert!(
        n >= 20 && median.abs() < 100.0,
        "uprobe boundaries vs the node's: median {median} ms"
    );
}

/// An injected stall on the real node: the whole node stopped
/// (SIGSTOP/SIGCONT: a stop signal stops every thread of the process)
/// for 50 ms, three times, while slotprof watches the banking scheduler
/// as the loop thread. Each stop must be a MainLoopGap of about its
/// length in the slot it hit; a gap that matches no stop is counted.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_stopped_node_is_a_main_loop_gap_in_the_slot_it_hit() {
    let Some(_k) = kernel() else { return };
    let Some(node) = node() else { return };
    let pid = node.pid();
    let (_out, stops, slots, gaps, witness) = injected_gaps(
        &node,
        "stop",
        "solBnkTxSched",
        || {},
        move || {
            unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
            std::thread::sleep(Duration::from_millis(50));
            unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        },
    );
    let mut matched = vec![false; gaps.len()];
    for (i, (stop, cont)) in stops.iter().enumerate() {
        let hit = gaps.iter().position(|g| {
            let start = g["start_ns"].as_u64().unwrap();
            let end = start + g["duration_ns"].as_u64().unwrap();
            start <= stop + 10_000_000 && end + 10_000_000 >= *cont
        });
        let Some(j) = hit else {
            panic!(
                "stop {i} ({:.1} ms) is no MainLoopGap: {gaps:?}",
                (cont - stop) as f64 / 1e6
            );
        };
        matched[j] = true;
        let g = &gaps[j];
        let ms = g["duration_ns"].as_u64().unwrap() as f64 / 1e6;
        // The stop as slotprof saw it: at least the 50 ms, and not much
        // more than the stop plus the wait for a CPU after it.
        assert!(
            row(
                "SIGSTOP 50 ms",
                &format!("stop {i}: MainLoopGap of solBnkTxSched"),
                &format!(
                    "{ms:.1} ms in slot {}, cause {}",
                    g["slot"],
                    g["cause"].as_str().unwrap_or("?")
                ),
                "45..250 ms, the stop's slot, stopped by a signal",
                (45.0..250.0).contains(&ms)
            ),
            "stop {i}: a gap of {ms:.1} ms"
        );
        let slot = slots
            .iter()
            .find(|(_, s)| s["start_ns"].as_u64().unwrap() <= *stop && *stop < s["end_ns"].as_u64().unwrap())
            .map(|(n, _)| *n);
        eprintln!(
            "stop {i}: {:.1} ms -> MainLoopGap of {ms:.1} ms in slot {} (the stop's slot {slot:?}): {}",
            (cont - stop) as f64 / 1e6,
            g["slot"],
            g["explanation"]
        );
        // The gap is the slot it began in: the stop's, or the next when
        // the thread stopped only after that slot's end (the signal reaches
        // it a few ms after it is sent: 3.7 ms once, across a boundary).
        let began = slots
            .iter()
            .find(|(_, s)| {
                let start = g["start_ns"].as_u64().unwrap();
                s["start_ns"].as_u64().unwrap() <= start && start < s["end_ns"].as_u64().unwrap()
            })
            .map(|(n, _)| *n);
        assert_eq!(
            g["slot"].as_u64(),
            began,
            "stop {i}: the gap is not in the slot it began in"
        );
        assert!(
            began == slot || began == slot.map(|n| n + 1),
            "stop {i}: the gap began in slot {began:?}, the stop was sent in {slot:?}"
        );
        assert!(
            g["explanation"].as_str().unwrap().contains("stopped by a signal"),
            "stop {i}: the gap's cause is not the stop: {}",
            g["explanation"]
        );
    }
    let unmatched: Vec<&serde_json::Value> = gaps
        .iter()
        .zip(&matched)
        .filter(|(_, m)| !**m)
        .map(|(g, _)| g)
        .collect();
    // Precision: the scheduler thread, busy on a 2-vCPU machine, may wait
    // 30 ms for a CPU now and then: such a gap is the node's own when the
    // kernel's run_delay shows at least half of the wait; any other gap
    // no stop made counts against slotprof.
    let mut own = 0;
    for g in &unmatched {
        let claimed = g["magnitudes"]["runqueue_ms"].as_f64().unwrap_or(0.0);
        let seen = witness.during(g);
        let confirmed = g["cause"] == "waiting for a CPU" && seen.is_some_and(|ms| ms >= claimed / 2.0);
        own += usize::from(confirmed);
        eprintln!(
            "a gap no stop made: {} (the kernel's run_delay over it: {seen:?} ms)",
            g["explanation"]
        );
    }
    row(
        "SIGSTOP 50 ms",
        "MainLoopGaps waiting for a CPU no stop made, seen by the kernel's run_delay",
        &own.to_string(),
        "listed (the node's own)",
        true,
    );
    let false_ones = unmatched.len() - own;
    assert!(
        row(
            "SIGSTOP 50 ms",
            "other MainLoopGaps no stop made",
            &false_ones.to_string(),
            "<= 1 in 30 s",
            false_ones <= 1
        ),
        "{false_ones} MainLoopGaps match no stop"
    );
}

/// A 30 s attach with `--loop-thread loop_thread --gap-threshold 30ms`
/// while another thread runs `prepare`, then `act` at 10, 16 and 22 s:
/// the output directory, each act's (start, end), the slots and the
/// MainLoopGap findings.
#[allow(clippy::type_complexity)]
fn injected_gaps(
    node: &Node,
    what: &str,
    loop_thread: &str,
    prepare: impl FnOnce() + Send + 'static,
    mut act: impl FnMut() + Send + 'static,
) -> (
    Scratch,
    Vec<(u64, u64)>,
    BTreeMap<u64, serde_json::Value>,
    Vec<serde_json::Value>,
    RunDelay,
) {
    let out = private_dir(what);
    let tid = thread_named(node.pid(), loop_thread)
        .unwrap_or_else(|| panic!("the node has no {loop_thread} thread"));
    let stop = Arc::new(AtomicBool::new(false));
    let witness = RunDelay::watch(node.pid(), tid, stop.clone());
    // Beside the output directory (slotprof wants that one to itself).
    let err_dir = private_dir(&format!("{what}-stderr"));
    let err_path = err_dir.join("stderr");
    let attached = err_path.clone();
    let injector = std::thread::spawn(move || {
        prepare();
        // Once slotprof says it is attached (seconds; more on a loaded
        // machine: a burst before it would be a test's mistake, not a
        // miss), and the slot source has had a few slots.
        let since = std::time::Instant::now();
        while !std::fs::read_to_string(&attached).is_ok_and(|t| t.contains("slotprof: attached in"))
            && since.elapsed() < Duration::from_secs(60)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_secs(3));
        let mut done = Vec::new();
        for _ in 0..3 {
            let at = monotonic_ns();
            act();
            done.push((at, monotonic_ns()));
            std::thread::sleep(Duration::from_secs(6));
        }
        done
    });
    let (ok, stderr, _) = slotprof_with_rss_to(
        &[
            "attach",
            "--pid",
            &node.pid().to_string(),
            "--duration",
            "30s",
            "--slot-source",
            &format!("rpc={}", node.rpc_url()),
            "--loop-thread",
            loop_thread,
            "--gap-threshold",
            "30ms",
            "--out",
            out.to_str().unwrap(),
        ],
        &err_path,
    );
    let done = injector.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let witness = witness.join().unwrap();
    assert!(ok, "slotprof attach failed: {stderr}");
    let slots = slots_of(&out);
    let gaps = findings(&out, "MainLoopGap");
    (out, done, slots, gaps, witness)
}

/// The kernel's own count of the time a thread waited on a run queue
/// (`/proc/PID/task/TID/schedstat`, second field: sched_info's
/// run_delay, kept by the scheduler and independent of slotprof's
/// probes), read every 2 ms: the witness that a gap slotprof calls
/// "waiting for a CPU" was one.
struct RunDelay {
    /// (CLOCK_MONOTONIC ns, run_delay ns)
    samples: Vec<(u64, u64)>,
}

impl RunDelay {
    fn watch(pid: u32, tid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<RunDelay> {
        let path = format!("/proc/{pid}/task/{tid}/schedstat");
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let Ok(text) = std::fs::read_to_string(&path) else {
                    break;
                };
                if let Some(delay) = text.split_whitespace().nth(1).and_then(|d| d.parse().ok()) {
                    samples.push((monotonic_ns(), delay));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            RunDelay { samples }
        })
    }

    /// The run-queue wait the kernel counted between the last reading at
    /// or before `from` and the first at or after `to` plus 5 ms (the
    /// count grows when the wait ends, as the thread gets its CPU), in ms;
    /// None when the readings do not cover the window.
    fn between(&self, from: u64, to: u64) -> Option<f64> {
        let before = self.samples.iter().rev().find(|(t, _)| *t <= from)?;
        let after = self.samples.iter().find(|(t, _)| *t >= to + 5_000_000)?;
        Some(after.1.saturating_sub(before.1) as f64 / 1e6)
    }

    /// The same for a MainLoopGap finding's window.
    fn during(&self, gap: &serde_json::Value) -> Option<f64> {
        let start = gap["start_ns"].as_u64()?;
        self.between(start, start + gap["duration_ns"].as_u64()?)
    }
}

/// The tid of the node's thread named `comm`.
fn thread_named(pid: u32, comm: &str) -> Option<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .filter_map(|e| e.ok())
        .find(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == comm))
        .and_then(|e| e.file_name().to_str()?.parse().ok())
}

/// A thread's CPU affinity, set to one CPU and given back when dropped
/// (also when a check fails).
struct Pinned {
    tid: u32,
    before: libc::cpu_set_t,
}

impl Pinned {
    fn to(tid: u32, cpu: usize) -> std::io::Result<Pinned> {
        unsafe {
            let mut before: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(tid as i32, std::mem::size_of::<libc::cpu_set_t>(), &mut before) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            if libc::sched_setaffinity(tid as i32, std::mem::size_of::<libc::cpu_set_t>(), &one) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(Pinned { tid, before })
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        unsafe {
            libc::sched_setaffinity(
                self.tid as i32,
                std::mem::size_of::<libc::cpu_set_t>(),
                &self.before,
            );
        }
    }
}

/// A CPU hog on the PoH thread's CPU: the test validator does not pin
/// its PoH thread (a mainnet validator pins it to `--poh-pinned-cpu-core`),
/// so the test pins it to CPU 1, then runs a SCHED_FIFO spinner on that
/// CPU for 60 ms, three times (a real-time process, or an interrupt storm,
/// that takes the core). Each burst must be a MainLoopGap of the PoH
/// thread, caused by waiting for a CPU, in the slot it hit; gaps no burst
/// made are counted (precision).
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_cpu_hog_on_the_poh_core_is_a_gap_waiting_for_a_cpu_in_the_slot_it_hit() {
    let Some(_k) = kernel() else { return };
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(
            Need::Cpus(2),
            "the hog needs a second CPU (one for the hog and the PoH thread, one for the rest)",
        );
        return;
    }
    let Some(node) = node() else { return };
    let pid = node.pid();
    let poh = thread_named(pid, "solPohTickProd").expect("the node has no solPohTickProd thread");
    let _pinned = Pinned::to(poh, 1).expect("pin the PoH thread");
    let prepare = || {
        std::mem::forget(Pinned::to(unsafe { libc::gettid() } as u32, 1).expect("pin the hog"));
        let param = libc::sched_param { sched_priority: 1 };
        let fifo = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } == 0;
        assert!(fifo, "SCHED_FIFO: {}", std::io::Error::last_os_error());
    };
    let spin = || {
        let at = monotonic_ns();
        while monotonic_ns() - at < 60_000_000 {
            std::hint::spin_loop();
        }
    };
    let (_out, bursts, slots, gaps, witness) = injected_gaps(&node, "hog", "solPohTickProd", prepare, spin);
    let mut matched = vec![false; gaps.len()];
    for (i, (from, to)) in bursts.iter().enumerate() {
        // The gap that covers most of the burst.
        let hit = gaps.iter().position(|g| {
            let start = g["start_ns"].as_u64().unwrap();
            let end = start + g["duration_ns"].as_u64().unwrap();
            start.max(*from) + 30_000_000 <= end.min(*to)
        });
        // The kernel's own count says the hog did make the PoH thread wait.
        let seen = witness.between(*from, *to);
        assert!(
            row(
                "CPU hog on the PoH core",
                &format!("burst {i}: the kernel's run_delay of solPohTickProd"),
                &seen.map_or("no readings".into(), |ms| format!("{ms:.1} ms")),
                ">= 30 ms (the witness that the hog took the core)",
                seen.is_some_and(|ms| ms >= 30.0)
            ),
            "hog burst {i}: the kernel counted {seen:?} ms of run-queue wait for the PoH thread"
        );
        let Some(j) = hit else {
            panic!("hog burst {i} is no MainLoopGap of the PoH thread: {gaps:?}");
        };
        matched[j] = true;
        let g = &gaps[j];
        let slot = slots
            .iter()
            .find(|(_, s)| s["start_ns"].as_u64().unwrap() <= *from && *from < s["end_ns"].as_u64().unwrap())
            .map(|(n, _)| *n);
        eprintln!(
            "hog burst {i}: {:.1} ms -> MainLoopGap of {:.1} ms in slot {} (the burst's slot {slot:?}): {}",
            (to - from) as f64 / 1e6,
            g["duration_ns"].as_u64().unwrap() as f64 / 1e6,
            g["slot"],
            g["explanation"]
        );
        row(
            "CPU hog on the PoH core",
            &format!("burst {i}: MainLoopGap of solPohTickProd"),
            &format!(
                "{:.1} ms in slot {}, cause {}",
                g["duration_ns"].as_u64().unwrap() as f64 / 1e6,
                g["slot"],
                g["cause"].as_str().unwrap_or("?")
            ),
            "the burst's slot (or the next), waiting for a CPU >= 30 ms",
            g["cause"] == "waiting for a CPU"
                && g["magnitudes"]["runqueue_ms"].as_f64().unwrap_or(0.0) >= 30.0
                && (g["slot"].as_u64() == slot || g["slot"].as_u64() == slot.map(|s| s + 1)),
        );
        assert_eq!(
            g["cause"], "waiting for a CPU",
            "hog burst {i}: {}",
            g["explanation"]
        );
        assert!(
            g["magnitudes"]["runqueue_ms"].as_f64().unwrap() >= 30.0,
            "hog burst {i}: {}",
            g["explanation"]
        );
        // The burst's slot, or the next when the gap began just before its end.
        let n = g["slot"].as_u64();
        assert!(
            n == slot || n == slot.map(|s| s + 1),
            "hog burst {i}: the gap is in slot {n:?}, the burst in {slot:?}"
        );
    }
    let unmatched: Vec<&serde_json::Value> = gaps
        .iter()
        .zip(&matched)
        .filter(|(_, m)| !**m)
        .map(|(g, _)| g)
        .collect();
    // Precision. The PoH thread, pinned to one of two CPUs it shares with
    // the node's other ~1.2 cores of work, also waits for a CPU on its own
    // now and then (28 ms at a time, seen here), and has long futex waits
    // of its own (50-60 ms, 1 run in 5): real gaps of the node, listed. A
    // gap said to be waiting for a CPU that no burst made and that the
    // kernel's run_delay does not show (at least half of it) is a false
    // one.
    let (cpu_waits, other): (Vec<&&serde_json::Value>, Vec<_>) =
        unmatched.iter().partition(|g| g["cause"] == "waiting for a CPU");
    let mut unseen = 0;
    for g in &cpu_waits {
        let claimed = g["magnitudes"]["runqueue_ms"].as_f64().unwrap_or(0.0);
        let seen = witness.during(g);
        let confirmed = seen.is_some_and(|ms| ms >= claimed / 2.0);
        unseen += usize::from(!confirmed);
        eprintln!(
            "a gap no burst made: {} (the kernel's run_delay over it: {seen:?} ms{})",
            g["explanation"],
            if confirmed { "" } else { ": NOT seen" }
        );
    }
    for g in &other {
        eprintln!("a gap no burst made: {}", g["explanation"]);
    }
    row(
        "CPU hog on the PoH core",
        "MainLoopGaps of other causes (the node's own)",
        &other.len().to_string(),
        "listed",
        true,
    );
    row(
        "CPU hog on the PoH core",
        "MainLoopGaps waiting for a CPU no burst made, seen by the kernel's run_delay",
        &(cpu_waits.len() - unseen).to_string(),
        "listed (the node's own)",
        true,
    );
    assert!(
        row(
            "CPU hog on the PoH core",
            "MainLoopGaps waiting for a CPU that neither a burst nor the kernel's run_delay shows",
            &unseen.to_string(),
            "0",
            unseen == 0
        ),
        "{unseen} MainLoopGaps waiting for a CPU match no hog burst and no run-queue wait the kernel counted"
    );
}

/// `--offcpu folded` (the default) against `--offcpu exact` on the real
/// node under load: two 40 s attaches at once, both with the RPC slot
/// source (the same slots). Over the slots both covered whole (each
/// side's first and last two left out): each thread name with at least
/// 1 s off-CPU within 2%, every stack with 1% or more of its thread's
/// time within 10%, and the share of the node's waits that folded.
/// Long (two sessions' probes on the node): `sudo cargo xtask validator
/// --test`.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn folded_off_cpu_time_matches_exact_on_the_real_node() {
    if std::env::var_os("SLOTPROF_VALIDATOR_LONG").is_none() {
        skip(
            Need::Elsewhere,
            "two sessions' probes on the node at once; `sudo cargo xtask test --full` or `sudo cargo xtask validator --test` runs it",
        );
        return;
    }
    let Some(_k) = kernel() else { return };
    let Some(node) = node() else { return };
    let load_dir = private_dir("modes-load");
    let load =
        Load::start(&node, LOAD_RATE, 60, &load_dir.join("report.json")).unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_secs(5));
    let dir = private_dir("modes");
    // Both sessions cut the same slots: fixed 400 ms slots from the same
    // CLOCK_MONOTONIC origin. Each session polling the node's RPC itself
    // placed its boundaries up to a poll apart, and the threads whose
    // waits cluster at slot boundaries (accounts hashing, broadcast, repair)
    // moved 10-100% of a stack's time between the two windows' edges
    // (three of four runs "failed" on that alone).
    let (exact_out, folded_out) =
        modes::exact_and_folded(node.pid(), "40s", "clock=400ms,origin=0", &[], &dir);
    let _ = load.finish();
    let compared = modes::compare(&exact_out, &folded_out, 20, 1_000_000_000);
    let test = "folded_off_cpu_time_matches_exact_on_the_real_node";
    let bad: Vec<String> = (compared.threads.iter())
        .filter(|d| d.off() > 0.02)
        .map(|d| d.describe(2))
        .chain(
            compared
                .stacks
                .iter()
                .filter(|d| d.off() > 0.05)
                .map(|d| d.describe(1)),
        )
        .collect();
    let (compared_threads, stacks_compared, worst) = (
        compared.threads.len(),
        compared.stacks.len(),
        compared.worst_stack(),
    );
    let folded_summary = read_json(&folded_out.join("summary.json"));
    // What each session could not see: a reference that lost stacks (a
    // busy ring stops big copies) is not a reference.
    for (mode, out) in [("exact", &exact_out), ("folded", &folded_out)] {
        let s = read_json(&out.join("summary.json"));
        eprintln!(
            "{mode}: lost {}; unwinding {}; kernel {}",
            s["lost"], s["unwinding"], s["kernel"]
        );
    }
    let c = &folded_summary["counts"];
    let (waits, intervals) = (
        c["offcpu_folded"].as_u64().unwrap_or(0),
        c["offcpu_intervals"].as_u64().unwrap_or(0),
    );
    row(
        test,
        "threads (>= 1 s off-CPU) within 2%, stacks (>= 1% of their thread) within 5%",
        &format!(
            "{} of {compared_threads} threads and {stacks_compared} stacks off (worst stack {:.1}%) over {} slots; {waits} waits folded, {intervals} intervals sent",
            bad.len(),
            worst * 100.0,
            compared.window.len()
        ),
        "none off",
        bad.is_empty() && compared_threads > 0,
    );
    assert!(
        compared_threads > 0,
        "no thread with 1 s off-CPU in {} slots",
        compared.window.len()
    );
    assert!(
        bad.is_empty(),
        "folded differs from exact on the real node: {bad:#?}"
    );
    assert!(waits > 0, "nothing folded on the real node: {c}");
}

/// The target on a healthy idle node, over 10 minutes: at most 1
/// finding per 100 slots, each listed with its stack. Long: run by
/// `sudo cargo xtask validator --test`, not by `cargo xtask test`.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn a_healthy_idle_node_makes_at_most_one_finding_per_hundred_slots_in_ten_minutes() {
    ten_minutes_on_a_healthy_node(None);
}

/// The same under a real client's load (`LOAD_RATE` transactions a
/// second): still a healthy node, so findings stay as rare.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn a_healthy_loaded_node_makes_at_most_one_finding_per_hundred_slots_in_ten_minutes() {
    ten_minutes_on_a_healthy_node(Some(LOAD_RATE));
}

fn ten_minutes_on_a_healthy_node(load_rate: Option<u32>) {
    if std::env::var_os("SLOTPROF_VALIDATOR_LONG").is_none() {
        skip(
            Need::Elsewhere,
            "a 10-minute run; `sudo cargo xtask test --full` or `sudo cargo xtask validator --test` runs it",
        );
        return;
    }
    let Some(_k) = kernel() else { return };
    let Some(node) = node() else { return };
    let load_dir = private_dir("long-load");
    let load = load_rate.map(|rate| {
        let l =
            Load::start(&node, rate, 615, &load_dir.join("report.json")).unwrap_or_else(|e| panic!("{e}"));
        std::thread::sleep(Duration::from_secs(5));
        l
    });
    let out = private_dir("idle");
    let (ok, stderr, rss) = slotprof_with_rss(&[
        "attach",
        "--pid",
        &node.pid().to_string(),
        "--duration",
        "600s",
        "--slot-source",
        &format!("rpc={}", node.rpc_url()),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "slotprof attach failed: {stderr}");
    let report = load.map(|l| l.finish().unwrap_or_else(|e| panic!("{e}")));
    let slots = slots_of(&out);
    let findings = read_json(&out.join("findings.json"));
    let findings = findings.as_array().unwrap();
    let what = if load_rate.is_some() { "loaded" } else { "idle" };
    eprintln!(
        "{what}: {} findings in {} slots; peak RSS {} MiB",
        findings.len(),
        slots.len(),
        rss >> 20
    );
    for f in findings {
        let stack: Vec<&str> = f["stack"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s.as_str())
            .collect();
        eprintln!(
            "  {} in slot {}: {}\n    {}",
            f["kind"],
            f["slot"],
            f["explanation"],
            stack.join(" <- ")
        );
    }
    assert!(slots.len() >= 1000, "only {} slots in 10 minutes", slots.len());
    let test = format!("10 minutes, {what}");
    if let Some(report) = report {
        eprintln!("client load: {}", report.json);
        assert!(
            row(
                &test,
                "client load confirmed",
                &format!(
                    "{} of {} sent at {} tx/s, {} failed",
                    report.confirmed, report.sent, report.reached_rate, report.failed
                ),
                ">= 95%",
                report.confirmed * 100 >= report.sent * 95
            ),
            "the node did not confirm the load: {}",
            report.json
        );
    }
    row(
        &test,
        "slotprof peak RSS (600 s attach)",
        &format!("{:.1} MiB", rss as f64 / 1048576.0),
        "reported",
        true,
    );
    // The target is a rate: about one finding per hundred slots of a
    // healthy node (a real node makes real lock waits: broadcast waiting
    // for replay's bank freeze, ~1% of slots here). A count checked
    // against 1% of the slots fails half the time when the rate is 1%;
    // the check fails when the count shows the rate is above it.
    let (ok, measured) = rate_at_most(findings.len(), slots.len(), 0.01);
    assert!(
        row(
            &test,
            "findings on a healthy node",
            &format!("{measured} slots"),
            "<= 1 per 100 slots (the 95% interval reaches it)",
            ok
        ),
        "{} findings in {} slots of a healthy {what} node (target: 1 per 100)",
        findings.len(),
        slots.len()
    );
}

/// `slotprof run` following the node by name for 30 minutes
/// (`SLOTPROF_RUN_MINUTES` to change) under a real client's load, the node
/// restarted once half-way (a new process on the same ledger and ports, as
/// an operator's restart): slotprof must follow the new process without a
/// restart of its own, keep exporting slots, lose nothing, make no more
/// than 1 finding per 100 slots, and leave no BPF program behind. Its
/// memory is printed here and bounded in `cargo xtask bench --only
/// validator` (targets live in benchmarks). Long: `sudo cargo xtask
/// validator --test`.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn always_on_follows_the_node_through_a_restart_for_thirty_minutes() {
    if std::env::var_os("SLOTPROF_VALIDATOR_LONG").is_none() {
        skip(
            Need::Elsewhere,
            "a 30-minute run; `sudo cargo xtask test --full` or `sudo cargo xtask validator --test` runs it",
        );
        return;
    }
    let minutes: u64 = std::env::var("SLOTPROF_RUN_MINUTES")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(30)
        .max(4);
    let Some(_k) = kernel() else { return };
    let Some(mut node) = node() else { return };
    let dir = private_dir("always-on");
    let export = dir.join("export");
    let metrics = free_port();
    let config = dir.join("slotprof.toml");
    std::fs::write(
        &config,
        format!(
            "[target]\ncomm = \"solana-test-validator\"\n[slots]\nsource = \"rpc={}\"\n[export]\ndir = \"{}\"\n\
             retention_bytes = \"2GiB\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n",
            node.rpc_url(),
            export.display()
        ),
    )
    .unwrap();
    let load_dir = private_dir("always-on-load");
    let load = Load::start(&node, LOAD_RATE, u32::MAX, &load_dir.join("report.json"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut daemon = Daemon::start(&config, &dir);
    let started = std::time::Instant::now();
    let total = Duration::from_secs(minutes * 60);
    let first_pid = node.pid();
    let mut restarted_at = None;
    // (seconds, RSS MiB) from /metrics, every minute.
    let mut rss = Vec::new();
    let mut next_scrape = Duration::from_secs(60);
    // Slot directories seen while it runs (retention removes the oldest
    // of a 30-minute run's ~4,000 before the end).
    let mut seen = std::collections::BTreeSet::new();
    while started.elapsed() < total {
        std::thread::sleep(Duration::from_secs(5));
        assert!(daemon.running(), "slotprof run exited");
        for e in std::fs::read_dir(export.join("slots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(n) = e.file_name().to_string_lossy().parse::<u64>() {
                seen.insert(n);
            }
        }
        if restarted_at.is_none() && started.elapsed() >= total / 2 {
            eprintln!("restarting the node at {:.0} s", started.elapsed().as_secs_f64());
            node.restart(Duration::from_secs(180))
                .unwrap_or_else(|e| panic!("{e}"));
            restarted_at = Some((monotonic_ns(), node.slot().unwrap()));
            eprintln!(
                "the node is back at {:.0} s: pid {} (was {first_pid}), slot {}",
                started.elapsed().as_secs_f64(),
                node.pid(),
                restarted_at.unwrap().1
            );
        }
        if started.elapsed() >= next_scrape {
            next_scrape += Duration::from_secs(60);
            let text = http_get(metrics, "/metrics");
            if let Some(v) = text
                .lines()
                .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
                .and_then(|v| v.trim().parse::<f64>().ok())
            {
                rss.push((started.elapsed().as_secs(), v / 1048576.0));
            }
        }
    }
    let scrape_text = http_get(metrics, "/metrics");
    let report = load.stop().unwrap_or_else(|e| panic!("{e}"));
    let (status, said) = daemon.stop();
    assert!(status.success(), "slotprof run exited with {status}");
    eprintln!("client load: {}", report.json);
    eprintln!("slotprof run RSS (s, MiB): {rss:?}");
    let (_, restart_slot) = restarted_at.expect("the node was restarted");

    // Slots exported in full (every slot of this node is a leader slot).
    let before = seen.iter().filter(|n| **n < restart_slot).count();
    let after = seen.len() - before;
    let findings = read_json(&export.join("findings.json"));
    let findings = findings.as_array().unwrap();
    eprintln!(
        "{before} slots exported before the restart, {after} after; {} findings",
        findings.len()
    );
    for f in findings {
        eprintln!("  {} in slot {}: {}", f["kind"], f["slot"], f["explanation"]);
    }
    let half = (minutes * 60 / 2) as f64 / 0.45;
    let test = format!("slotprof run, {minutes} minutes, node restarted");
    row(
        &test,
        "slots exported before / after the restart",
        &format!("{before} / {after}"),
        &format!(">= {:.0} / >= {:.0}", 0.7 * half, 0.5 * half),
        before as f64 >= 0.7 * half && after as f64 >= 0.5 * half,
    );
    row(
        &test,
        "slotprof run RSS (from its /metrics)",
        &format!(
            "{:.1} MiB at 1 min, {:.1} MiB at the end",
            rss.first().map_or(0.0, |r| r.1),
            rss.last().map_or(0.0, |r| r.1)
        ),
        "reported (the bench holds the target)",
        true,
    );
    assert!(
        before as f64 >= 0.7 * half,
        "only {before} slots before the restart"
    );
    assert!(
        after as f64 >= 0.5 * half,
        "only {after} slots after the restart: slotprof did not follow the node"
    );
    let (ok, measured) = rate_at_most(findings.len(), before + after, 0.01);
    assert!(
        row(
            &test,
            "findings on a healthy node",
            &format!("{measured} slots"),
            "<= 1 per 100 slots (the 95% interval reaches it)",
            ok
        ),
        "{} findings in {} slots of a healthy node",
        findings.len(),
        before + after
    );
    let counter = |prefix: &str| -> f64 {
        scrape_text
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // Events that came after their slot was cut ("late": counted, not
    // silent) and stacks lost in the kernel's stack map (a hash collision
    // in `bpf_get_stackid`: 1 in ~2 million in two 30-minute runs) are
    // bounded by the 0.1%; every other loss is a failure.
    let late = counter("slotprof_lost_events_total{cause=\"late\"}");
    let stacks = counter("slotprof_lost_events_total{cause=\"stacks\"}");
    let lost = counter("slotprof_lost_events_total") - late - stacks;
    let events = counter("slotprof_samples_total") + counter("slotprof_user_stacks_total");
    assert!(
        row(
            &test,
            "events lost / late / stacks lost",
            &format!("{lost} / {late} / {stacks} of ~{events} stacks and samples"),
            "0 / <= 0.1% / <= 0.1%",
            lost == 0.0 && late <= events * 0.001 && stacks <= events * 0.001
        ),
        "events lost:\n{scrape_text}"
    );
    assert_eq!(
        slotprof_programs_left(),
        Vec::<String>::new(),
        "BPF programs left loaded"
    );
    for pid in [first_pid, node.pid()] {
        assert!(
            said.contains(&format!("(pid {pid})")),
            "slotprof run never profiled pid {pid}: {said}"
        );
    }
    // Errors, not warnings: while the node restarts its RPC refuses
    // connections, and the slot source's warning says so ("os error 111").
    assert!(!said.contains("slotprof: error"), "{said}");
}

/// One function name as both tools print it: demangled without the hash,
/// no offset.
fn normal_name(name: &str) -> String {
    let name = name.split("+0x").next().unwrap_or(name).trim();
    let name = if name.starts_with("_R") || name.starts_with("_ZN") {
        format!("{:#}", rustc_demangle::demangle(name))
    } else {
        name.to_string()
    };
    // A legacy Rust symbol's hash, if a tool left it.
    match name.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            head.to_string()
        }
        _ => name,
    }
}

/// perf's on-CPU samples: per sample, the names of its frames in `binary`
/// (perf's `dso`), root first.
fn perf_chains(perf: &Path, data: &Path, binary: &str) -> Vec<Vec<String>> {
    perf_script(perf, data)
        .into_iter()
        .map(|s| {
            s.frames
                .iter()
                .rev()
                .filter(|(sym, dso)| dso.ends_with(binary) && !sym.is_empty() && sym != "[unknown]")
                .map(|(sym, _)| normal_name(sym))
                .collect()
        })
        .collect()
}

/// Stacks against the reference: `perf record --call-graph dwarf` on the
/// same node at the same time (20 s inside slotprof's 40 s, under load).
/// Only the node binary's own frames are compared (perf names them from
/// the same symbol table; glibc's frames differ between symbol sources).
/// Checked: the share of perf's samples whose whole chain of such frames
/// slotprof also has (an unwinder that drops, adds or misplaces a frame
/// fails it), beside each tool's median depth. Long: needs perf, and
/// perf's DWARF copies cost the node.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn stacks_agree_with_perf_dwarf_on_the_same_node() {
    if std::env::var_os("SLOTPROF_VALIDATOR_LONG").is_none() {
        skip(
            Need::Elsewhere,
            "beside perf, in `sudo cargo xtask test --full` or `sudo cargo xtask validator --test`",
        );
        return;
    }
    let Some(perf) = ["/usr/bin/perf", "/usr/local/bin/perf"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
    else {
        skip(
            Need::Tool("perf"),
            "perf is not installed (`apt-get install linux-perf`): nothing to compare with",
        );
        return;
    };
    let Some(_k) = kernel() else { return };
    let Some(node) = node() else { return };
    let bin = binary().unwrap();
    let bin_name = bin.file_name().unwrap().to_string_lossy().to_string();
    let load_dir = private_dir("perf-load");
    let load = Load::start(&node, LOAD_RATE, u32::MAX, &load_dir.join("report.json"))
        .unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_secs(5));
    let out = private_dir("perf-slotprof");
    let perf_dir = private_dir("perf-data");
    let data = perf_dir.join("perf.data");
    let perf_run = {
        let (perf, data, pid) = (perf.clone(), data.clone(), node.pid());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(10));
            Command::new(perf)
                .args([
                    "record",
                    "--call-graph",
                    "dwarf",
                    "-F",
                    "99",
                    "-p",
                    &pid.to_string(),
                    "-o",
                ])
                .arg(&data)
                .args(["--", "sleep", "20"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
        })
    };
    let (ok, stderr, _) = slotprof_with_rss(&[
        "attach",
        "--pid",
        &node.pid().to_string(),
        "--duration",
        "40s",
        "--out",
        out.to_str().unwrap(),
    ]);
    let perf_ok = perf_run.join().unwrap().is_ok_and(|s| s.success());
    let _ = load.stop();
    assert!(ok, "slotprof attach failed: {stderr}");
    assert!(perf_ok, "perf record failed");
    let perf_samples: Vec<Vec<String>> = perf_chains(&perf, &data, &bin_name)
        .into_iter()
        .filter(|c| !c.is_empty())
        .collect();
    let universe: std::collections::HashSet<&str> =
        perf_samples.iter().flatten().map(String::as_str).collect();
    // slotprof's chains, cut to the same frames.
    let on = read_folded(&out.join("oncpu.folded"));
    let mut ours: BTreeMap<Vec<String>, u64> = BTreeMap::new();
    let mut our_depths = Vec::new();
    for (stack, w) in on.iter() {
        let chain: Vec<String> = stack
            .split(';')
            .skip(1)
            .map(normal_name)
            .filter(|f| universe.contains(f.as_str()))
            .collect();
        if chain.is_empty() {
            continue;
        }
        our_depths.extend(std::iter::repeat_n(chain.len(), w as usize));
        *ours.entry(chain).or_default() += w;
    }
    let perf_depths: Vec<usize> = perf_samples.iter().map(Vec::len).collect();
    let median = |mut v: Vec<usize>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    let found = perf_samples.iter().filter(|c| ours.contains_key(*c)).count();
    let share = found as f64 / perf_samples.len().max(1) as f64;
    // The chains perf has that slotprof does not: what they look like.
    let mut missing: BTreeMap<&Vec<String>, u64> = BTreeMap::new();
    for c in perf_samples.iter().filter(|c| !ours.contains_key(*c)) {
        *missing.entry(c).or_default() += 1;
    }
    let mut missing: Vec<_> = missing.into_iter().collect();
    missing.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (c, n) in missing.iter().take(3) {
        eprintln!("  perf has, slotprof not ({n} samples): {}", c.join(" -> "));
    }
    let test = "beside perf --call-graph dwarf";
    row(
        test,
        "median frames in the node binary, perf / slotprof",
        &format!(
            "{} / {} ({} perf samples, {} slotprof samples)",
            median(perf_depths),
            median(our_depths),
            perf_samples.len(),
            on.total()
        ),
        "reported",
        true,
    );
    assert!(
        perf_samples.len() >= 300,
        "perf recorded {} samples of the node",
        perf_samples.len()
    );
    assert!(
        row(
            test,
            "perf samples whose whole chain slotprof also has",
            &format!("{:.1}% of {}", share * 100.0, perf_samples.len()),
            ">= 60% (sampling: slotprof's 40 s cover perf's 20 s)",
            share >= 0.6
        ),
        "only {:.1}% of perf's chains are slotprof's",
        share * 100.0
    );
}

/// `slotprof run` on the real node with its RPC as the slot source asks the
/// node for each exported leader slot's block (getBlock, at most 4 calls a
/// second) and records it in hours/*/outcomes.jsonl: every leader slot it
/// exported has one, and each agrees with the block the test reads from
/// the node itself (transactions, and compute units summed over the
/// block's transactions); `slotprof explain --blocks` then judges those
/// slots. Under load (100 tx/s) the blocks differ in size, so a shifted or
/// mixed-up slot number would not match.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn always_on_records_each_leader_slots_block_from_the_nodes_rpc() {
    let Some(_k) = kernel() else { return };
    let Some(node) = node() else { return };
    let dir = private_dir("block-outcomes");
    let export = dir.join("export");
    let config = dir.join("slotprof.toml");
    std::fs::write(
        &config,
        format!(
            "[target]\ncomm = \"solana-test-validator\"\n[slots]\nsource = \"rpc={}\"\n[export]\ndir = \"{}\"\n\
             [metrics]\nlisten = \"127.0.0.1:{}\"\n[phase_probe]\nenabled = false\n",
            node.rpc_url(),
            export.display(),
            free_port()
        ),
    )
    .unwrap();
    let load_dir = private_dir("block-outcomes-load");
    let _load =
        Load::start(&node, LOAD_RATE, 60, &load_dir.join("report.json")).unwrap_or_else(|e| panic!("{e}"));
    let cfg = config.to_str().unwrap();
    let o = run_slotprof(&["run", "-c", cfg, "--duration", "45s"]);
    assert!(o.status.success(), "slotprof run failed");
    let stderr = String::from_utf8_lossy(&o.stderr);
    let summary = stderr
        .lines()
        .find(|l| l.contains("block outcomes from the RPC"))
        .unwrap_or_else(|| panic!("no block-outcome summary in: {stderr}"));
    eprintln!("{summary}");
    let lines = |name: &str| -> Vec<serde_json::Value> {
        let mut v = Vec::new();
        for h in std::fs::read_dir(export.join("hours")).unwrap().flatten() {
            let text = std::fs::read_to_string(h.path().join(name)).unwrap_or_default();
            v.extend(
                text.lines()
                    .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()),
            );
        }
        v
    };
    let leaders: Vec<u64> = lines("slots.jsonl")
        .iter()
        .filter(|s| s["leader"] == true && s["aligned"] == true)
        .map(|s| s["number"].as_u64().unwrap())
        .collect();
    let outcomes: BTreeMap<u64, serde_json::Value> = lines("outcomes.jsonl")
        .into_iter()
        .map(|o| (o["slot"].as_u64().unwrap(), o))
        .collect();
    let missing: Vec<&u64> = leaders.iter().filter(|s| !outcomes.contains_key(s)).collect();
    assert!(
        row(
            "block outcomes",
            "exported leader slots without a recorded block outcome",
            &format!("{} of {}", missing.len(), leaders.len()),
            "0, of at least 50",
            missing.is_empty() && leaders.len() >= 50
        ),
        "leader slots without an outcome: {missing:?}"
    );
    // Each against the node's own block, read here.
    let (mut agree, mut with_load) = (0, 0);
    for (slot, o) in &outcomes {
        let block = slotprof_tests::validator::rpc_call(
            node.rpc_port,
            "getBlock",
            serde_json::json!([slot, {"encoding": "base64", "transactionDetails": "full", "rewards": false,
                "maxSupportedTransactionVersion": 0, "commitment": "confirmed"}]),
        )
        .unwrap_or_else(|e| panic!("the test's own getBlock {slot}: {e}"));
        let txs = block["transactions"].as_array().unwrap();
        let cu: u64 = txs
            .iter()
            .map(|t| t["meta"]["computeUnitsConsumed"].as_u64().unwrap())
            .sum();
        assert_eq!(o["skipped"], false, "slot {slot}: {o}");
        assert_eq!(
            (o["transactions"].as_u64(), o["compute_units"].as_u64()),
            (Some(txs.len() as u64), Some(cu)),
            "slot {slot}: slotprof recorded {o}, the node's block has {} transactions, {cu} units",
            txs.len()
        );
        agree += 1;
        with_load += usize::from(txs.len() > 1);
    }
    assert!(
        row(
            "block outcomes",
            "recorded outcomes equal to the node's own block (transactions, compute units)",
            &format!(
                "{agree} of {}; {with_load} with more than the vote",
                outcomes.len()
            ),
            "all, and at least 10 loaded blocks",
            with_load >= 10
        ),
        "only {with_load} blocks carried the load's transactions"
    );
    // explain judges the recorded blocks.
    let o = run_slotprof(&["explain", export.to_str().unwrap(), "--blocks", "--tx-below", "2"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "explain --blocks: {text}");
    assert!(
        text.contains("the node's own blocks") && text.contains("slots judged"),
        "{text}"
    );
}

/// The program cache of a real Agave node, timed by slotprof's uprobes
/// found through the per-release table (no name given), under a client
/// load whose first Memo and SPL Token calls make the node load, verify
/// and JIT-compile those programs: slotprof's ProgramCache work per slot
/// against the node's own `loaded-programs-cache-stats` (misses and
/// evictions per slot, from its metrics). In CI (about 90 s).
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn a_real_nodes_program_cache_work_is_timed_per_slot_where_the_node_counts_misses() {
    let Some(_k) = kernel() else { return };
    let Some((node, metrics)) = node_with_metrics() else {
        return;
    };
    let pid = node.pid().to_string();
    let url = node.rpc_url();
    let out = private_dir("program-cache");
    let err_dir = private_dir("program-cache-stderr");
    let err_path = err_dir.join("stderr");
    // slotprof first (every slot's work above 1 us is a finding), then the
    // load: the programs' first calls come while it watches.
    let args: Vec<String> = [
        "attach",
        "--pid",
        &pid,
        "--duration",
        "40s",
        "--slot-source",
        &format!("rpc={url}"),
        "--program-cache",
        "on",
        "--program-cache-threshold",
        "1us",
        "--out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let err_for = err_path.clone();
    let run = std::thread::spawn(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        slotprof_with_rss_to(&args, &err_for)
    });
    let waited = std::time::Instant::now();
    while !std::fs::read_to_string(&err_path)
        .unwrap_or_default()
        .contains("profiling")
    {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "slotprof did not attach in 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // What the node does before the probes are on is not slotprof's to
    // see: both sides are compared from the slot after this one.
    // (The slot the node is on, "processed": the default commitment lags
    // it by the confirmation, slot 0 this early in CI's clean-clone run.)
    let attached_in = node.slot().unwrap_or_else(|e| panic!("{e}"));
    let load_dir = private_dir("program-cache-load");
    let load =
        Load::start(&node, LOAD_RATE, 25, &load_dir.join("report.json")).unwrap_or_else(|e| panic!("{e}"));
    let (ok, stderr, _) = run.join().unwrap();
    assert!(ok, "slotprof attach failed: {stderr}");
    let report = load.finish().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("load: {} sent, {} confirmed", report.sent, report.confirmed);
    let said = stderr
        .lines()
        .find(|l| l.contains("program cache:"))
        .unwrap_or_else(|| panic!("no program-cache line: {stderr}"));
    assert!(
        row(
            "program cache",
            "the 4.4.0 node's program-cache functions found by the release table",
            said,
            "8 functions of Agave 2.2 to 4.4",
            said.contains("8 functions of Agave 2.2 to 4.4")
        ),
        "{said}"
    );
    let found = findings(&out, "ProgramCache");
    // Per slot: (programs loaded, load, verify, JIT, evict/prune ms).
    let mut by_slot: BTreeMap<u64, (u64, f64, f64, f64, f64)> = BTreeMap::new();
    for f in &found {
        let Some(slot) = f["slot"].as_u64() else { continue };
        let m = &f["magnitudes"];
        let e = by_slot.entry(slot).or_default();
        let g = |k: &str| m[k].as_f64().unwrap_or(0.0);
        e.0 += g("programs_loaded") as u64;
        e.1 += g("load_ms");
        e.2 += g("verify_ms");
        e.3 += g("jit_ms");
        e.4 += g("evict_ms");
        if g("jit_ms") > 0.0 {
            eprintln!("slot {slot}: {}; stack {}", f["explanation"], f["stack"]);
        }
    }
    // The node's own counts per slot.
    let stats = metrics.points("loaded-programs-cache-stats");
    let mut node_misses: BTreeMap<u64, u64> = BTreeMap::new();
    for p in &stats {
        if let (Some(slot), Some(misses)) = (p.int("slot"), p.int("misses")) {
            *node_misses.entry(slot as u64).or_default() += misses.max(0) as u64;
        }
    }
    if let Some(p) = stats.iter().find(|p| p.int("misses").unwrap_or(0) > 0) {
        eprintln!("a loaded-programs-cache-stats point with misses: {p:?}");
    }
    let slots = slots_of(&out);
    let (first, last) = (
        *slots.keys().next().expect("slots"),
        *slots.keys().last().expect("slots"),
    );
    // Nor is slotprof's first slot compared (2 runs of 3, 2026-12-06:
    // the node {5: 1, 7: 1}, slotprof {7: 1}, probes on in slot 3). Most
    // likely: that slot begins when the slot source's first notification
    // arrives, and the load's first transactions, queued while the node
    // was on the slot before, run in the bank's first moments, before it:
    // time outside every slot (in the session's profile, in no slot's
    // finding). Not proven here; the later slots are compared exactly.
    let from = (first + 1).max(attached_in + 1);
    eprintln!("probes on in slot {attached_in}; slotprof's slots {first}..={last}; compared from {from}");
    let missed: BTreeMap<u64, u64> = node_misses
        .range(from..=last)
        .filter(|(_, m)| **m > 0)
        .map(|(s, m)| (*s, *m))
        .collect();
    let loaded: BTreeMap<u64, u64> = by_slot
        .range(from..=last)
        .filter(|(_, w)| w.0 > 0)
        .map(|(s, w)| (*s, w.0))
        .collect();
    for (slot, w) in by_slot.iter().filter(|(_, w)| w.0 > 0 || w.3 > 0.0) {
        eprintln!(
            "slot {slot}: {} programs loaded: load {:.2} ms, verify {:.2} ms, JIT {:.2} ms, evict/prune {:.2} ms; \
             the node: {:?} misses",
            w.0,
            w.1,
            w.2,
            w.3,
            w.4,
            node_misses.get(slot)
        );
    }
    eprintln!(
        "{} slots; prune/evict timed in {} of them ({:.2} ms in all); {} cache-stats points from the node",
        slots.len(),
        by_slot.values().filter(|w| w.4 > 0.0).count(),
        by_slot.values().map(|w| w.4).sum::<f64>(),
        stats.len()
    );
    assert!(
        row(
            "program cache",
            "programs loaded per slot, slotprof (uprobes) vs the node's own misses (its metrics)",
            &format!("{loaded:?} vs {missed:?}"),
            "equal, at least one",
            loaded == missed && !missed.is_empty()
        ),
        "slotprof {loaded:?}, the node {missed:?}"
    );
}

/// `slotprof run` on a real node under load, pushing every slot to a
/// Pyroscope and an OTLP receiver (local, decoding what arrives): each
/// slot's samples there equal its profile in the export (`export.full =
/// "all"`), the series carry the node's real identity, and nothing is
/// dropped. Outside CI (about 90 s).
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask validator --test`"]
fn a_real_nodes_slots_pushed_to_pyroscope_and_otlp_equal_its_export() {
    use common::pushed::*;
    // CI's push checks are the synthetic validator's (push::).
    if std::env::var_os("SLOTPROF_VALIDATOR_LONG").is_none() {
        skip(
            Need::Elsewhere,
            "a real node's minute of pushing; `sudo cargo xtask test --full` or `sudo cargo xtask validator --test a_real_nodes_slots_pushed` runs it",
        );
        return;
    }
    let Some(_k) = kernel() else { return };
    let Some(node) = node() else { return };
    let test = "push from a real node";
    let identity = node.rpc("getIdentity", serde_json::json!([])).unwrap()["identity"]
        .as_str()
        .unwrap()
        .to_string();
    let dir = private_dir("push");
    let export = dir.join("export");
    let (pyro, otlp) = (
        receiver(200, std::time::Duration::ZERO),
        receiver(200, std::time::Duration::ZERO),
    );
    let config = dir.join("slotprof.toml");
    std::fs::write(
        &config,
        format!(
            "[target]\ncomm = \"solana-test-validator\"\n[slots]\nsource = \"rpc={}\"\n[export]\ndir = \"{}\"\n\
             full = \"all\"\n[metrics]\nlisten = \"127.0.0.1:{}\"\n[phase_probe]\nenabled = false\n\
             [push]\npyroscope = \"http://127.0.0.1:{}\"\notlp = \"http://127.0.0.1:{}\"\n\
             [push.labels]\ncluster = \"e2e\"\n",
            node.rpc_url(),
            export.display(),
            free_port(),
            pyro.port,
            otlp.port
        ),
    )
    .unwrap();
    let load_dir = private_dir("push-load");
    let _load =
        Load::start(&node, LOAD_RATE, 60, &load_dir.join("report.json")).unwrap_or_else(|e| panic!("{e}"));
    let slot_now = || node.slot().unwrap_or_else(|e| panic!("{e}"));
    let before = slot_now();
    let (ok, stderr, rss) = slotprof_with_rss(&["run", "-c", config.to_str().unwrap(), "--duration", "60s"]);
    assert!(ok, "slotprof run failed");
    let node_slots = slot_now().saturating_sub(before);
    let (disk, on_disk) = disk_content(&export);
    // The application is the executable's file name.
    let exe = std::fs::read_link(format!("/proc/{}/exe", node.pid())).unwrap();
    let app = exe.file_name().unwrap().to_str().unwrap();
    let (pyro_reqs, otlp_reqs) = (pyro.requests(), otlp.requests());
    let pushed = pyroscope_content(&pyro_reqs, app, Some(&identity));
    let otlp_got = otlp_received(&otlp_reqs, app, Some(&identity));
    let sizes = |r: &[(slotprof_tests::http_receiver::Request, u16)]| {
        let mut v: Vec<usize> = r.iter().map(|(q, _)| q.body.len()).collect();
        v.sort_unstable();
        v
    };
    eprintln!(
        "{} slots on disk; Pyroscope: {} requests, bytes {:?}; OTLP: {} requests, bytes {:?}; peak RSS {:.1} MiB",
        on_disk.len(),
        pyro_reqs.len(),
        sizes(&pyro_reqs),
        otlp_reqs.len(),
        sizes(&otlp_reqs),
        rss as f64 / (1 << 20) as f64
    );
    // Most of the node's minute (its slots run long on this 2-core
    // machine under load: 91 on disk of a minute, 2026-12-06; slotprof's
    // start and its last slot, still open at the stop, are not exported).
    assert!(
        on_disk.len() >= 30 && on_disk.len() as u64 * 10 >= node_slots * 7,
        "{} slots on disk of the {node_slots} the node made in the minute",
        on_disk.len()
    );
    assert!(
        row(
            test,
            "Pyroscope and OTLP: every slot's samples equal its profile on disk",
            &format!(
                "{} and {} slots of {}; {} and {} keys of {}",
                slots_of(&pushed).len(),
                slots_of(&otlp_got).len(),
                on_disk.len(),
                pushed.len(),
                otlp_got.len(),
                disk.len()
            ),
            "all, equal",
            pushed == disk && otlp_got == disk
        ),
        "pushed slots {:?} / {:?} differ from the export's {on_disk:?}",
        slots_of(&pushed),
        slots_of(&otlp_got)
    );
    match otlp_content_by_python(&otlp_reqs, &dir.join("otlp")) {
        Ok(c) => assert!(
            row(
                test,
                "OTLP read by Python's opentelemetry-proto: equal to the export",
                &format!("{} keys vs {}", c.len(), disk.len()),
                "equal",
                c == disk
            ),
            "Python's decoding differs from the export: {}",
            differences(&c, &disk)
        ),
        Err(why) => eprintln!("{test}: OTLP not decoded by Python's opentelemetry-proto: {why}"),
    }
    assert!(
        !stderr.contains(" failed (") && !stderr.contains("refused") && stderr.contains(" 0 dropped"),
        "a healthy push says its counts and nothing else: {stderr}"
    );
}

/// The healthy-node check's statistic: a count at the target rate passes,
/// one clearly above it fails.
#[test]
fn a_finding_rate_is_judged_by_its_interval_not_its_count() {
    assert!(
        rate_at_most(12, 1197, 0.01).0,
        "{}",
        rate_at_most(12, 1197, 0.01).1
    );
    assert!(rate_at_most(0, 1000, 0.01).0);
    let (ok, measured) = rate_at_most(30, 1197, 0.01);
    assert!(!ok, "{measured}");
    assert!(
        measured.starts_with("30 in 1197 (2.51%, 95% interval 1.76-3.56%)"),
        "{measured}"
    );
}
