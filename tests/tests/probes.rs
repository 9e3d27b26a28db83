//! What differs from one kernel to the next, probe family by probe family:
//! every program loads, passes this kernel's verifier and attaches (or its
//! tracepoint is not in this kernel, which tracefs says independently),
//! and each family's events are there in the numbers the kernel's own
//! tracer (a tracefs instance of the test's) or the workload counts.
//!
//! Short sessions: the CI tier runs these in each test VM (Debian's 6.1
//! and 6.12) beside the spine's first test (switches, wakeups, samples,
//! futex wakers) and the purge detector's (madvise against tracefs), and
//! natively with every other test.
//!
//! Every test needs root and BTF; they are `#[ignore]`d so that a plain
//! `cargo test` as a normal user lists them as skipped.

mod common;

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;

/// Whether `event` ("category:name", or anything else slotprof attaches
/// to: a CPU clock, a uprobe) is a tracepoint this kernel lacks.
fn tracepoint_missing(event: &str) -> bool {
    let Some((cat, name)) = event.split_once(':') else {
        return false;
    };
    if cat.contains('/') || name.contains('/') {
        return false;
    }
    !tracefs_root().join("events").join(cat).join(name).is_dir()
}

/// Every probe in `summary` attached, or its tracepoint is not in this
/// kernel (said as `NOT ON THIS KERNEL`, which the test VMs' table
/// shows); the programs that attached.
fn attached_programs(summary: &serde_json::Value) -> Vec<String> {
    let probes = summary["probes"].as_array().expect("summary.probes");
    assert!(!probes.is_empty(), "no probes in the summary");
    let mut attached = Vec::new();
    for p in probes {
        let (program, event) = (p["program"].as_str().unwrap(), p["event"].as_str().unwrap());
        if p["attached"] == true {
            attached.push(program.to_string());
        } else {
            assert!(
                tracepoint_missing(event),
                "{program} on {event} did not attach although tracefs has the event: {}",
                p["error"]
            );
            eprintln!(
                "NOT ON THIS KERNEL: {event} ({program} not attached: {})",
                p["error"]
            );
        }
    }
    attached
}

/// How many times the kernel ran `program` (`--probe-stats`).
fn runs(summary: &serde_json::Value, program: &str) -> u64 {
    summary["probe_cost"]["programs"]
        .as_array()
        .expect("summary.probe_cost.programs (--probe-stats)")
        .iter()
        .find(|p| p["program"] == program)
        .and_then(|p| p["runs"].as_u64())
        .unwrap_or_else(|| panic!("no run count for {program}: {}", summary["probe_cost"]))
}

/// slotprof's count of `what` within what the kernel's tracer bounds it
/// by, `floor` (above zero: the workload made some) to `ceiling`.
fn within_the_tracer(what: &str, slotprof: u64, (floor, ceiling): (u64, u64)) {
    eprintln!("{what}: slotprof {slotprof}; the tracer's bounds [{floor}, {ceiling}]");
    assert!(floor > 0, "{what}: the workload made none the tracer saw");
    assert!(
        (floor..=ceiling).contains(&slotprof),
        "{what}: slotprof {slotprof}, outside the tracer's [{floor}, {ceiling}]"
    );
}

/// The processes running `exe`.
fn running(exe: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe))
        .collect()
}

/// Compacts every zone now (an action, not a setting: nothing to restore).
fn compact_memory() {
    std::fs::write("/proc/sys/vm/compact_memory", "1").expect("write /proc/sys/vm/compact_memory");
}

const TRACED: [&str; 4] = [
    "tlb:tlb_flush",
    "exceptions:page_fault_user",
    "compaction:mm_compaction_begin",
    "sched:sched_process_exec",
];

