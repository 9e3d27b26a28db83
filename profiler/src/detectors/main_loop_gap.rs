//! `MainLoopGap`: an iteration of the main loop that took longer than the
//! threshold (default 5 ms), decomposed into where the time went: on-CPU
//! (with the top stack), blocked (lock wait, sleep, I/O, poll), waiting for
//! a CPU, and madvise.
//!
//! Iterations come from `--loop-symbol` (a uprobe on the per-iteration
//! function). Without it, every off-CPU interval of the loop thread over
//! the threshold is a gap (on-CPU stalls are then invisible).

use std::collections::{BTreeMap, HashMap};

use super::{ms, overlap, Buckets, DetectorConfig, Finding, Inputs, NameStack};

/// What blocked a thread, from the kernel stack it slept in.
pub fn blocked_on(kernel_frames: &[String]) -> &'static str {
    let has = |pat: &str| kernel_frames.iter().any(|f| f.contains(pat));
    if has("do_signal_stop") {
        // SIGSTOP, SIGTSTP, ...: the whole process was stopped.
        "stopped by a signal"
    } else if has("ptrace_stop") || has("ptrace_notify") {
        "stopped by a tracer (ptrace)"
    } else if has("uprobe_notify_resume") || has("handle_swbp") {
        // Inside the handling of slotprof's own uprobe (it takes the
        // process's mmap lock): the profiler's cost, said as such.
        OWN_UPROBE
    } else if has("rwsem_down") && (has("mmap") || has("do_user_addr_fault") || has("lock_mm_and_find_vma")) {
        "mmap lock wait"
    } else if has("futex") {
        "lock wait (futex)"
    } else if has("nanosleep") || has("hrtimer_sleep") || has("do_nanosleep") {
        "sleep"
    } else if has("io_schedule") || has("blk_") || has("filemap_") || has("ext4") || has("xfs") {
        "I/O"
    } else if has("poll") || has("select") {
        "poll/epoll"
    } else {
        "blocked (other)"
    }
}

/// The cause for time that was neither recorded off-CPU nor sampled on-CPU.
pub const SHORT_WAITS: &str = "waits under --min-offcpu";

/// The cause for time spent in slotprof's own loop uprobe.
pub const OWN_UPROBE: &str = "slotprof's loop uprobe";

fn advice(cause: &str) -> &'static str {
    match cause {
        SHORT_WAITS => "no sample landed in this iteration and no off-CPU interval was recorded: the time went to waits shorter than --min-offcpu (for the run queue, or short blocks); lower --min-offcpu (e.g. 100us) to see them",
        OWN_UPROBE => "the time went to slotprof's own --loop-symbol uprobe (its handler waits for the process's mmap lock while another thread maps or unmaps memory): probe a function called less often, or leave --loop-symbol out (gaps then come from off-CPU intervals only)",
        "mmap lock wait" => "the loop waited for its process's mmap lock (another thread was mapping, unmapping or faulting memory): look for munmap/madvise/mprotect in other threads (allocator purges, big drops) and move them off the loop's hot path",
        "lock wait (futex)" => "the loop waited for a lock held elsewhere: see the LockContention finding for the lock and who held it; take the lock off the loop or shorten the holder's critical section",
        "sleep" => "the loop slept: remove sleeps and timed waits from the hot path",
        "I/O" => "the loop waited for I/O: move file and disk access off the loop thread",
        "poll/epoll" => "the loop waited in poll/epoll: check timeouts on the loop's event wait",
        "madvise" => "the loop returned memory to the kernel itself: see SyncAllocatorPurge; purge in the background (jemalloc background_thread:true) and drop big structures on another thread",
        "waiting for a CPU" => "the loop was runnable but had no CPU: pin it to a reserved core (isolcpus/cpuset) and keep other busy threads off that core",
        _ => "the loop was busy on-CPU: see the stack; move that work off the loop thread (e.g. drop big structures on a reaper thread)",
    }
}

