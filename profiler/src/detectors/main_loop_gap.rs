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
    // User page faults between the marks that open and close a gap.
    let faults_in = |a: u64| -> u64 {
        marks
            .windows(2)
            .find(|w| w[0].0 == a)
            .map_or(0, |w| w[1].1.saturating_sub(w[0].1))
    };
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
        let Some((slot, _)) = buckets.of(a) else { continue };
        let gap = b - a;
        let mut runqueue = 0;
        let mut blocked: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut biggest_block: Option<(u64, &crate::aggregate::Interval)> = None;
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
        let stack = match cause {
            "madvise" => madvise
                .iter()
                .filter(|m| overlap(a, b, m.start_ns, m.end_ns) > 0)
                .max_by_key(|m| m.end_ns - m.start_ns)
                .map(|m| names(m.tgid, m.user_stack_id, false))
                .unwrap_or_default(),
            "on-CPU" | "waiting for a CPU" => {
                let mut counts: HashMap<(i32, i32), u64> = HashMap::new();
                for (ts, k) in &samples {
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
                        let mut f = names(inputs.pid, u, false);
                        let user_depth = f.len();
                        f.extend(names(inputs.pid, k, true));
                        (c + if user_depth >= 3 { 1 << 32 } else { 0 }, f)
                    })
                    .collect();
                named.sort();
                named.pop().map(|(_, f)| f).unwrap_or_default()
            }
            _ => match biggest_block {
                Some((_, i)) => {
                    let mut f = names(i.key.tgid, i.key.user_stack_id, false);
                    f.extend(names(i.key.tgid, i.key.kernel_stack_id, true));
                    f
                }
                None => Vec::new(),
            },
        };
        let rest: Vec<String> = parts[1..]
            .iter()
            .filter(|(_, v)| *v > 0)
            .map(|(k, v)| format!("{k} {:.1} ms", ms(*v)))
            .collect();
        let mut magnitudes = BTreeMap::from([
            ("gap_ms", ms(gap)),
            ("oncpu_ms", ms(oncpu)),
            ("blocked_ms", ms(blocked_total)),
            ("runqueue_ms", ms(runqueue)),
            ("madvise_ms", ms(madvise_ns)),
            ("futex_ms", ms(futex_ns)),
            ("threshold_ms", ms(config.gap_threshold_ns)),
        ]);
        magnitudes.insert("page_faults", faults_in(a) as f64);
        magnitudes.insert("samples", samples_in as f64);
        findings.push(Finding {
            kind: "MainLoopGap",
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{aggregate::Interval, detectors::test_support::*};

    const MS: u64 = 1_000_000;

    #[test]
    fn the_unwalked_futex_wait_frame_is_a_lock_wait() {
        let frames = vec![crate::aggregate::syscall_wait_frame(libc::SYS_futex as i32)];
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
        samples: &'a [(u64, crate::aggregate::StackKey)],
        intervals: &'a [Interval],
        madvise: &'a [profiler_ebpf::MadviseCall],
        marks: &'a [profiler_ebpf::LoopMark],
        names: &'a HashMap<u32, String>,
    ) -> Inputs<'a> {
        Inputs {
            pid: 1,
            samples,
            intervals,
            madvise,
            futex: &[],
            loop_marks: marks,
            short_futex: &[],
            thread_names: names,
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
            },
            Interval {
                start_ns: 41 * MS,
                end_ns: 51 * MS,
                key: key(7, "main-loop", 2, 102),
                preempted: false,
                woken_ns: 0,
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
            },
            Interval {
                start_ns: 10 * MS,
                end_ns: 18 * MS,
                key: key(7, "main-loop", 2, 102),
                preempted: true,
                woken_ns: 0,
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
}