/// The kernel's tracer on the events of [`TRACED`] this kernel has.
fn tracer() -> Option<TraceInstance> {
    let present: Vec<&str> = TRACED
        .iter()
        .copied()
        .filter(|e| !tracepoint_missing(e))
        .collect();
    for e in TRACED.iter().filter(|e| !present.contains(e)) {
        eprintln!("NOT ON THIS KERNEL: {e} (its family is not checked here)");
    }
    // 16 MiB a CPU: the session's page faults (the machine's, not only
    // the target's) are ~100k events of ~80 bytes.
    match TraceInstance::start(&present, 16 << 10) {
        Ok(t) => Some(t),
        Err(e) => {
            skip(Need::Other, format!("cannot count with the kernel's tracer: {e}"));
            None
        }
    }
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn every_program_attaches_and_each_family_counts_what_the_kernels_tracer_counts() {
    let Some(_k) = kernel() else { return };
    let Some(trace) = tracer() else { return };
    let exe = stall_program("stall-alloc");
    // Compaction, asked for by this test (not the target) once the target
    // runs: `record` starts it only after every probe is attached.
    let target = exe.clone();
    let compaction = std::thread::spawn(move || {
        let t = Instant::now();
        while running(&target).is_empty() {
            if t.elapsed() > Duration::from_secs(180) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        compact_memory();
        true
    });
    let slot_ms = (400 * time_scale()).to_string();
    let source = format!("uprobe={}:build_bank", exe.display());
    let (out, truth) = record(
        "probes",
        &[
            "--probe-stats",
            "--slot-source",
            &source,
            "--loop-symbol",
            "drop_bank",
        ],
        "stall-alloc",
        &["--slots", "5", "--bank-mib", "16", "--slot-ms", &slot_ms],
    );
    let events = trace.stop();
    drop(trace);
    assert!(compaction.join().unwrap(), "the target never ran");
    let summary = read_json(&out.join("summary.json"));
    let pid = truth["pid"].as_u64().unwrap() as u32;
    let slots = truth["slots"].as_u64().unwrap();
    let attached = attached_programs(&summary);
    let on = |p: &str| attached.iter().any(|a| a == p);
    let traced = |event: &str, target_only: bool| -> Vec<&TracedEvent> {
        events
            .iter()
            .filter(|e| e.event == event && (!target_only || e.tgid == Some(pid)))
            .collect()
    };

    // Every family that always has work ran: the scheduler's, the
    // system calls', the CPU clock's, the interrupt nesting's timers.
    for p in [
        "slotprof_switch",
        "slotprof_waking",
        "slotprof_sys_enter",
        "slotprof_sys_exit",
        "slotprof_cpu",
        "slotprof_hrtimer_entry",
        "slotprof_hrtimer_exit",
    ] {
        assert!(on(p), "{p} is not attached: {}", summary["probes"]);
        assert!(runs(&summary, p) > 0, "{p} never ran");
    }

    // Uprobes: one run per call of the target's function, exactly (the
    // program's own count), and a slot per call of the slot function.
    assert_eq!(
        runs(&summary, "slotprof_slot"),
        slots,
        "build_bank uprobe runs vs the program's banks"
    );
    assert_eq!(
        runs(&summary, "slotprof_loop"),
        slots,
        "drop_bank uprobe runs vs the program's drops"
    );
    let slot_dirs = std::fs::read_dir(out.join("slots")).unwrap().count() as u64;
    assert_eq!(slot_dirs, slots, "a slot per build_bank call");

    // The target's events from its exec of the program on: slotprof's
    // probes were on before it (`record` holds the forked child, a helper
    // exec of slotprof's own binary, until they are), and before it the
    // child's copy-on-write faults and flushes the probes may or may not
    // have seen.
    let exec = traced("sched_process_exec", true)
        .into_iter()
        .find(|e| e.fields.contains(&format!("filename={} ", exe.display())))
        .map(|e| e.ts)
        .expect("the tracer saw the target's exec");
    let count = |event: &str, keep: &dyn Fn(&TracedEvent) -> bool| -> (u64, u64) {
        let all: Vec<&TracedEvent> = traced(event, true).into_iter().filter(|e| keep(e)).collect();
        let after = all.iter().filter(|e| e.ts >= exec).count() as u64;
        (after, all.len() as u64)
    };

    // TLB flushes the target's own threads made (a flush a remote CPU
    // made at its request, reason "remote shootdown" (1), is counted by
    // its IPIs instead): slotprof's in-kernel counter holds every one the
    // tracer saw from the exec on, and no more than it saw in all.
    if on("slotprof_tlb_flush") {
        let (after, all) = count("tlb_flush", &|e| !e.fields.trim_end().ends_with("(1)"));
        let slotprof = summary["tlb"]["flushes"].as_u64().unwrap();
        within_the_tracer("TLB flushes by the target", slotprof, (after, all));
    }

    // Page faults: the program runs once per user fault of any process;
    // the target's from its exec on are a floor, the machine's a ceiling.
    if on("slotprof_page_fault") {
        let (after, _) = count("page_fault_user", &|_| true);
        let machine = traced("page_fault_user", false).len() as u64;
        let n = runs(&summary, "slotprof_page_fault");
        within_the_tracer("user page fault program runs", n, (after, machine));
    }

    // Compaction: this test compacted every zone while the probes were on.
    if on("slotprof_direct_compaction_begin") {
        let tracer = traced("mm_compaction_begin", false).len() as u64;
        let n = runs(&summary, "slotprof_direct_compaction_begin");
        within_the_tracer("compaction begin program runs", n, (1, tracer));
        assert!(
            runs(&summary, "slotprof_mem_stall_end") >= 1,
            "no compaction end seen"
        );
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn the_host_probes_attach_and_see_compaction() {
    let Some(_k) = kernel() else { return };
    let Some(trace) = tracer() else { return };
    let dir = scratch("probes-host");
    let out = dir.join("out");
    let secs = (3 * time_scale()).to_string() + "s";
    let mut host = Command::new(slotprof())
        .args(["host", "--probe-stats", "--duration", &secs, "--out"])
        .arg(&out)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start slotprof host");
    // Compacts once it watches: its probes are on by then.
    let mut said = Vec::new();
    let mut lines = BufReader::new(host.stderr.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        eprintln!("{line}");
        let watching = line.contains("watching the host");
        said.push(line);
        if watching {
            std::thread::sleep(Duration::from_millis(200));
            compact_memory();
            break;
        }
    }
    for line in lines {
        eprintln!("{}", line.unwrap());
    }
    let status = host.wait().unwrap();
    let events = trace.stop();
    drop(trace);
    assert!(status.success(), "slotprof host failed: {said:?}");
    let summary = read_json(&out.join("summary.json"));
    let attached = attached_programs(&summary);
    let tracer = events.iter().filter(|e| e.event == "mm_compaction_begin").count() as u64;
    assert!(
        attached.iter().any(|a| a == "slotprof_compact_begin"),
        "{}",
        summary["probes"]
    );
    let n = runs(&summary, "slotprof_compact_begin");
    within_the_tracer("slotprof host's compaction begin program runs", n, (1, tracer));
    assert!(
        runs(&summary, "slotprof_compact_end") >= 1,
        "no compaction end seen"
    );
    assert_eq!(summary["lost"]["total"], 0, "{}", summary["lost"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The program cache's uprobes and uretprobes (one pair per function of
/// the release's table, both copies of the verifier): every one attaches,
/// and each runs once per call the program timed itself (JIT compilation
/// calls itself once, which its uprobes see too).
#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn the_program_cache_uprobes_attach_and_run_once_per_call() {
    let Some(_k) = kernel() else { return };
    let (out, truth) = record(
        "probes-cache",
        &["--probe-stats", "--program-cache", "on"],
        "stall-program-cache",
        &["--seconds", "3"],
    );
    let summary = read_json(&out.join("summary.json"));
    // One row per function, its uprobe and uretprobe together: the
    // table's six (the verifier's two copies among them).
    let attached = attached_programs(&summary);
    let pairs = attached.iter().filter(|a| *a == "slotprof_cache_enter").count();
    assert_eq!(pairs, 6, "{}", summary["probes"]);
    let calls = truth["calls"].as_array().unwrap();
    let jits = calls.iter().filter(|c| c["kind"] == "jit").count() as u64;
    assert!(jits > 0, "the program missed no program in 3 s: {calls:?}");
    let want = calls.len() as u64 + jits;
    for p in ["slotprof_cache_enter", "slotprof_cache_exit"] {
        assert_eq!(
            runs(&summary, p),
            want,
            "{p} runs vs the program's {} calls and {jits} inner JIT calls",
            calls.len()
        );
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
fn trace_lines_give_their_tgid_event_and_fields() {
    let e = parse_trace_line(
        "     stall-alloc-4242    (   4240) [001] d..1.   123.456789: tlb_flush: pages:-1 reason:local mm shootdown (3)",
    )
    .unwrap();
    assert_eq!((e.tid, e.tgid), (4242, Some(4240)));
    assert_eq!(e.ts, 123.456789);
    assert_eq!(e.event, "tlb_flush");
    assert_eq!(e.fields, "pages:-1 reason:local mm shootdown (3)");
    let u = parse_trace_line(
        "          <idle>-0       (-------) [000] d.h1.   1.000000: page_fault_user: address=0x1",
    )
    .unwrap();
    assert_eq!((u.tid, u.tgid), (0, None));
    assert_eq!(u.event, "page_fault_user");
    assert!(parse_trace_line("# tracer: nop").is_none());
    let m = parse_trace_line(
        "    bank-loop-77  (    70) [000] .....  9.5: sys_madvise(start: 7f00, len_in: 10000, behavior: 4)",
    )
    .unwrap();
    assert_eq!(m.tid, 77);
    assert_eq!(m.text, "sys_madvise(start: 7f00, len_in: 10000, behavior: 4)");
}