pub fn detect(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let Some(tid) = inputs.loop_tid(config) else {
        return Vec::new();
    };
    let mut marks: Vec<(u64, u64)> = inputs
        .loop_marks
        .iter()
        .filter(|m| m.tid == tid)
        .map(|m| (m.ts_ns, m.page_faults))
        .collect();
    marks.sort_unstable();
    let intervals: Vec<_> = inputs.intervals.iter().filter(|i| i.key.tid == tid).collect();
    let windows: Vec<(u64, u64)> = if marks.is_empty() {
        intervals
            .iter()
            .filter(|i| i.end_ns - i.start_ns > config.gap_threshold_ns)
            .map(|i| (i.start_ns, i.end_ns))
            .collect()
    } else {
        marks
            .windows(2)
            .filter(|w| w[1].0 - w[0].0 > config.gap_threshold_ns)
            .map(|w| (w[0].0, w[1].0))
            .collect()
    };
    let samples: Vec<_> = inputs.samples.iter().filter(|(_, k)| k.tid == tid).collect();
    let madvise: Vec<_> = inputs.madvise.iter().filter(|m| m.tid == tid).collect();
    let futex: Vec<_> = inputs.futex.iter().filter(|f| f.tid == tid).collect();

    let mut findings = Vec::new();
    for (a, b) in windows {
        // One that began before these buckets (run cuts slots in batches:
        // its start mark came in the batch before) is the slot it ended in.
        let Some((slot, _)) = buckets.of(a).or_else(|| buckets.of(b - 1)) else {
            continue;
        };
        let gap = b - a;
        let mut runqueue = 0;
        let mut blocked: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut biggest_block: Option<(u64, &crate::records::Interval)> = None;
        for i in &intervals {
            let o = overlap(a, b, i.start_ns, i.end_ns);
            if o == 0 {
                continue;
            }
            if i.preempted {
                runqueue += o;
                continue;
            }
            // Blocked until woken, then runnable until it got a CPU.
            let woken = if i.woken_ns > i.start_ns && i.woken_ns < i.end_ns {
                i.woken_ns
            } else {
                i.end_ns
            };
            let o = overlap(a, b, i.start_ns, woken);
            runqueue += overlap(a, b, woken, i.end_ns);
            let kernel = names(i.key.tgid, i.key.kernel_stack_id, true);
            *blocked.entry(blocked_on(&kernel)).or_default() += o;
            if biggest_block.is_none_or(|(n, _)| o > n) {
                biggest_block = Some((o, i));
            }
        }
        let blocked_total: u64 = blocked.values().sum();
        let madvise_ns: u64 = madvise.iter().map(|m| overlap(a, b, m.start_ns, m.end_ns)).sum();
        let futex_ns: u64 = futex.iter().map(|f| overlap(a, b, f.start_ns, f.end_ns)).sum();
        let oncpu = gap.saturating_sub(runqueue + blocked_total);
        let oncpu_other = oncpu.saturating_sub(madvise_ns);

        let mut parts: Vec<(&'static str, u64)> = vec![
            ("on-CPU", oncpu_other),
            ("waiting for a CPU", runqueue),
            ("madvise", madvise_ns),
        ];
        parts.extend(blocked.iter().map(|(k, v)| (*k, *v)));
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        let samples_in = samples.iter().filter(|(t, _)| *t >= a && *t < b).count();
        // "On-CPU" is what is left after the recorded off-CPU time; with no
        // sample where two or more were due, the thread was not on a CPU
        // but in waits too short to record.
        let cause = if parts[0].0 == "on-CPU" && samples_in == 0 && oncpu_other >= 2 * config.sample_period_ns
        {
            SHORT_WAITS
        } else {
            parts[0].0
        };

        // The stack that shows the cause.
        let stack = cause_stack(
            cause,
            (a, b),
            &madvise,
            &samples,
            biggest_block,
            inputs.pid,
            names,
        );
        let rest: Vec<String> = parts[1..]
            .iter()
            .filter(|(_, v)| *v > 0)
            .map(|(k, v)| format!("{k} {:.1} ms", ms(*v)))
            .collect();
        let magnitudes = BTreeMap::from([
            ("gap_ms", ms(gap)),
            ("oncpu_ms", ms(oncpu)),
            ("blocked_ms", ms(blocked_total)),
            ("runqueue_ms", ms(runqueue)),
            ("madvise_ms", ms(madvise_ns)),
            ("futex_ms", ms(futex_ns)),
            ("threshold_ms", ms(config.gap_threshold_ns)),
            ("page_faults", faults_from(&marks, a) as f64),
            ("samples", samples_in as f64),
        ]);
        findings.push(Finding {
            kind: crate::detectors::FindingKind::MainLoopGap,
            slot,
            pid: inputs.pid,
            tid,
            thread: inputs.thread_name(tid),
            start_ns: a,
            duration_ns: gap,
            magnitudes,
            cause: Some(cause.to_string()),
            stack,
            waker_stack: Vec::new(),
            ran_instead: Vec::new(),
            explanation: format!(
                "a main-loop iteration took {:.1} ms (threshold {:.0} ms), mostly {cause} ({:.1} ms){}",
                ms(gap),
                ms(config.gap_threshold_ns),
                ms(parts[0].1),
                if rest.is_empty() {
                    String::new()
                } else {
                    format!("; then {}", rest.join(", "))
                }
            ),
            advice: advice(cause).to_string(),
        });
    }
    findings
}

