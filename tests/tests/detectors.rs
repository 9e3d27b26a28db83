//! The detectors under real probes, against stall programs that count what
//! they did, and their fixed twins.

mod common;

use std::collections::HashMap;

use common::*;

/// The madvise system call's tracepoints in a tracefs instance of the
/// test's own (its own ring, sized for the run, checked for overruns:
/// the top-level ring's size and state are whatever the machine left, and
/// in one 6.1 test VM run it held 96 of 4,611 calls).
struct MadviseTrace(TraceInstance);

impl MadviseTrace {
    fn start() -> Option<Self> {
        let events = ["syscalls:sys_enter_madvise", "syscalls:sys_exit_madvise"];
        // ~770 calls a slot, two events each of ~100 bytes.
        match TraceInstance::start(&events, 8 << 10) {
            Ok(t) => Some(Self(t)),
            Err(e) => {
                eprintln!("{e}");
                None
            }
        }
    }

    /// (calls, total ns) of madvise(DONTNEED|FREE) by thread `tid`, from
    /// the raw trace.
    fn purges_of(&self, tid: u32) -> (u64, u64) {
        let (mut calls, mut ns, mut open): (u64, u64, Option<(f64, bool)>) = (0, 0, None);
        for e in self.0.stop().iter().filter(|e| e.tid == tid) {
            if e.text.starts_with("sys_madvise(") {
                let purge = ["behavior: 4)", "behavior: 8)", "behavior: 0x4)", "behavior: 0x8)"]
                    .iter()
                    .any(|b| e.text.ends_with(b));
                open = Some((e.ts, purge));
            } else if e.text.starts_with("sys_madvise ->") {
                if let Some((start, true)) = open.take() {
                    calls += 1;
                    ns += ((e.ts - start).max(0.0) * 1e9) as u64;
                }
            }
        }
        (calls, ns)
    }
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn sync_allocator_purge_fires_on_the_sync_twin_only_and_counts_right() {
    let Some(_k) = kernel_with(&["raw_syscalls:sys_enter", "raw_syscalls:sys_exit"]) else {
        return;
    };
    let Some(trace) = MadviseTrace::start() else {
        skip(
            Need::Other,
            "cannot enable the madvise tracepoints in tracefs for the independent count",
        );
        return;
    };
    let (out, truth) = record(
        "purge-sync",
        &["--slot-source", "clock=400ms"],
        "stall-alloc",
        &["--slots", "6"],
    );
    let pid = truth["pid"].as_u64().unwrap() as u32;
    let (trace_calls, trace_ns) = trace.purges_of(pid);
    drop(trace);

    // slotprof's count of the hot thread's purges against tracefs' and jemalloc's.
    let summary = read_json(&out.join("summary.json"));
    let main = summary["madvise_by_thread"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tid"] == pid)
        .cloned()
        .unwrap();
    let calls = main["purge_calls"].as_f64().unwrap();
    let ms = main["purge_ms"].as_f64().unwrap();
    eprintln!(
        "slotprof: {calls} calls {ms:.2} ms; tracefs: {trace_calls} calls {:.2} ms; jemalloc nmadvise {}",
        trace_ns as f64 / 1e6,
        truth["dirty_nmadvise"]
    );
    let near = |a: f64, b: f64| b > 0.0 && (a / b - 1.0).abs() <= 0.2;
    assert!(
        near(calls, trace_calls as f64),
        "calls: slotprof {calls} vs tracefs {trace_calls}"
    );
    assert!(
        near(ms, trace_ns as f64 / 1e6),
        "time: slotprof {ms} ms vs tracefs {} ms",
        trace_ns as f64 / 1e6
    );
    assert!(
        near(calls, truth["dirty_nmadvise"].as_f64().unwrap()),
        "calls vs jemalloc's own count"
    );

    // The finding: on the hot thread, in (nearly) every slot, with jemalloc's frames.
    let f = findings(&out, "SyncAllocatorPurge");
    assert!(f.len() >= 4, "{} findings for 6 slots", f.len());
    for x in &f {
        assert_eq!(x["tid"], pid);
        assert_eq!(x["magnitudes"]["allocator_frames"], 1.0, "{x}");
        assert!(x["slot"].is_u64());
    }
    let sum: f64 = f
        .iter()
        .map(|x| x["magnitudes"]["madvise_calls"].as_f64().unwrap())
        .sum();
    // Both ways: the findings hold (nearly) all of the purges tracefs
    // counted, and none it did not.
    eprintln!("findings hold {sum} of {trace_calls} calls (tracefs)");
    assert!(
        sum >= 0.9 * trace_calls as f64 && sum <= 1.1 * trace_calls as f64,
        "findings hold {sum} calls, tracefs counted {trace_calls} (slotprof {calls})"
    );
    // ...and it shows in the slot's own summary and in index.html.
    let slot = f[0]["slot"].as_u64().unwrap();
    let sj = read_json(&out.join("slots").join(slot.to_string()).join("slot.json"));
    assert!(sj["findings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["kind"] == "SyncAllocatorPurge"));
    assert!(std::fs::read_to_string(out.join("index.html"))
        .unwrap()
        .contains("SyncAllocatorPurge"));

    // The fixed twin: background purging, drop on a reaper thread.
    let sync_out = out;
    let (out, _) = record(
        "purge-bg",
        &["--slot-source", "clock=400ms"],
        "stall-alloc",
        &["--slots", "6", "--purge", "background"],
    );
    let f = findings(&out, "SyncAllocatorPurge");
    assert!(f.is_empty(), "fired on the background twin: {f:?}");
    let _ = std::fs::remove_dir_all(sync_out.parent().unwrap());
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

/// The slow iteration stall-gaps logged (`slow`: ones it did not inject
/// into, with what the kernel counted over each) that the finding `f`
/// overlaps, 1 ms either side for the two clocks' readings, when the
/// program's own count shows `f`'s cause as at least 40% of it: a gap the
/// machine made (a wait for a CPU, an overslept sleep). In a TCG test VM
/// (`emulated`) the host also takes the vCPU away mid-iteration, which the
/// guest counts as the loop's own on-CPU time (steal, invisible to it):
/// there, and only there, an on-CPU gap of a slow iteration is that.
fn machine_gap<'a>(
    f: &serde_json::Value,
    slow: &'a [serde_json::Value],
    emulated: bool,
) -> Option<&'a serde_json::Value> {
    let s = f["start_ns"].as_u64().unwrap();
    let e = s + f["duration_ns"].as_u64().unwrap();
    let g = slow.iter().find(|g| {
        let (a, b) = (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap());
        a < e + 1_000_000 && s < b + 1_000_000
    })?;
    let wall = g["end_ns"].as_u64().unwrap() - g["start_ns"].as_u64().unwrap();
    let cpu = g["cpu_ns"].as_u64().unwrap();
    let delay = g["run_delay_ns"].as_u64().unwrap();
    let blocked = wall.saturating_sub(cpu + delay);
    let part = match f["cause"].as_str() {
        Some("waiting for a CPU") => delay,
        Some("sleep") => blocked,
        Some("on-CPU") if emulated => return Some(g),
        Some("on-CPU") => cpu,
        _ => 0,
    };
    (part * 10 >= wall * 4).then_some(g)
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn main_loop_gaps_are_found_with_their_cause_and_none_on_the_smooth_twin() {
    let Some(_k) = kernel_with(&["sched:sched_switch"]) else {
        return;
    };
    // 10 ms: the injected gaps are 20 ms; a smooth iteration (0.5 ms of
    // work, a 0.5 ms sleep) stays far below it. In a TCG test VM, whose
    // timers oversleep the 0.5 ms to 5-10 ms and whose vCPUs the host takes
    // away now and then, all three are stretched (x5: 50 ms, 100 ms).
    let scale = time_scale();
    let threshold_ns: u64 = 10_000_000 * scale;
    let threshold = format!("{}ms", threshold_ns / 1_000_000);
    let (gap_ms, slow_ms) = ((20 * scale).to_string(), (5 * scale).to_string());
    let opts = [
        "-F",
        "499",
        "--loop-symbol",
        "stall_loop_iteration",
        "--gap-threshold",
        &threshold,
    ];
    // The builder thread makes each bank the loop drops while the loop
    // runs; under TCG a 1.2M-object bank took longer to build than the
    // whole run (6.1's VM, 2026-12-06: no drop gap at all), so the VM's
    // banks are 1/scale of it (their drop still takes 50+ ms there).
    let bank_objects = (1_200_000 / scale).to_string();
    let (out, truth) = record(
        "gaps",
        &opts,
        "stall-gaps",
        &[
            "--seconds",
            "8",
            "--gap-ms",
            &gap_ms,
            "--bank-objects",
            &bank_objects,
        ],
    );
    let gaps = findings(&out, "MainLoopGap");
    let injected = truth["gaps"].as_array().unwrap();
    // A sanity check of the run, not of slotprof: a slow machine (a TCG
    // test VM) gets through fewer iterations in the same time.
    assert!(injected.len() >= 8, "too few gaps injected: {}", injected.len());
    let want = HashMap::from([
        ("sleep", "sleep"),
        ("lock", "lock wait (futex)"),
        ("drop", "on-CPU"),
    ]);
    let (mut found, mut right, mut drop_named) = (0, 0, 0);
    let (mut lock_blocked, mut lock_spun) = (0, 0);
    for g in injected {
        let (s, e) = (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap());
        if e - s < threshold_ns {
            continue; // only gaps over the threshold count
        }
        let hit = gaps.iter().find(|f| {
            let fs = f["start_ns"].as_u64().unwrap();
            fs <= e && fs + f["duration_ns"].as_u64().unwrap() >= s
        });
        let Some(hit) = hit else { continue };
        found += 1;
        let kind = g["kind"].as_str().unwrap();
        // The kernel's own count for the thread decides what a lock gap
        // was: in the TCG test VMs the waiter now and then spends most of
        // one on-CPU inside `Mutex::lock_contended` (its getrusage time
        // says ~90 of 100 ms, with one voluntary switch), and on-CPU is
        // then the right answer.
        let cpu_ns = g["cpu_ns"].as_u64().expect("the stall program reports cpu_ns");
        let want_cause = if kind == "lock" && cpu_ns * 2 > e - s {
            lock_spun += 1;
            "on-CPU"
        } else {
            if kind == "lock" {
                lock_blocked += 1;
            }
            want[kind]
        };
        // A gap the kernel counted as mostly run-queue wait (the program's
        // run_delay_ns, 40% of it or more: a busy shared machine) is
        // rightly one of waiting for a CPU, whatever was injected.
        let delay_ns = g["run_delay_ns"].as_u64().unwrap_or(0);
        let waited = delay_ns * 10 >= (e - s) * 4;
        if hit["cause"] == want_cause || (waited && hit["cause"] == "waiting for a CPU") {
            right += 1;
        } else {
            eprintln!(
                "{kind} gap at {s} found as {}: {} magnitudes {} evidence {}; the program's \
                 thread: {} ms on-CPU, {} voluntary switches",
                hit["cause"],
                hit["stack"],
                hit["magnitudes"],
                hit["evidence"],
                g["cpu_ns"].as_u64().unwrap_or(0) / 1_000_000,
                g["voluntary_switches"]
            );
        }
        if kind == "drop" && names_the_drop(&hit["stack"]) {
            drop_named += 1;
        }
    }
    let over: usize = injected
        .iter()
        .filter(|g| g["end_ns"].as_u64().unwrap() - g["start_ns"].as_u64().unwrap() >= threshold_ns)
        .count();
    eprintln!(
        "{found} of {over} injected gaps found, {right} with the right cause; {} findings; \
         lock gaps: {lock_blocked} blocked, {lock_spun} mostly on-CPU by the thread's own count",
        gaps.len()
    );
    assert!(
        lock_blocked > 0,
        "no lock gap blocked: the futex cause went unchecked"
    );
    assert!(found as f64 >= 0.9 * over as f64, "found {found} of {over}");
    // Precision, with the program's own log as the truth: a finding on
    // this run must overlap a gap the program injected (any of them: one
    // just under the threshold can be found over it), 1 ms either side
    // for the two clocks' readings.
    let injected_at = |f: &serde_json::Value| {
        let s = f["start_ns"].as_u64().unwrap();
        let e = s + f["duration_ns"].as_u64().unwrap();
        injected.iter().any(|g| {
            let (a, b) = (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap());
            a < e + 1_000_000 && s < b + 1_000_000
        })
    };
    // A gap the machine made (the program logged the iteration as slow,
    // and its own count shows the finding's cause) is real, not a false
    // one: in a TCG test VM a few come in every run.
    let machine_slow = truth["slow"].as_array().unwrap();
    let stray: Vec<&serde_json::Value> = gaps
        .iter()
        .filter(|f| !injected_at(f))
        .filter(|f| match machine_gap(f, machine_slow, scale > 1) {
            Some(g) => {
                eprintln!(
                    "a gap of the machine's: {} (the program's count: {g})",
                    f["explanation"]
                );
                false
            }
            None => true,
        })
        .collect();
    assert!(!gaps.is_empty(), "no MainLoopGap finding at all");
    assert!(
        (gaps.len() - stray.len()) as f64 >= 0.95 * gaps.len() as f64,
        "{} of {} findings match no injected gap: {:?}",
        stray.len(),
        gaps.len(),
        stray
            .iter()
            .map(|f| (&f["cause"], &f["duration_ns"]))
            .collect::<Vec<_>>()
    );
    // 0.85: in a TCG test VM (10-50x slower) a gap now and then overlaps
    // the main thread's own channel wait; on real machines it is 0.97+.
    assert!(
        right as f64 >= 0.85 * found as f64,
        "right cause for {right} of {found}"
    );
    // A check of the run, not of slotprof: the drop's cause was checked.
    let drops_over = injected
        .iter()
        .filter(|g| g["kind"] == "drop")
        .filter(|g| g["end_ns"].as_u64().unwrap() - g["start_ns"].as_u64().unwrap() >= threshold_ns)
        .count();
    assert!(
        drops_over > 0,
        "the program dropped no bank over the {threshold} threshold (its builder thread did not \
         keep up): the on-CPU cause went unchecked"
    );
    assert!(
        drop_named > 0,
        "no drop gap names drop_big_bank or the free under it; on-CPU gap stacks: {:?}",
        gaps.iter()
            .filter(|f| f["cause"] == "on-CPU")
            .map(|f| &f["stack"])
            .collect::<Vec<_>>()
    );

    let steal_before = steal_ms();
    let (out, smooth_truth) = record(
        "gaps-smooth",
        &opts,
        "stall-gaps",
        &["--seconds", "5", "--smooth", "--slow-ms", &slow_ms],
    );
    let stolen = steal_ms() - steal_before;
    // The smooth loop itself never stalls, but on a shared machine its
    // iterations still run long now and then: it waits for a CPU, or its
    // 0.5 ms sleep oversleeps (a CI host's timers stretched one to 12 ms).
    // Those are real gaps; the program logs each slow iteration with what
    // the kernel counted over it (on-CPU time, run-queue wait, the rest
    // blocked), and a gap is right when it is such an iteration and its
    // cause is a part of it the program counted (at least 40%).
    let smooth = findings(&out, "MainLoopGap");
    // What must never appear is one of the program's injected kinds.
    let invented_kind = |f: &serde_json::Value| {
        let stack = f["stack"].to_string();
        f["cause"] == "lock wait (futex)"
            || ["drop_big_bank", "injected_sleep", "wait_for_bank_lock"]
                .iter()
                .any(|n| stack.contains(n))
    };
    let slow = smooth_truth["slow"].as_array().unwrap();
    let iteration_of = |f: &serde_json::Value| machine_gap(f, slow, scale > 1);
    let allowed = |f: &serde_json::Value| !invented_kind(f) && iteration_of(f).is_some();
    let (noise, invented): (Vec<_>, Vec<_>) = smooth.iter().partition(|f| allowed(f));
    for f in &noise {
        eprintln!(
            "smooth twin: a gap of the machine's: {} (the program's count: {})",
            f["explanation"],
            iteration_of(f).unwrap()
        );
    }
    let said = |v: &[&serde_json::Value]| {
        v.iter()
            .map(|f| (f["explanation"].clone(), iteration_of(f).cloned()))
            .collect::<Vec<_>>()
    };
    let (kinds, causes): (Vec<&serde_json::Value>, Vec<&serde_json::Value>) =
        invented.iter().copied().partition(|f| invented_kind(f));
    assert!(
        kinds.is_empty(),
        "the smooth twin has no lock, drop or injected sleep, yet: {:?}",
        said(&kinds)
    );
    // A gap whose cause the program's own count does not show: the host
    // under this VM taking a vCPU away (steal) is counted by the guest
    // neither as on-CPU nor as run-queue wait, so the two clocks disagree
    // on what the time was; while the host stole, this negative check
    // proves nothing, and says so with the figure (natively: 1 such run in
    // 6 on 2026-12-06, every slow iteration 0.0 ms of run_delay, 5-25 ms
    // walls for a 0.5 ms sleep).
    if !causes.is_empty() && stolen > 0 && scale == 1 {
        skip(
            Need::QuietHost,
            format!(
                "the host under this VM stole {stolen} ms of CPU during the smooth twin's 5 s \
                 (/proc/stat), and {} gap(s) had a cause the program's own count does not show: {:?}",
                causes.len(),
                said(&causes)
            ),
        );
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
        return;
    }
    assert!(
        causes.is_empty(),
        "gaps of a cause the program's own count does not show (the host stole {stolen} ms meanwhile): {:?}",
        said(&causes)
    );
    eprintln!(
        "smooth twin: the program saw {} slow iterations itself",
        slow.len()
    );
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn lock_contention_names_the_waiting_stack_and_the_holder() {
    let Some(_k) = kernel_with(&["raw_syscalls:sys_enter", "raw_syscalls:sys_exit"]) else {
        return;
    };
    // Holds of 50 ms (250 ms in the emulated test VMs, where a wakeup can
    // take tens of ms): the loop thread must reach the lock while it is
    // still held (it arrives after a channel wakeup; 20 ms holds there
    // were sometimes over before it came, and nothing waited), and its
    // wait must stay over the default 10 ms per lock and slot.
    let hold_ms = (50 * time_scale()).to_string();
    let seconds = (3 * time_scale()).to_string();
    // With and without frame pointers: the holder's (waker's) stack is
    // unwound with CFI like the waiter's, so it names the holding function
    // in both builds.
    for (build, bin) in [
        ("fp", stall_program("stall-gaps")),
        ("nofp", without_frame_pointers("stall-gaps")),
    ] {
        let (out, truth) = record_bin(
            &format!("lock-{build}"),
            &["--loop-thread", "main-loop"],
            &bin,
            &["--seconds", &seconds, "--gap-ms", &hold_ms],
        );
        let locks = findings(&out, "LockContention");
        let names = |f: &serde_json::Value, key: &str, function: &str| {
            f[key].as_array().is_some_and(|s| {
                s.iter()
                    .any(|s| s.as_str().is_some_and(|s| s.ends_with(function)))
            })
        };
        let bank = locks
            .iter()
            .find(|f| names(f, "stack", "wait_for_bank_lock"))
            .unwrap_or_else(|| panic!("{build}: no LockContention names wait_for_bank_lock: {locks:?}"));
        assert!(
            bank["explanation"].as_str().unwrap().contains("lock-holder"),
            "{build}: {bank}"
        );
        assert!(bank["magnitudes"]["wait_ms"].as_f64().unwrap() >= 10.0);
        assert!(
            names(bank, "waker_stack", "hold_bank_lock"),
            "{build}: the waker's stack does not name hold_bank_lock: {}",
            bank["waker_stack"]
        );
        eprintln!("{build}: waker stack {}", bank["waker_stack"]);
        // The program's own log is the truth: its lock gaps, the waits it
        // blocked in (a gap with no voluntary switch was spun through).
        let lock_gaps: Vec<&serde_json::Value> = truth["gaps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|g| g["kind"] == "lock" && g["voluntary_switches"].as_u64().unwrap_or(0) > 0)
            .collect();
        let logged: Vec<(u64, u64)> = lock_gaps
            .iter()
            .map(|g| (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap()))
            .collect();
        assert!(
            !logged.is_empty(),
            "{build}: the program logged no blocked lock wait"
        );
        // What the futex wait itself lasted, bracketed by the kernel's own
        // counters for the waiting thread: the program's clock runs from
        // before `lock()` to after it, which also counts the mutex's spin
        // before blocking (its CPU time, `getrusage`) and any time spent
        // runnable without a CPU (schedstat's run delay). The futex wait
        // excludes the spin and the delay before it blocked, and includes
        // the delay after its wakeup: it lies between logged - cpu - delay
        // and logged - cpu. Natively both are ~0; in the TCG VMs the spin
        // took up to 234 ms of a 250 ms wait (its `pause` is slow there),
        // which is why the findings there were 15-25% short of the logged
        // time before this bracket.
        let bracket = |g: &serde_json::Value| {
            let logged = g["end_ns"].as_u64().unwrap() - g["start_ns"].as_u64().unwrap();
            let hi = logged.saturating_sub(g["cpu_ns"].as_u64().unwrap_or(0));
            (hi.saturating_sub(g["run_delay_ns"].as_u64().unwrap_or(0)), hi)
        };
        let logged_ns: u64 = logged.iter().map(|(s, e)| e - s).sum();
        // A wait whose blocked part is under the 10 ms threshold (per lock
        // and slot; one wait per slot here) makes no finding; one surely
        // over it must make one.
        let threshold = 10_000_000;
        let must: Vec<(u64, u64)> = lock_gaps
            .iter()
            .map(|g| bracket(g))
            .filter(|b| b.0 >= threshold)
            .collect();
        let may: Vec<(u64, u64)> = lock_gaps
            .iter()
            .map(|g| bracket(g))
            .filter(|b| b.1 >= threshold)
            .collect();
        assert!(
            !must.is_empty(),
            "{build}: no logged lock wait blocked for over 10 ms"
        );
        let bank_locks: Vec<&serde_json::Value> = locks
            .iter()
            .filter(|f| f["magnitudes"]["address"] == bank["magnitudes"]["address"])
            .collect();
        let waits: f64 = bank_locks
            .iter()
            .map(|f| f["magnitudes"]["waits"].as_f64().unwrap())
            .sum();
        let found_ns: u64 = bank_locks
            .iter()
            .map(|f| f["duration_ns"].as_u64().unwrap())
            .sum();
        let lo_ns: u64 = must.iter().map(|b| b.0).sum();
        let hi_ns: u64 = may.iter().map(|b| b.1).sum();
        eprintln!(
            "{build}: {} blocked lock waits logged ({:.1} ms), {}..{} over 10 ms blocked ({:.1}..{:.1} ms); \
             findings: {waits} waits ({:.1} ms) in {} slots",
            logged.len(),
            logged_ns as f64 / 1e6,
            must.len(),
            may.len(),
            lo_ns as f64 / 1e6,
            hi_ns as f64 / 1e6,
            found_ns as f64 / 1e6,
            bank_locks.len()
        );
        // Within 10% of the bracket, natively and in the VMs (natively: 11
        // of 11 waits, 557.1 of 557.3 ms).
        if time_scale() > 1 {
            for f in &bank_locks {
                eprintln!(
                    "{build}: slot {} finding {} waits {:.1} ms from {}",
                    f["slot"], f["magnitudes"]["waits"], f["magnitudes"]["wait_ms"], f["start_ns"]
                );
            }
            for g in &lock_gaps {
                let (a, b) = (g["start_ns"].as_u64().unwrap(), g["end_ns"].as_u64().unwrap());
                eprintln!(
                    "{build}: logged wait {a}..{b} ({:.1} ms; on-CPU {:.1} ms, waiting for a CPU {:.1} ms; handoff {:.1} ms before)",
                    (b - a) as f64 / 1e6,
                    g["cpu_ns"].as_f64().unwrap_or(0.0) / 1e6,
                    g["run_delay_ns"].as_f64().unwrap_or(0.0) / 1e6,
                    (a as f64 - g["handoff_ns"].as_f64().unwrap_or(a as f64)) / 1e6,
                );
            }
        }
        let tol = 0.1;
        assert!(
            waits >= must.len() as f64 * (1.0 - tol) && waits <= may.len() as f64 * (1.0 + tol),
            "{build}: {waits} waits in the findings; {} logged waits blocked surely over 10 ms, {} possibly",
            must.len(),
            may.len()
        );
        assert!(
            found_ns as f64 >= lo_ns as f64 * (1.0 - tol) && found_ns as f64 <= hi_ns as f64 * (1.0 + tol),
            "{build}: {:.1} ms of waits in the findings; the program's waits blocked {:.1}..{:.1} ms",
            found_ns as f64 / 1e6,
            lo_ns as f64 / 1e6,
            hi_ns as f64 / 1e6
        );
        // The quiet slots stay quiet: every LockContention finding is in a
        // slot where the program waited for the lock (the finding starts
        // at its slot's first such wait). The wait starts when the loop
        // asks the holder to take the lock: the loop is the hot thread, so
        // its wait on the channel until the holder has the lock counts too
        // (over 10 ms when the holder is slow to wake, as in the TCG VMs).
        // Every lock gap, blocked or not: one where the loop then took the
        // lock without blocking still had its wait on the channel (a stray
        // 11.3 ms one in 6.1's VM, 2026-12-06, when only blocked gaps
        // counted here).
        let injected: Vec<(u64, u64)> = truth["gaps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|g| g["kind"] == "lock")
            .map(|g| {
                let end = g["end_ns"].as_u64().unwrap();
                (
                    g["handoff_ns"]
                        .as_u64()
                        .unwrap_or(g["start_ns"].as_u64().unwrap()),
                    end,
                )
            })
            .collect();
        // A wait on glibc malloc's own arena lock (`free` or `malloc` ->
        // `__lll_lock_wait_private`) is a real lock wait the program does
        // not log: it is the allocator's, not the injected one, so it is
        // neither counted nor held against the detector (said, not hidden).
        let in_malloc = |f: &&serde_json::Value| {
            let stack = f["stack"].to_string();
            stack.contains("__lll_lock_wait_private")
                && [
                    "__libc_free",
                    "__libc_malloc",
                    "_int_free",
                    "_int_malloc",
                    "arena_get",
                ]
                .iter()
                .any(|m| stack.contains(m))
        };
        for f in locks.iter().filter(in_malloc) {
            eprintln!(
                "{build}: not judged: a {:.1} ms wait on glibc malloc's arena lock: {}",
                f["magnitudes"]["wait_ms"].as_f64().unwrap_or(0.0),
                f["stack"]
            );
        }
        let stray: Vec<String> = locks
            .iter()
            .filter(|f| !in_malloc(f))
            .filter(|f| {
                let s = f["start_ns"].as_u64().unwrap();
                !injected
                    .iter()
                    .any(|&(a, b)| a < s + 1_000_000 && s < b + 1_000_000)
            })
            .map(|f| {
                format!(
                    "{:.1} ms from {} on {:#x} in {:?}",
                    f["magnitudes"]["wait_ms"].as_f64().unwrap_or(0.0),
                    f["start_ns"],
                    f["magnitudes"]["address"].as_f64().unwrap_or(0.0) as u64,
                    f["stack"]
                )
            })
            .collect();
        assert!(
            stray.is_empty(),
            "{build}: LockContention where the program waited for no lock: {stray:?}"
        );
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
    }
}

/// Whether an on-CPU gap's stack shows the drop: `drop_big_bank`, or the
/// allocator's free called from the loop. glibc's free has no frame
/// pointer, so a sample inside it unwinds to the frame above its caller
/// and drop_big_bank itself is skipped: frame-pointer unwinding's known
/// blind spot for a leaf without frame pointers.
fn names_the_drop(stack: &serde_json::Value) -> bool {
    let frames: Vec<&str> = stack
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f.as_str())
        .collect();
    let free = [
        "__libc_free",
        "free",
        "cfree",
        "_int_free",
        "__rdl_dealloc",
        "__rust_dealloc",
    ];
    frames.iter().any(|f| f.ends_with("drop_big_bank"))
        || frames
            .last()
            .is_some_and(|leaf| free.iter().any(|x| leaf.ends_with(x)))
}

/// The run-queue wait the kernel counted for stall-contention's hot thread
/// in `slot` and the slot after it (a wait is placed in the slot it began
/// in; the program counts it when it ends), in ms.
/// Whether the kernel's run_delay agrees with a CpuContention finding's
/// wait: 80% of it, less a little per wait. slotprof counts a wait from
/// the wakeup (runqlat's way), the kernel from the enqueue, and a remote
/// wakeup is enqueued only when the target CPU takes its IPI: microseconds
/// natively, up to ~0.5 ms under TCG (6.1's VM, 2026-12-06: 28.6 ms in 11
/// waits vs the kernel's 22.7).
fn kernel_agrees(kernel_ms: f64, f: &serde_json::Value) -> bool {
    let wait_ms = f["magnitudes"]["wait_ms"].as_f64().unwrap();
    let waits = f["magnitudes"]["waits"].as_f64().unwrap_or(1.0);
    kernel_ms >= 0.8 * wait_ms - waits * 0.1 * time_scale() as f64
}

fn kernel_run_delay_ms(truth: &serde_json::Value, slot: u64) -> f64 {
    truth["slots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| (slot..=slot + 1).contains(&s["slot"].as_u64().unwrap()))
        .map(|s| s["run_delay_ns"].as_u64().unwrap() as f64 / 1e6)
        .sum()
}

/// A real-time hog on the hot thread's core (stall-contention) makes one
/// CpuContention per burst, in the burst's slot, naming the hog (its pid,
/// another process) as what had the CPU and the hot thread's loop as the
/// waiting stack; every finding's wait agrees with the kernel's own count
/// (schedstat run_delay); the fixed twin (the hog on another core) has no
/// finding naming the hog. Both builds: with and without frame pointers.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn cpu_contention_names_the_hog_on_the_hot_core_and_none_on_the_fixed_twin() {
    let Some(_k) = kernel_with(&["sched:sched_switch"]) else {
        return;
    };
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(Need::Cpus(2), "the fixed twin's hog needs a core of its own");
        return;
    }
    // 30 ms bursts against a 5 ms threshold (x5 in a TCG test VM, whose
    // sleeps oversleep by 5-10 ms: the hot thread's own waits grow too).
    let scale = time_scale();
    let burst_ms = 30 * scale;
    let threshold = format!("{}ms", 5 * scale);
    let opts = [
        "--slot-source",
        "clock=400ms,origin=0",
        "--hot-thread",
        "hot",
        "--cpu-wait-threshold",
        &threshold,
    ];
    let burst = burst_ms.to_string();
    for (build, bin) in [
        ("fp", stall_program("stall-contention")),
        ("nofp", without_frame_pointers("stall-contention")),
    ] {
        let (out, truth) = record_bin(
            &format!("contention-{build}"),
            &opts,
            &bin,
            &["--seconds", "6", "--burst-ms", &burst],
        );
        let found = findings(&out, "CpuContention");
        let hot = truth["hot_tid"].as_u64().unwrap();
        let hog = truth["hog_pid"].as_u64().unwrap();
        let slot_ns = truth["slot_ms"].as_u64().unwrap() * 1_000_000;
        let bursts = truth["bursts"].as_array().unwrap();
        assert!(bursts.len() >= 3, "{build}: the hog ran {} bursts", bursts.len());
        let names_hog = |f: &serde_json::Value| {
            f["ran_instead"].as_array().is_some_and(|r| {
                r.iter()
                    .any(|r| r["pid"] == hog && r["comm"] == "hog" && r["class"] == "other_process")
            })
        };
        // Recall: each burst is a finding in its slot, the hog first.
        let mut hog_slots = Vec::new();
        let mut named_loop = 0;
        let mut whole_or_said = 0;
        for b in bursts {
            let slot = b["start_ns"].as_u64().unwrap() / slot_ns;
            hog_slots.push(slot);
            // The witness that the burst took the core: the kernel counted it.
            let kernel_ms = kernel_run_delay_ms(&truth, slot);
            assert!(
                row(
                    "CPU contention",
                    &format!("{build}: slot {slot}: the kernel's run_delay of the hot thread"),
                    &format!("{kernel_ms:.1} ms"),
                    &format!(">= {} ms (the hog took the core)", burst_ms / 2),
                    kernel_ms >= burst_ms as f64 / 2.0
                ),
                "{build}: the burst in slot {slot} did not delay the hot thread ({kernel_ms} ms)"
            );
            let f = found
                .iter()
                .find(|f| f["slot"] == slot && f["tid"] == hot)
                .unwrap_or_else(|| {
                    // What slotprof saw of the hot thread around the burst.
                    let summary = read_json(&out.join("summary.json"));
                    let (from, to) = (b["start_ns"].as_u64().unwrap(), b["end_ns"].as_u64().unwrap());
                    let near: Vec<_> = summary["longest_offcpu"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|l| l["tid"] == hot)
                        .filter(|l| {
                            let s = l["start_ns"].as_u64().unwrap();
                            s < to + 50_000_000 && s + l["duration_ns"].as_u64().unwrap() + 50_000_000 > from
                        })
                        .collect();
                    panic!(
                        "{build}: no CpuContention of the hot thread in slot {slot} (burst {from}..{to}); \
                         the hot thread's longest intervals near it: {near:?}; counts {}, lost {}; \
                         findings: {found:?}",
                        summary["counts"], summary["lost"]
                    )
                });
            let first = &f["ran_instead"][0];
            assert!(
                first["pid"] == hog && first["class"] == "other_process",
                "{build}: slot {slot}: the CPU went first to {first}, not the hog {hog}: {f}"
            );
            assert_eq!(f["cause"], "another process", "{build}: {f}");
            let hog_ms = first["ms"].as_f64().unwrap();
            assert!(
                hog_ms >= burst_ms as f64 / 2.0 && hog_ms <= burst_ms as f64 * 1.5 + 10.0,
                "{build}: slot {slot}: {hog_ms} ms waiting for the hog's {burst_ms} ms burst"
            );
            let stack = f["stack"].to_string();
            if stack.contains("stall_loop_iteration") {
                named_loop += 1;
            } else {
                eprintln!("{build}: slot {slot}: a waiting stack without stall_loop_iteration: {stack}");
            }
            // A waiting stack is the hot thread's whole stack, or says that
            // no user stack was taken (a thread preempted on its way back
            // to user mode is neither in a system call nor in user code).
            if stack.contains("thread_start") || stack.contains("[user stack not taken]") {
                whole_or_said += 1;
            } else {
                eprintln!(
                    "{build}: slot {slot}: a waiting stack that does not reach the thread's start: {stack}"
                );
            }
        }
        assert!(
            row(
                "CPU contention",
                &format!("{build}: waiting stacks whole to the thread's start (or said not taken)"),
                &format!("{whole_or_said} of {}", bursts.len()),
                &format!(">= {}", bursts.len() - 1),
                whole_or_said + 1 >= bursts.len()
            ),
            "{build}: waiting stacks"
        );
        // The waiting stack is the loop's, most of the time natively. Under
        // TCG the thread's own clock and /proc reads (system calls there,
        // each far slower than natively) take most of its time, and the
        // hog's preemption lands in them (6.1's VM, 2026-12-06: 2 of 5 in
        // the loop, 2 in `monotonic_ns` and `run_delay_ns` called by the
        // thread's closure, 1 on the way back to user mode).
        let min_loop = if time_scale() > 1 {
            1
        } else {
            bursts.len().div_ceil(2)
        };
        assert!(
            row(
                "CPU contention",
                &format!("{build}: waiting stacks in stall_loop_iteration"),
                &format!("{named_loop} of {}", bursts.len()),
                &format!(">= {min_loop}"),
                named_loop >= min_loop
            ),
            "{build}: only {named_loop} of {} waiting stacks name stall_loop_iteration",
            bursts.len()
        );
        // Precision: the hog is named only in its slots, and every finding's
        // wait is one the kernel counted.
        for f in &found {
            let slot = f["slot"].as_u64().unwrap();
            assert!(
                !names_hog(f) || hog_slots.contains(&slot),
                "{build}: the hog named in slot {slot}, where it did not run: {f}"
            );
            let wait_ms = f["magnitudes"]["wait_ms"].as_f64().unwrap();
            let kernel_ms = kernel_run_delay_ms(&truth, slot);
            assert!(
                kernel_agrees(kernel_ms, f),
                "{build}: slot {slot}: slotprof says {wait_ms} ms of CPU wait, the kernel counted \
                 {kernel_ms} ms: {f}"
            );
        }
        eprintln!(
            "{build}: {} bursts, {} CpuContention findings (hog in {:?})",
            bursts.len(),
            found.len(),
            found
                .iter()
                .filter(|f| names_hog(f))
                .map(|f| &f["slot"])
                .collect::<Vec<_>>()
        );
        let _ = std::fs::remove_dir_all(out.parent().unwrap());

        // The fixed twin: the same hog, on the other core.
        let (out, twin) = record_bin(
            &format!("contention-{build}-fixed"),
            &opts,
            &bin,
            &["--seconds", "6", "--burst-ms", &burst, "--fixed"],
        );
        let twin_bursts = twin["bursts"].as_array().unwrap().len();
        assert!(
            twin_bursts >= 3,
            "{build}: the fixed twin's hog ran {twin_bursts} bursts"
        );
        let found = findings(&out, "CpuContention");
        let hog = twin["hog_pid"].as_u64().unwrap();
        let named: Vec<_> = found
            .iter()
            .filter(|f| {
                f["ran_instead"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["pid"] == hog))
            })
            .collect();
        assert!(
            row(
                "CPU contention",
                &format!("{build}: fixed twin: findings naming the hog (on another core)"),
                &named.len().to_string(),
                "0",
                named.is_empty()
            ),
            "{build}: the fixed twin's hog was named: {named:?}"
        );
        // What else it found is the machine's, and the kernel counted it.
        for f in &found {
            let slot = f["slot"].as_u64().unwrap();
            let wait_ms = f["magnitudes"]["wait_ms"].as_f64().unwrap();
            let kernel_ms = kernel_run_delay_ms(&twin, slot);
            eprintln!(
                "{build}: fixed twin: a wait of the machine's: {} (kernel: {kernel_ms:.1} ms)",
                f["explanation"]
            );
            assert!(
                kernel_agrees(kernel_ms, f),
                "{build}: fixed twin: {wait_ms} ms vs the kernel's {kernel_ms}: {f}"
            );
        }
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
    }
}

/// Why stall-memory cannot make memory pressure here, if it cannot: its
/// file must be on a disk filesystem (tmpfs and ramfs pages, a test VM's
/// whole root, are not reclaimed without swap) and a memory cgroup
/// controller must be there.
fn memory_pressure_unavailable() -> Option<String> {
    let tmp = std::env::temp_dir();
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Some(format!("cannot statfs {}", tmp.display()));
    }
    if st.f_type == 0x0102_1994 || st.f_type == 0x8584_58f6 {
        return Some(format!(
            "{} is tmpfs/ramfs (a test VM's root is): file pages there are not reclaimed without swap, \
             so a memory limit cannot make reclaim and major faults; run natively",
            tmp.display()
        ));
    }
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let v1 = cgroups.lines().any(|l| {
        l.split(':')
            .nth(1)
            .is_some_and(|c| c.split(',').any(|c| c == "memory"))
    });
    let v2 = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"].iter().any(|r| {
        std::fs::read_to_string(format!("{r}/cgroup.controllers"))
            .is_ok_and(|t| t.split_whitespace().any(|c| c == "memory"))
    });
    (!v1 && !v2).then(|| "no memory cgroup controller (v1 or v2)".to_string())
}

/// A hot thread over its cgroup's memory limit (stall-memory: a 160 MiB
/// file read through a mapping under a 48 MiB limit, in every 3rd slot)
/// makes a MemoryPressure in each pass's slot: cgroup reclaim timed by the
/// vmscan tracepoints, agreeing with the kernel's own pressure count (PSI
/// "some" over the pass), and the file page faults the thread counted
/// (getrusage major faults). No other slot has one unless PSI saw
/// pressure there. The fixed twin (no limit, the file kept in the page
/// cache) has none. Both builds: with and without frame pointers.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn memory_pressure_is_found_per_pass_over_the_limit_and_none_on_the_fixed_twin() {
    let Some(_k) = kernel_with(&[
        "vmscan:mm_vmscan_memcg_reclaim_begin",
        "vmscan:mm_vmscan_memcg_reclaim_end",
    ]) else {
        return;
    };
    if let Some(why) = memory_pressure_unavailable() {
        skip(Need::Other, why);
        return;
    }
    let opts = ["--slot-source", "clock=400ms,origin=0", "--hot-thread", "hot"];
    for (build, bin) in [
        ("fp", stall_program("stall-memory")),
        ("nofp", without_frame_pointers("stall-memory")),
    ] {
        // Under TCG a pass spans 3-5 slots and the next starts 3 slots
        // after it: 6 s held 2 or 3 passes there, 12 s 2 in 6.12's VM
        // (2026-12-06), 18 s at least 3.
        let seconds = if time_scale() > 1 { "18" } else { "6" };
        let (out, truth) = record_bin(&format!("memory-{build}"), &opts, &bin, &["--seconds", seconds]);
        let found = findings(&out, "MemoryPressure");
        let hot = truth["hot_tid"].as_u64().unwrap();
        let phases = truth["phases"].as_array().unwrap();
        assert!(phases.len() >= 3, "{build}: {} passes", phases.len());
        let psi_in = |slot: u64| -> f64 {
            truth["slots"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| (slot..=slot + 1).contains(&s["slot"].as_u64().unwrap()))
                .map(|s| s["psi_some_ns"].as_u64().unwrap() as f64 / 1e6)
                .sum()
        };
        let slot_ns = truth["slot_ms"].as_u64().unwrap() * 1_000_000;
        // slotprof's PSI "some" over slots a..=b (slot.json), and the
        // program's own over the same slots.
        let psi_of = |out: &std::path::Path, a: u64, b: u64| -> f64 {
            (a..=b)
                .map(|s| {
                    let j = read_json(&out.join("slots").join(s.to_string()).join("slot.json"));
                    j["memory_pressure"]["some_ms"]
                        .as_f64()
                        .unwrap_or_else(|| panic!("slot {s} has no memory_pressure: {j}"))
                })
                .sum()
        };
        let own_psi = |a: u64, b: u64| -> f64 {
            truth["slots"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| (a..=b).contains(&s["slot"].as_u64().unwrap()))
                .map(|s| s["psi_some_ns"].as_u64().unwrap() as f64 / 1e6)
                .sum()
        };
        let mut pass_slots = Vec::new();
        for p in phases {
            // The slots the pass spans: one natively; under TCG a pass
            // runs past its slot (6.12's VM: 0.4-0.5 s of reclaim), and
            // its reclaim with it.
            let slot = p["start_ns"].as_u64().unwrap() / slot_ns;
            let end_slot = p["end_ns"].as_u64().unwrap() / slot_ns;
            pass_slots.extend(slot..=end_slot);
            // The witness: the program's cgroup's PSI where it has one (v2).
            // The machine's PSI is an average over CPUs weighted by each
            // one's non-idle time (kernel/sched/psi.c): another CPU as busy
            // as the thread's halves it (a compile did: 14.6 ms for 29.0 ms
            // of reclaim). Without a cgroup PSI (v1) the weighting is
            // undone with what each CPU ran during the pass: the thread's
            // CPU is non-idle all the pass (W), each other CPU its busy
            // time, at most W; the factor (W + others) / W, at most the
            // number of CPUs.
            let psi_ms = p["psi_some_ns"].as_u64().unwrap() as f64 / 1e6;
            let (psi_ms, witness) = match (p["group_psi_some_ns"].as_u64(), p["busy"].as_object()) {
                (Some(g), _) => (g as f64 / 1e6, "its cgroup's PSI some".to_string()),
                (None, Some(busy)) => {
                    let wall = (p["end_ns"].as_u64().unwrap() - p["start_ns"].as_u64().unwrap()) as f64;
                    let cpus: Vec<f64> = busy["cpu_busy_ns"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|b| b.as_f64().unwrap().min(wall))
                        .collect();
                    let others = (cpus.iter().sum::<f64>() - busy["own_cpu_ns"].as_f64().unwrap()).max(0.0);
                    let factor = ((wall + others) / wall).min(cpus.len() as f64);
                    (
                        psi_ms * factor,
                        format!("the kernel's PSI some undone of its CPU weighting ({psi_ms:.1} ms x {factor:.2})"),
                    )
                }
                (None, None) => (psi_ms, "the kernel's PSI some".to_string()),
            };
            let majors = p["major_faults"].as_u64().unwrap();
            let of_pass: Vec<&serde_json::Value> = found
                .iter()
                .filter(|f| f["tid"] == hot && (slot..=end_slot).contains(&f["slot"].as_u64().unwrap()))
                .collect();
            assert!(
                !of_pass.is_empty(),
                "{build}: no MemoryPressure of the hot thread in slots {slot}..={end_slot} (its pass): {found:?}"
            );
            let magnitude = |key: &str| -> f64 {
                of_pass
                    .iter()
                    .map(|f| f["magnitudes"][key].as_f64().unwrap_or(0.0))
                    .sum()
            };
            let reclaim = magnitude("cgroup_reclaim_ms") + magnitude("direct_reclaim_ms");
            assert!(
                row(
                    "memory pressure",
                    &format!("{build}: slots {slot}..={end_slot}: reclaim timed by slotprof vs {witness}"),
                    &format!("{reclaim:.1} ms vs {psi_ms:.1} ms"),
                    "> 0 and <= 1.5 x PSI + 2 ms",
                    reclaim > 0.0 && reclaim <= 1.5 * psi_ms + 2.0
                ),
                "{build}: slot {slot}: {of_pass:?}"
            );
            let faults_ms = magnitude("file_fault_ms");
            assert!(
                majors > 0 || faults_ms == 0.0,
                "{build}: slot {slot}: {faults_ms} ms of file faults, the thread counted no major fault"
            );
            for f in &of_pass {
                eprintln!(
                    "{build}: slot {}: {} (the pass's own count: {majors} major faults)",
                    f["slot"], f["explanation"]
                );
            }
            // The slot's memory pressure as slotprof read it (PSI every
            // 20 ms, in slot.json) against the program's own reading of
            // the same counter around each iteration, over the slot and
            // its neighbours (a reading's 20 ms can fall either side) to
            // the slot after the pass ended. Natively only: under TCG the
            // readings are far apart in guest time (the session's total
            // is checked below, everywhere).
            let last = p["end_ns"].as_u64().unwrap() / slot_ns + 1;
            if time_scale() == 1 {
                let (mine, own) = (psi_of(&out, slot - 1, last), own_psi(slot - 1, last));
                assert!(
                    row(
                        "memory pressure",
                        &format!(
                            "{build}: slots {}..={last}: PSI some, slotprof vs the program's own",
                            slot - 1
                        ),
                        &format!("{mine:.1} ms vs {own:.1} ms"),
                        "within 10% + 3 ms",
                        (mine - own).abs() <= 0.1 * own + 3.0
                    ),
                    "{build}: slot {slot}"
                );
            }
        }
        // The session's pressure, slot by slot summed, against the
        // program's (its first and last slots left out: partly before its
        // first reading and after its last).
        let slots: Vec<u64> = truth["slots"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["slot"].as_u64())
            .collect();
        let (a, mut b) = (slots.iter().min().unwrap() + 1, slots.iter().max().unwrap() - 1);
        // The program counts a pass's pressure in the slot it ended in,
        // slotprof in the slots it spanned: the range holds passes whole
        // (under TCG a pass spans 3-4 slots, and the last one ran past b).
        for p in phases {
            let (s0, s1) = (
                p["start_ns"].as_u64().unwrap() / slot_ns,
                p["end_ns"].as_u64().unwrap() / slot_ns,
            );
            if s0 <= b && s1 > b {
                b = s0 - 1;
            }
        }
        let (mine, own) = (psi_of(&out, a, b), own_psi(a, b));
        assert!(
            row(
                "memory pressure",
                &format!("{build}: slots {a}..={b}: PSI some in all, slotprof vs the program's own"),
                &format!("{mine:.1} ms vs {own:.1} ms"),
                "within 10% + 5 ms",
                (mine - own).abs() <= 0.1 * own + 5.0
            ),
            "{build}"
        );
        // Precision: elsewhere only where the kernel saw memory pressure.
        for f in &found {
            let slot = f["slot"].as_u64().unwrap();
            if f["tid"] == hot && pass_slots.contains(&slot) {
                continue;
            }
            assert!(
                psi_in(slot) > 0.0,
                "{build}: a MemoryPressure where PSI saw none: {f}"
            );
            eprintln!(
                "{build}: pressure of the machine's in slot {slot} (PSI {:.1} ms): {}",
                psi_in(slot),
                f["explanation"]
            );
        }
        let _ = std::fs::remove_dir_all(out.parent().unwrap());

        let (out, twin) = record_bin(
            &format!("memory-{build}-fixed"),
            &opts,
            &bin,
            &["--seconds", "6", "--limit-mib", "0"],
        );
        assert!(twin["phases"].as_array().unwrap().len() >= 3);
        let found = findings(&out, "MemoryPressure");
        let unexplained: Vec<_> = found
            .iter()
            .filter(|f| {
                let slot = f["slot"].as_u64().unwrap();
                twin["slots"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|s| (slot..=slot + 1).contains(&s["slot"].as_u64().unwrap()))
                    .all(|s| s["psi_some_ns"] == 0)
            })
            .collect();
        assert!(
            row(
                "memory pressure",
                &format!("{build}: fixed twin: findings where the kernel saw no pressure"),
                &unexplained.len().to_string(),
                "0",
                unexplained.is_empty()
            ),
            "{build}: {unexplained:?}"
        );
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
    }
}