/// User page faults between the mark at `a` and the next (`marks`: (time,
/// the thread's fault count), sorted).
fn faults_from(marks: &[(u64, u64)], a: u64) -> u64 {
    marks
        .windows(2)
        .find(|w| w[0].0 == a)
        .map_or(0, |w| w[1].1.saturating_sub(w[0].1))
}

/// The stack that shows a gap's cause: the longest madvise call's, the
/// commonest sampled stack (preferring ones walked to the thread's root)
/// for on-CPU time and CPU waits, else the longest block's.
#[allow(clippy::too_many_arguments)]
fn cause_stack(
    cause: &str,
    (a, b): (u64, u64),
    madvise: &[&profiler_ebpf::MadviseCall],
    samples: &[&(u64, crate::records::StackKey)],
    biggest_block: Option<(u64, &crate::records::Interval)>,
    pid: u32,
    names: &mut NameStack,
) -> Vec<String> {
    match cause {
        "madvise" => madvise
            .iter()
            .filter(|m| overlap(a, b, m.start_ns, m.end_ns) > 0)
            .max_by_key(|m| m.end_ns - m.start_ns)
            .map(|m| names(m.tgid, m.user_stack_id, false))
            .unwrap_or_default(),
        "on-CPU" | "waiting for a CPU" => {
            let mut counts: HashMap<(i32, i32), u64> = HashMap::new();
            for (ts, k) in samples {
                if *ts >= a && *ts < b {
                    *counts.entry((k.user_stack_id, k.kernel_stack_id)).or_default() += 1;
                }
            }
            // Prefer stacks that were walked to the thread's root: a
            // sample in code built without frame pointers (often libc)
            // ends after a frame or two and names only the leaf.
            let mut named: Vec<(u64, Vec<String>)> = counts
                .into_iter()
                .map(|((u, k), c)| {
                    let mut f = names(pid, u, false);
                    let user_depth = f.len();
                    f.extend(names(pid, k, true));
                    (c + if user_depth >= 3 { 1 << 32 } else { 0 }, f)
                })
                .collect();
            named.sort();
            named.pop().map(|(_, f)| f).unwrap_or_default()
        }
        _ => match biggest_block {
            Some((_, i)) => super::interval_stack(i, names),
            None => Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{detectors::test_support::*, records::Interval};

    const MS: u64 = 1_000_000;

    #[test]
    fn the_unwalked_futex_wait_frame_is_a_lock_wait() {
        let frames = vec![crate::records::syscall_wait_frame(libc::SYS_futex as i32)];
        assert_eq!(blocked_on(&frames), "lock wait (futex)");
    }

    #[test]
    fn blocked_causes_from_kernel_stacks() {
        let k = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // Seen in a test VM: the loop uprobe's handler waiting for mmap_lock.
        let uprobe = k(&[
            "__schedule",
            "schedule",
            "rwsem_down_read_slowpath",
            "down_read",
            "uprobe_notify_resume",
            "exit_to_user_mode_prepare",
        ]);
        assert_eq!(blocked_on(&uprobe), OWN_UPROBE);
        let fault = k(&[
            "__schedule",
            "rwsem_down_read_slowpath",
            "lock_mm_and_find_vma",
            "do_user_addr_fault",
        ]);
        assert_eq!(blocked_on(&fault), "mmap lock wait");
        assert_eq!(
            blocked_on(&k(&["futex_wait_queue", "__x64_sys_futex"])),
            "lock wait (futex)"
        );
        assert_eq!(blocked_on(&k(&["do_nanosleep", "hrtimer_nanosleep"])), "sleep");
        assert_eq!(blocked_on(&k(&["schedule", "pipe_read"])), "blocked (other)");
        // The real node stopped by SIGSTOP (its kernel stack at the switch).
        assert_eq!(
            blocked_on(&k(&[
                "schedule",
                "do_signal_stop",
                "get_signal",
                "arch_do_signal_or_restart"
            ])),
            "stopped by a signal"
        );
        assert_eq!(
            blocked_on(&k(&[
                "schedule",
                "ptrace_stop",
                "ptrace_do_notify",
                "ptrace_notify"
            ])),
            "stopped by a tracer (ptrace)"
        );
    }

    fn inputs<'a>(
        samples: &'a [(u64, crate::records::StackKey)],
        intervals: &'a [Interval],
        madvise: &'a [profiler_ebpf::MadviseCall],
        marks: &'a [profiler_ebpf::LoopMark],
        names: &'a HashMap<u32, String>,
    ) -> Inputs<'a> {
        Inputs {
            samples,
            intervals,
            madvise,
            loop_marks: marks,
            ..empty_inputs(names)
        }
    }

    #[test]
    fn gaps_between_marks_get_their_cause() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        // Iterations every 2 ms, with three long ones: a lock wait at 10,
        // a sleep at 40 and on-CPU work at 70.
        let mut marks: Vec<_> = (0..100).map(|i| mark(7, i * 2 * MS)).collect();
        marks.retain(|m| !(m.ts_ns > 10 * MS && m.ts_ns < 30 * MS));
        marks.retain(|m| !(m.ts_ns > 40 * MS && m.ts_ns < 52 * MS));
        marks.retain(|m| !(m.ts_ns > 70 * MS && m.ts_ns < 90 * MS));
        let intervals = [
            Interval {
                start_ns: 11 * MS,
                end_ns: 29 * MS,
                key: key(7, "main-loop", 1, 101),
                preempted: false,
                woken_ns: 0,
                ran: Default::default(),
                folded: None,
            },
            Interval {
                start_ns: 41 * MS,
                end_ns: 51 * MS,
                key: key(7, "main-loop", 2, 102),
                preempted: false,
                woken_ns: 0,
                ran: Default::default(),
                folded: None,
            },
        ];
        let samples: Vec<_> = (0..20)
            .map(|i| (70 * MS + i * MS, key(7, "main-loop", 3, -14)))
            .collect();
        let stacks = HashMap::from([
            (1, vec!["main", "wait_for_bank_lock"]),
            (101, vec!["do_syscall_64", "futex_wait", "schedule"]),
            (2, vec!["main", "injected_sleep"]),
            (102, vec!["do_syscall_64", "do_nanosleep", "schedule"]),
            (3, vec!["main", "drop_big_bank", "drop_in_place"]),
        ]);
        let mut n = namer(stacks);
        let inp = inputs(&samples, &intervals, &[], &marks, &names);
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        let causes: Vec<_> = f
            .iter()
            .map(|f| (f.start_ns / MS, f.cause.clone().unwrap()))
            .collect();
        assert_eq!(
            causes,
            [
                (10, "lock wait (futex)".to_string()),
                (40, "sleep".to_string()),
                (70, "on-CPU".to_string())
            ]
        );
        assert!(f[0].stack.contains(&"wait_for_bank_lock".to_string()));
        assert!(f[2].stack.contains(&"drop_big_bank".to_string()));
        assert_eq!(f[0].thread, "main-loop");
        assert!(f[0].explanation.contains("20.0 ms"), "{}", f[0].explanation);
        // Test marks count one fault per ms: the 20 ms lock gap saw 20.
        assert_eq!(f[0].magnitudes["page_faults"], 20.0);
    }

    #[test]
    fn smooth_loops_and_unknown_threads_give_nothing() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks: Vec<_> = (0..100).map(|i| mark(7, i * 2 * MS)).collect();
        let inp = inputs(&[], &[], &[], &marks, &names);
        let mut n = namer(HashMap::new());
        assert!(detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n).is_empty());
        let inp = inputs(&[], &[], &[], &[], &names);
        assert!(detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n).is_empty());
    }

    #[test]
    fn unrecorded_time_without_samples_is_not_called_on_cpu() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 0), mark(7, 6 * MS)];
        let config = DetectorConfig {
            sample_period_ns: 2 * MS, // 499 Hz: three samples were due
            ..DetectorConfig::default()
        };
        let mut n = namer(HashMap::from([(3, vec!["main", "work"])]));
        let inp = inputs(&[], &[], &[], &marks, &names);
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some(SHORT_WAITS));
        assert!(f[0].advice.contains("--min-offcpu"));
        // With samples in it, the same iteration is on-CPU.
        let samples = [
            (2 * MS, key(7, "main-loop", 3, -14)),
            (4 * MS, key(7, "main-loop", 3, -14)),
        ];
        let inp = inputs(&samples, &[], &[], &marks, &names);
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("on-CPU"));
    }

    #[test]
    fn a_short_sleep_that_waited_long_for_a_cpu_is_a_cpu_wait() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 0), mark(7, 7 * MS)];
        // Slept 0.5 ms, then runnable for 5.5 ms before it ran.
        let intervals = [Interval {
            start_ns: MS,
            end_ns: 7 * MS,
            key: key(7, "main-loop", 2, 102),
            preempted: false,
            woken_ns: MS + MS / 2,
            ran: Default::default(),
            folded: None,
        }];
        let inp = inputs(&[], &intervals, &[], &marks, &names);
        let mut n = namer(HashMap::from([(102, vec!["do_nanosleep", "schedule"])]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("waiting for a CPU"));
        assert_eq!(f[0].magnitudes["runqueue_ms"], 5.5);
    }

    #[test]
    fn without_marks_long_off_cpu_intervals_are_gaps() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let intervals = [
            Interval {
                start_ns: 0,
                end_ns: 3 * MS,
                key: key(7, "main-loop", 2, 102),
                preempted: false,
                woken_ns: 0,
                ran: Default::default(),
                folded: None,
            },
            Interval {
                start_ns: 10 * MS,
                end_ns: 18 * MS,
                key: key(7, "main-loop", 2, 102),
                preempted: true,
                woken_ns: 0,
                ran: Default::default(),
                folded: None,
            },
        ];
        let inp = inputs(&[], &intervals, &[], &[], &names);
        let config = DetectorConfig {
            loop_thread: Some(crate::detectors::LoopThread::Name("main-loop".into())),
            ..Default::default()
        };
        let mut n = namer(HashMap::new());
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].cause.as_deref(), Some("waiting for a CPU"));
    }
    fn frames(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn each_kernel_frame_pattern_alone_names_its_cause() {
        // Every alternative on its own (one pattern of an `or` must be
        // enough), and each half of an `and` without the other.
        for (stack, cause) in [
            (&["ptrace_notify"][..], "stopped by a tracer (ptrace)"),
            (&["ptrace_stop"], "stopped by a tracer (ptrace)"),
            (&["handle_swbp"], OWN_UPROBE),
            (&["uprobe_notify_resume"], OWN_UPROBE),
            (&["rwsem_down_read_slowpath", "vm_mmap_pgoff"], "mmap lock wait"),
            (
                &["rwsem_down_read_slowpath", "do_user_addr_fault"],
                "mmap lock wait",
            ),
            (
                &["rwsem_down_read_slowpath", "lock_mm_and_find_vma"],
                "mmap lock wait",
            ),
            (&["rwsem_down_write_slowpath", "inode_lock"], "blocked (other)"),
            (&["vm_mmap_pgoff", "schedule"], "blocked (other)"),
            (&["do_user_addr_fault", "schedule"], "blocked (other)"),
            (&["futex_wait"], "lock wait (futex)"),
            (&["__x64_sys_nanosleep"], "sleep"),
            (&["hrtimer_sleep"], "sleep"),
            (&["do_nanosleep"], "sleep"),
            (&["io_schedule"], "I/O"),
            (&["blk_mq_get_tag"], "I/O"),
            (&["filemap_fault"], "I/O"),
            (&["ext4_file_read_iter"], "I/O"),
            (&["xfs_file_read_iter"], "I/O"),
            (&["do_sys_poll"], "poll/epoll"),
            (&["do_select"], "poll/epoll"),
            (&["schedule"], "blocked (other)"),
            (&[], "blocked (other)"),
        ] {
            assert_eq!(blocked_on(&frames(stack)), cause, "{stack:?}");
        }
    }

    #[test]
    fn each_cause_has_its_own_advice() {
        let on_cpu = advice("on-CPU");
        for (cause, says) in [
            (SHORT_WAITS, "--min-offcpu"),
            (OWN_UPROBE, "--loop-symbol"),
            ("mmap lock wait", "mmap lock"),
            ("lock wait (futex)", "LockContention"),
            ("sleep", "sleeps"),
            ("I/O", "file and disk"),
            ("poll/epoll", "poll/epoll"),
            ("madvise", "SyncAllocatorPurge"),
            ("waiting for a CPU", "isolcpus"),
        ] {
            let a = advice(cause);
            assert!(a.contains(says), "{cause}: {a}");
            assert_ne!(a, on_cpu, "{cause}");
        }
        assert!(on_cpu.contains("on-CPU"), "{on_cpu}");
    }

    fn interval(tid: u32, start: u64, end: u64, user: i32, kernel: i32) -> Interval {
        Interval {
            start_ns: start,
            end_ns: end,
            key: key(tid, "main-loop", user, kernel),
            preempted: false,
            woken_ns: 0,
            ran: Default::default(),
            folded: None,
        }
    }

    fn by_name() -> DetectorConfig {
        DetectorConfig {
            loop_thread: Some(crate::detectors::LoopThread::Name("main-loop".into())),
            ..Default::default()
        }
    }

    #[test]
    fn a_gap_must_exceed_the_threshold_and_is_its_own_length() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let mut n = namer(HashMap::new());
        // Without marks: off-CPU intervals of exactly 5 ms and one of
        // 5 ms + 1 ns, late in time (a sum of the ends would pass).
        let intervals = [
            interval(7, 100 * MS, 101 * MS, 1, 101),
            interval(7, 200 * MS, 205 * MS, 1, 101),
            interval(7, 300 * MS, 305 * MS + 1, 1, 101),
        ];
        let inp = inputs(&[], &intervals, &[], &[], &names);
        let f = detect(&inp, &by_name(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f.iter().map(|f| f.start_ns).collect::<Vec<_>>(), [300 * MS]);
        assert_eq!(f[0].duration_ns, 5 * MS + 1);
        // With marks: iterations of exactly 5 ms are not gaps.
        let marks: Vec<_> = (0..10).map(|i| mark(7, i * 5 * MS)).collect();
        let inp = inputs(&[], &[], &[], &marks, &names);
        assert!(detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n).is_empty());
    }

    /// `slotprof run` cuts slots in batches: an iteration whose start mark
    /// came in the batch before is a gap of the slot it ended in (it was
    /// dropped before: the replay of a recording found 32 of 36 gaps).
    #[test]
    fn a_gap_that_began_before_the_slots_is_the_slot_it_ended_in() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let mut n = namer(HashMap::new());
        let marks = [mark(7, 390 * MS), mark(7, 415 * MS), mark(7, 416 * MS)];
        let inp = inputs(&[], &[], &[], &marks, &names);
        let slot = crate::slots::Slot {
            number: 9,
            start_ns: 400 * MS,
            end_ns: 800 * MS,
            leader: false,
            window: None,
            aligned: true,
        };
        let timeline = crate::slots::Timeline::new(vec![slot]);
        let f = detect(&inp, &by_name(), &Buckets::new(Some(&timeline), 400 * MS), &mut n);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(
            (f[0].slot, f[0].start_ns, f[0].duration_ns),
            (Some(9), 390 * MS, 25 * MS)
        );
    }

    #[test]
    fn only_the_loop_threads_madvise_and_futex_time_counts() {
        let names = HashMap::from([(7, "main-loop".to_string()), (8, "other".to_string())]);
        let marks = [mark(7, 0), mark(7, 20 * MS)];
        let madv = [super::super::test_support::madvise(8, 2 * MS, 10 * MS, 4096, 5)];
        let fut = [futex(8, 2 * MS, 10 * MS, 0x10, 5, 0)];
        let inp = Inputs {
            madvise: &madv,
            futex: fut[..].into(),
            loop_marks: &marks,
            ..empty_inputs(&names)
        };
        let mut n = namer(HashMap::new());
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].magnitudes["madvise_ms"], 0.0);
        assert_eq!(f[0].magnitudes["futex_ms"], 0.0);
        assert_ne!(f[0].cause.as_deref(), Some("madvise"));
        // The loop thread's own: counted.
        let madv = [super::super::test_support::madvise(7, 2 * MS, 12 * MS, 4096, 5)];
        let fut = [futex(7, 2 * MS, 3 * MS, 0x10, 5, 0)];
        let inp = Inputs {
            madvise: &madv,
            futex: fut[..].into(),
            ..inp
        };
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].magnitudes["madvise_ms"], 12.0);
        assert_eq!(f[0].magnitudes["futex_ms"], 3.0);
        assert_eq!(f[0].cause.as_deref(), Some("madvise"));
    }

    #[test]
    fn a_wakeup_at_the_intervals_start_is_no_wakeup() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 0), mark(7, 10 * MS)];
        // woken_ns equal to the start (not set after it): all of it blocked.
        let intervals = [Interval {
            woken_ns: MS,
            ..interval(7, MS, 9 * MS, 2, 102)
        }];
        let inp = inputs(&[], &intervals, &[], &marks, &names);
        let mut n = namer(HashMap::from([(102, vec!["do_nanosleep"])]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("sleep"));
        assert_eq!(f[0].magnitudes["runqueue_ms"], 0.0);
        assert_eq!(f[0].magnitudes["blocked_ms"], 8.0);
    }

    #[test]
    fn the_stack_shown_is_the_longest_blocks_and_the_first_of_equals() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 0), mark(7, 30 * MS)];
        let stacks = HashMap::from([
            (1, vec!["main", "short_sleep"]),
            (2, vec!["main", "long_sleep"]),
            (3, vec!["main", "later_equal_sleep"]),
            (102, vec!["do_nanosleep"]),
        ]);
        let intervals = [
            interval(7, MS, 4 * MS, 1, 102),
            interval(7, 5 * MS, 15 * MS, 2, 102),
            interval(7, 16 * MS, 26 * MS, 3, 102),
        ];
        let inp = inputs(&[], &intervals, &[], &marks, &names);
        let mut n = namer(stacks);
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("sleep"));
        assert!(f[0].stack.contains(&"long_sleep".to_string()), "{:?}", f[0].stack);
    }

    #[test]
    fn short_waits_needs_two_sample_periods_without_a_sample_in_the_gap() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 10 * MS), mark(7, 16 * MS)];
        let config = DetectorConfig {
            sample_period_ns: 2 * MS,
            ..DetectorConfig::default()
        };
        // 2.5 ms asleep, 3.5 ms unaccounted: less than two periods (4 ms),
        // so it stays on-CPU.
        let intervals = [interval(7, 10 * MS, 12 * MS + MS / 2, 2, 102)];
        let mut n = namer(HashMap::from([(102, vec!["do_nanosleep"])]));
        let inp = inputs(&[], &intervals, &[], &marks, &names);
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("on-CPU"));
        // Samples outside the gap (before it, and at its very end) do not
        // count as in it: 6 ms with none is short waits.
        let samples = [
            (9 * MS, key(7, "main-loop", 3, -14)),
            (16 * MS, key(7, "main-loop", 3, -14)),
        ];
        let inp = inputs(&samples, &[], &[], &marks, &names);
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some(SHORT_WAITS));
        assert_eq!(f[0].magnitudes["samples"], 0.0);
        // One at its very start does.
        let samples = [(10 * MS, key(7, "main-loop", 3, -14))];
        let inp = inputs(&samples, &[], &[], &marks, &names);
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].magnitudes["samples"], 1.0);
        assert_eq!(f[0].cause.as_deref(), Some("on-CPU"));
    }

    #[test]
    fn a_madvise_gap_shows_the_longest_call_in_it() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 10 * MS), mark(7, 20 * MS)];
        let m = super::super::test_support::madvise;
        let madv = [
            // Longer, but outside the gap.
            m(7, 0, 9 * MS, 4096, 1),
            // In the gap: the longest, then a shorter later one.
            m(7, 10 * MS, 5 * MS, 4096, 2),
            m(7, 16 * MS, 3 * MS, 4096, 3),
        ];
        let stacks = HashMap::from([
            (1, vec!["main", "outside"]),
            (2, vec!["main", "purge_long"]),
            (3, vec!["main", "purge_later"]),
        ]);
        let inp = inputs(&[], &[], &madv, &marks, &names);
        let mut n = namer(stacks);
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("madvise"));
        assert_eq!(f[0].stack, frames(&["main", "purge_long"]));
    }

    #[test]
    fn an_on_cpu_gap_shows_its_most_sampled_stack_preferring_whole_ones() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 10 * MS), mark(7, 30 * MS)];
        let config = DetectorConfig {
            sample_period_ns: MS,
            ..DetectorConfig::default()
        };
        let stacks = HashMap::from([
            (1, vec!["main", "a_most_sampled"]),
            (2, vec!["main", "z_sampled_once"]),
            (3, vec!["main", "z_outside"]),
            (4, vec!["start", "main", "whole"]),
        ]);
        let k = |u| key(7, "main-loop", u, -14);
        let mut samples: Vec<_> = (0..5).map(|i| (11 * MS + i * MS, k(1))).collect();
        samples.push((20 * MS, k(2)));
        // Many outside the gap, before it and at its end.
        samples.extend((0..8).map(|_| (5 * MS, k(3))));
        samples.extend((0..8).map(|_| (30 * MS, k(3))));
        let inp = inputs(&samples, &[], &[], &marks, &names);
        let mut n = namer(stacks.clone());
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].cause.as_deref(), Some("on-CPU"));
        assert_eq!(f[0].stack, frames(&["main", "a_most_sampled"]));
        // A stack walked to the thread's root wins over shallower ones,
        // even sampled once.
        samples.push((21 * MS, k(4)));
        let inp = inputs(&samples, &[], &[], &marks, &names);
        let mut n = namer(stacks);
        let f = detect(&inp, &config, &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].stack, frames(&["start", "main", "whole"]));
    }

    #[test]
    fn the_explanation_lists_only_the_other_causes_that_took_time() {
        let names = HashMap::from([(7, "main-loop".to_string())]);
        let marks = [mark(7, 0), mark(7, 20 * MS)];
        let intervals = [Interval {
            woken_ns: 18 * MS,
            ..interval(7, 0, 20 * MS, 2, 102)
        }];
        let inp = inputs(&[], &intervals, &[], &marks, &names);
        let mut n = namer(HashMap::from([(102, vec!["do_nanosleep"])]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        let e = &f[0].explanation;
        assert!(
            e.contains("mostly sleep (18.0 ms); then waiting for a CPU 2.0 ms"),
            "{e}"
        );
        assert!(!e.contains("madvise") && !e.contains("on-CPU"), "{e}");
        // Nothing else: no "then".
        let intervals = [interval(7, 0, 20 * MS, 2, 102)];
        let inp = inputs(&[], &intervals, &[], &marks, &names);
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert!(!f[0].explanation.contains("then"), "{}", f[0].explanation);
    }
}