/// A replay thread whose program cache misses in every 3rd slot
/// (stall-program-cache: evict, load, verify, JIT, named as Agave's
/// functions are, 2 + 3 + 2 + 10 ms) makes a ProgramCache in each miss
/// slot, found through the same per-release table slotprof uses on a
/// validator, with every call of every kind counted and timed within a
/// little of what the thread timed around its calls; the verifier's two
/// copies (monomorphizations) each probed and seen; the JIT's call of
/// itself counted once. No other slot has one (the prunes every slot are
/// under the threshold, and counted where a finding exists). The fixed
/// twin (no misses) has none. Both builds.
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn program_cache_work_is_found_per_miss_slot_by_kind_and_none_on_the_fixed_twin() {
    let Some(_k) = kernel_with(&["sched:sched_switch"]) else {
        return;
    };
    let scale = time_scale();
    let ms = |m: f64| format!("{}", m * scale as f64);
    let threshold = format!("{}ms", 5 * scale);
    let opts = [
        "--slot-source",
        "clock=400ms,origin=0",
        "--program-cache",
        "on",
        "--program-cache-threshold",
        &threshold,
        // Enough samples inside the probed calls (~15 ms of 1.2 s) to
        // judge their stacks.
        "--freq",
        "999",
    ];
    let work = [
        "--seconds",
        "6",
        "--prune-ms",
        &ms(0.3),
        "--evict-ms",
        &ms(2.0),
        "--load-ms",
        &ms(3.0),
        "--verify-ms",
        &ms(2.0),
        "--jit-ms",
        &ms(10.0),
    ];
    for (build, bin) in [
        ("fp", stall_program("stall-program-cache")),
        ("nofp", without_frame_pointers("stall-program-cache")),
    ] {
        let (out, truth) = record_bin(&format!("program-cache-{build}"), &opts, &bin, &work);
        // Every function of the table's row found and probed, both copies
        // of the verifier included.
        let summary = read_json(&out.join("summary.json"));
        let probed: Vec<&str> = summary["probes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["program"] == "slotprof_cache_enter" && p["attached"] == true)
            .filter_map(|p| p["event"].as_str())
            .collect();
        let verifiers = probed.iter().filter(|e| e.contains("RequisiteVerifier")).count();
        assert!(
            row(
                "program cache",
                &format!("{build}: functions probed (the verifier's copies)"),
                &format!("{} ({verifiers})", probed.len()),
                "6 (2)",
                probed.len() == 6 && verifiers == 2
            ),
            "{build}: {probed:?}"
        );
        let found = findings(&out, "ProgramCache");
        let replay = truth["replay_tid"].as_u64().unwrap();
        let slot_ns = truth["slot_ms"].as_u64().unwrap() * 1_000_000;
        // The thread's own account per slot and kind: (calls, ms).
        let mut logged: std::collections::BTreeMap<u64, HashMap<&str, (u64, f64)>> = Default::default();
        let mut variants = std::collections::BTreeSet::new();
        for c in truth["calls"].as_array().unwrap() {
            let (s, e) = (c["start_ns"].as_u64().unwrap(), c["end_ns"].as_u64().unwrap());
            let kind = c["kind"].as_str().unwrap();
            let k = logged.entry(s / slot_ns).or_default().entry(kind).or_default();
            k.0 += 1;
            k.1 += (e - s) as f64 / 1e6;
            if kind == "verify" {
                variants.insert(c["variant"].as_u64().unwrap());
            }
        }
        let miss_slots: Vec<u64> = logged
            .iter()
            .filter(|(_, k)| k.contains_key("jit"))
            .map(|(s, _)| *s)
            .collect();
        assert!(miss_slots.len() >= 3, "{build}: {} misses", miss_slots.len());
        assert_eq!(
            variants.len(),
            2,
            "{build}: the program used both verifier copies"
        );
        let mut stack_named = 0;
        for slot in &miss_slots {
            let f = found
                .iter()
                .find(|f| f["slot"] == *slot && f["tid"] == replay)
                .unwrap_or_else(|| {
                    panic!("{build}: no ProgramCache of the replay thread in slot {slot}: {found:?}")
                });
            let mut calls = 0;
            // The thread's own time of a call is taken inside the function
            // (its first statement to its last); slotprof's from the entry
            // trap to the return trampoline: microseconds apart natively,
            // under TCG up to ~0.9 ms a call (6.1's VM: evict and prune, 2
            // calls, 12.61 vs 14.26 ms when it was taken around the call;
            // around it, one 6.12 run took 6.8 ms more than the function,
            // 15.11 vs 21.92 ms, twice in a row).
            for (kind, (n, logged_ms)) in &logged[slot] {
                calls += n;
                let got = f["magnitudes"][format!("{kind}_ms")].as_f64().unwrap_or(0.0);
                assert!(
                    row(
                        "program cache",
                        &format!("{build}: slot {slot}: {kind} time, slotprof vs the thread's own"),
                        &format!("{got:.2} ms vs {logged_ms:.2} ms"),
                        &format!("0.9 x own - {:.1} ms a call .. own + 0.5 ms", 0.2 * scale as f64),
                        got >= 0.9 * logged_ms - *n as f64 * 0.2 * scale as f64
                            && got <= logged_ms + 0.5 * scale as f64
                    ),
                    "{build}: slot {slot}: {f}"
                );
            }
            assert!(
                row(
                    "program cache",
                    &format!("{build}: slot {slot}: calls (the JIT's inner call not counted)"),
                    &f["magnitudes"]["calls"].to_string(),
                    &calls.to_string(),
                    f["magnitudes"]["calls"].as_f64() == Some(calls as f64)
                ),
                "{build}: slot {slot}: {f}"
            );
            assert_eq!(
                f["cause"], "programs loaded and compiled (cache misses)",
                "{build}: {f}"
            );
            let stack = f["stack"].to_string();
            if stack.contains("emit_instructions") {
                stack_named += 1;
            }
        }
        // The stack is the hottest sample inside the longest call (the JIT,
        // 10 ms: a sample or two at 99 Hz), when one landed there.
        eprintln!(
            "{build}: {stack_named} of {} findings show the sampled stack inside the JIT",
            miss_slots.len()
        );
        // Stacks through a probed call reach the thread's entry: the
        // return address the kernel's uretprobe trampoline took is put back
        // in each stack copy (every sample in emit_instructions is inside
        // one: it is the probed functions' work).
        let folded = std::fs::read_to_string(out.join("oncpu.folded")).unwrap();
        let (mut inside, mut whole, mut trampoline) = (0u64, 0u64, 0u64);
        for line in folded.lines().filter(|l| l.starts_with("replay;")) {
            let (stack, n) = line.rsplit_once(' ').unwrap();
            let n: u64 = n.parse().unwrap();
            // The trampoline as a caller (a user frame below it); as the
            // leaf it is where the thread was (returning through it).
            let frames: Vec<&str> = stack.split(';').collect();
            if frames
                .windows(2)
                .any(|w| w[0] == "[uretprobe trampoline]" && !w[1].ends_with("_[k]"))
            {
                trampoline += n;
            }
            if stack.contains("emit_instructions") {
                inside += n;
                // Rust std's thread_start (glibc's start_thread below it is
                // named only where the system has libc's symbols: the VMs'
                // copy does not).
                if stack.contains("thread_start;") {
                    whole += n;
                }
            }
        }
        assert!(
            row(
                "program cache",
                &format!(
                    "{build}: samples inside probed calls reaching the thread entry (at the trampoline)"
                ),
                &format!("{whole} of {inside} ({trampoline})"),
                ">= 90%, at least 20 (<= 1%)",
                inside >= 20 && whole * 10 >= inside * 9 && trampoline * 100 <= inside
            ),
            "{build}: stacks cut at the uretprobe trampoline"
        );
        // Precision: only the miss slots, but for a prune the machine made
        // slow: the thread's own clock says it took the threshold or more
        // (6.12's VM, 2026-12-06: a 1.5 ms prune took 28.5 ms there, the
        // vCPU taken away inside it). Said, not hidden.
        let threshold_ms = 5.0 * scale as f64;
        let stray: Vec<_> = found
            .iter()
            .filter(|f| !(f["tid"] == replay && miss_slots.contains(&f["slot"].as_u64().unwrap())))
            .filter(|f| {
                let own: f64 = logged
                    .get(&f["slot"].as_u64().unwrap())
                    .map_or(0.0, |k| k.values().map(|(_, ms)| ms).sum());
                let slow = f["tid"] == replay && own >= threshold_ms;
                if slow {
                    eprintln!(
                        "{build}: a slow call of the machine's, the thread's own clock {own:.1} ms: {}",
                        f["explanation"]
                    );
                }
                !slow
            })
            .collect();
        assert!(
            row(
                "program cache",
                &format!("{build}: findings outside the miss slots"),
                &stray.len().to_string(),
                "0",
                stray.is_empty()
            ),
            "{build}: {stray:?}"
        );
        let _ = std::fs::remove_dir_all(out.parent().unwrap());

        let mut fixed = work.to_vec();
        fixed.push("--fixed");
        let (out, twin) = record_bin(&format!("program-cache-{build}-fixed"), &opts, &bin, &fixed);
        let prunes = twin["calls"].as_array().unwrap().len();
        let found = findings(&out, "ProgramCache");
        assert!(prunes >= 10, "{build}: the twin pruned {prunes} times");
        assert!(
            row(
                "program cache",
                &format!("{build}: fixed twin: ProgramCache findings ({prunes} prunes, no misses)"),
                &found.len().to_string(),
                "0",
                found.is_empty()
            ),
            "{build}: {found:?}"
        );
        let _ = std::fs::remove_dir_all(out.parent().unwrap());
    }
}
