//! `LockContention`: the futex addresses the target's threads waited on
//! most, per slot, with the waiting stack and, when known, who woke the
//! waiters and from where.
//!
//! A thread waiting for work (a channel receive, a condition variable, a
//! parked thread) also waits on a futex, but that is idleness, not
//! contention: such waits (known by their stack, or by a timeout that ran
//! out) count only when the waiter is a hot thread (the main loop,
//! `--hot-thread`), whose every wait is lost time.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{ms, Buckets, DetectorConfig, Finding, Inputs, NameStack};

#[derive(Default)]
struct Acc {
    waits: u64,
    ns: u64,
    first_ns: u64,
    waiters: BTreeSet<u32>,
    /// (tid, user stack) -> ns.
    waiter_stacks: HashMap<(u32, i32), u64>,
    /// waker (tid, user stack) -> wakeups.
    wakers: HashMap<(u32, i32), u64>,
    waker_names: BTreeMap<u32, String>,
    slot: Option<u64>,
}

/// Frames of a wait for work rather than for a lock.
pub fn waits_for_work(frames: &[String]) -> bool {
    frames.iter().any(|f| {
        // `__futex_abstimed_wait_common` is glibc's condvar/semaphore wait
        // (its mutexes wait in `__lll_lock_wait`): in a libc built without
        // frame pointers it is often the only frame there is.
        [
            "recv",
            "::park",
            "Condvar",
            "cond_wait",
            "cond_timedwait",
            "Receiver",
            "::wait_timeout",
            "epoll",
            "__futex_abstimed_wait",
        ]
        .iter()
        .any(|p| f.contains(p))
    })
}

pub fn detect(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let hot = inputs.hot_tids(config);
    // (waits for work, stack unknown) per user stack.
    let mut idle_stack: HashMap<i32, (bool, bool)> = HashMap::new();
    // Who waited on each futex in the whole session.
    let mut waiters_of: HashMap<u64, BTreeSet<u32>> = HashMap::new();
    for f in inputs.futex.iter() {
        waiters_of.entry(f.uaddr).or_default().insert(f.tid);
    }
    let mut acc: BTreeMap<(u64, u64), Acc> = BTreeMap::new();
    for f in inputs.futex.iter() {
        let (idle, unknown) = *idle_stack.entry(f.user_stack_id).or_insert_with(|| {
            let frames = names(inputs.pid, f.user_stack_id, false);
            (waits_for_work(&frames), frames.iter().all(|f| f.starts_with('[')))
        });
        // A wait whose stack is unknown (its copy skipped while the ring
        // was busy: a loaded validator) on a futex no other thread ever
        // waited on is a thread waiting on its own parker or event, which
        // is how channels, condvars and pools wait for work; a contended
        // lock has whoever contends it waiting. (On a real node under
        // load: banking and sigverify workers each on their own address,
        // woken by the scheduler and the fetch stage.)
        let private = unknown && waiters_of.get(&f.uaddr).is_some_and(|w| w.len() == 1);
        let idle = idle || private;
        // A wait that ran out its timeout was not for a lock (std's and
        // glibc's mutexes and rwlocks wait without one): it was a timed
        // wait for work or for time (`recv_timeout`, `park_timeout`, a
        // condvar's `wait_timeout`), whatever its stack (often not taken:
        // the copy is skipped while the ring is busy).
        let timed_out = f.ret == -(libc::ETIMEDOUT as i64);
        if (idle || timed_out) && !hot.contains(&f.tid) {
            continue;
        }
        let Some((slot, bucket)) = buckets.of(f.start_ns) else {
            continue;
        };
        let a = acc.entry((bucket, f.uaddr)).or_default();
        let dur = f.end_ns.saturating_sub(f.start_ns);
        // Waits arrive in end order; the finding starts at the earliest.
        if a.waits == 0 || f.start_ns < a.first_ns {
            a.first_ns = f.start_ns;
        }
        a.waits += 1;
        a.ns += dur;
        a.waiters.insert(f.tid);
        *a.waiter_stacks.entry((f.tid, f.user_stack_id)).or_default() += dur;
        // A wakeup from an interrupt (a timeout ran out) names no holder:
        // the "waker" there is whoever was interrupted.
        if f.waker_tid != 0 && crate::records::waker_is_task(f.waker_context) {
            *a.wakers.entry((f.waker_tid, f.waker_user_stack_id)).or_default() += 1;
            a.waker_names
                .insert(f.waker_tid, crate::kernel::events::comm_str(&f.waker_comm));
        }
        a.slot = slot;
    }
    let short: HashMap<u64, (u64, u64)> = inputs
        .short_futex
        .iter()
        .map(|&(a, w, ns)| (a, (w, ns)))
        .collect();
    let mut findings = Vec::new();
    for ((_, uaddr), a) in acc {
        if a.ns < config.lock_threshold_ns {
            continue;
        }
        let ((top_tid, top_stack), _) = a
            .waiter_stacks
            .iter()
            .max_by_key(|(k, ns)| (**ns, **k))
            .map(|(k, v)| (*k, *v))
            .unwrap_or(((0, -1), 0));
        let stack = names(inputs.pid, top_stack, false);
        // The thread that woke the waiters most, and its most frequent
        // known stack: a busy waker's stack is copied only once in
        // WAKER_COPY_EVERY_NS, so most of its wakeups carry none.
        let mut by_tid: BTreeMap<u32, u64> = BTreeMap::new();
        for (&(t, _), &n) in &a.wakers {
            *by_tid.entry(t).or_default() += n;
        }
        let top_waker = by_tid.iter().max_by_key(|(t, n)| (**n, **t)).map(|(t, _)| *t);
        let waker_stack = top_waker
            .map(|t| {
                a.wakers
                    .iter()
                    .filter(|((w, _), _)| *w == t)
                    .map(|(&(_, s), &n)| (names(inputs.pid, s, false), n, s))
                    .max_by_key(|(frames, n, s)| (!frames.iter().all(|f| f.starts_with('[')), *n, *s))
                    .map(|(frames, ..)| frames)
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        let wakers: Vec<String> = a.waker_names.iter().map(|(t, n)| format!("{n}/{t}")).collect();
        let (short_waits, short_ns) = short.get(&uaddr).copied().unwrap_or((0, 0));
        let waiter_names: Vec<String> = a.waiters.iter().map(|t| inputs.thread_name(*t)).collect();
        findings.push(Finding {
            kind: crate::detectors::FindingKind::LockContention,
            slot: a.slot,
            pid: inputs.pid,
            tid: top_tid,
            thread: inputs.thread_name(top_tid),
            start_ns: a.first_ns,
            duration_ns: a.ns,
            magnitudes: BTreeMap::from([
                ("address", uaddr as f64),
                ("waits", a.waits as f64),
                ("wait_ms", ms(a.ns)),
                ("waiters", a.waiters.len() as f64),
                ("short_waits_in_session", short_waits as f64),
                ("short_wait_ms_in_session", ms(short_ns)),
            ]),
            cause: None,
            stack,
            waker_stack,
            ran_instead: Vec::new(),
            explanation: format!(
                "{} waited {:.1} ms in {} waits on the futex at {uaddr:#x}{}",
                waiter_names.join(", "),
                ms(a.ns),
                a.waits,
                if wakers.is_empty() {
                    String::new()
                } else {
                    format!("; woken by {}", wakers.join(", "))
                }
            ),
            advice: "shorten what the waker does while it holds the lock, or take the lock off the hot path \
                     (read-mostly data: an RwLock or arc-swap; counters: per-thread); see the waiting and \
                     waking stacks"
                .to_string(),
        });
    }
    findings.sort_by_key(|f| std::cmp::Reverse(f.duration_ns));
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detectors::test_support::*;
    use profiler_ebpf::FutexWait;

    const MS: u64 = 1_000_000;

    fn thread_names(pairs: &[(u32, &str)]) -> HashMap<u32, String> {
        pairs.iter().map(|&(t, n)| (t, n.to_string())).collect()
    }

    /// Inputs of process 1 holding only futex waits.
    fn futex_inputs<'a>(
        waits: &'a [FutexWait],
        short_futex: &'a [(u64, u64, u64)],
        names: &'a HashMap<u32, String>,
    ) -> Inputs<'a> {
        Inputs {
            futex: waits.into(),
            short_futex,
            ..empty_inputs(names)
        }
    }

    #[test]
    fn the_most_waited_lock_comes_first_with_both_stacks() {
        let names = thread_names(&[(1, "main"), (2, "worker"), (3, "holder")]);
        let waits = [
            // A worker idle on a channel for long: not contention.
            futex(4, 0, 300 * MS, 0xdd0, 11, 0),
            futex(1, 0, 10 * MS, 0xaa0, 7, 3),
            futex(2, MS, 8 * MS, 0xaa0, 8, 3),
            futex(1, 50 * MS, 12 * MS, 0xbb0, 9, 0),
            // 4 ms: a real wait, but under the default 10 ms (a healthy
            // validator has these in most slots).
            futex(1, 90 * MS, 4 * MS, 0xcc0, 9, 0),
            // A 100 ms timed wait that ran out, its stack not taken: a
            // wait for work, not for a lock.
            FutexWait {
                ret: -(libc::ETIMEDOUT as i64),
                ..futex(2, 100 * MS, 100 * MS, 0xee0, 12, 0)
            },
        ];
        let inp = futex_inputs(&waits, &[(0xaa0, 100, 5 * MS)], &names);
        let mut n = namer(HashMap::from([
            (7, vec!["main", "wait_for_bank_lock"]),
            (8, vec!["worker", "wait_for_bank_lock"]),
            (9, vec!["main", "wait_for_ledger_lock"]),
            (90, vec!["holder", "hold_bank_lock", "unlock"]),
            (11, vec!["idle-worker", "std::sync::mpmc::list::Channel<T>::recv"]),
            (12, vec!["worker", "[user stack not taken]"]),
        ]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f.len(), 2, "0xcc0 is under the threshold");
        assert_eq!(f[0].magnitudes["address"], 0xaa0 as f64);
        assert_eq!(f[0].magnitudes["waiters"], 2.0);
        assert_eq!(f[0].magnitudes["wait_ms"], 18.0);
        assert_eq!(f[0].magnitudes["short_waits_in_session"], 100.0);
        assert_eq!(f[0].stack, ["main", "wait_for_bank_lock"]);
        assert_eq!(f[0].waker_stack, ["holder", "hold_bank_lock", "unlock"]);
        assert!(
            f[0].explanation.contains("woken by holder/3"),
            "{}",
            f[0].explanation
        );
    }

    #[test]
    fn an_unknown_stack_on_a_futex_only_its_thread_waits_on_is_a_wait_for_work() {
        let names = thread_names(&[(1, "a"), (2, "b"), (3, "sched")]);
        let waits = [
            // Two workers, each parked on its own address, stacks not
            // taken, woken by the scheduler: waits for work.
            futex(1, 0, 80 * MS, 0xa00, 12, 3),
            futex(2, 0, 80 * MS, 0xb00, 12, 3),
            futex(1, 200 * MS, 50 * MS, 0xa00, 12, 3),
            // Both wait on one address, stacks not taken: a lock.
            futex(1, 300 * MS, 20 * MS, 0xc00, 12, 3),
            futex(2, 310 * MS, 20 * MS, 0xc00, 12, 3),
            // One waiter only, but its stack says lock: kept.
            futex(2, 400 * MS, 30 * MS, 0xd00, 8, 3),
        ];
        let inp = futex_inputs(&waits, &[], &names);
        let mut n = namer(HashMap::from([
            (8, vec!["wait_for_bank_lock"]),
            (12, vec!["[user stack not taken]"]),
        ]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        let addrs: Vec<f64> = f.iter().map(|f| f.magnitudes["address"]).collect();
        assert_eq!(addrs, [0xc00 as f64, 0xd00 as f64], "{f:?}");
    }

    #[test]
    fn a_busy_waker_is_named_with_its_known_stack_when_most_of_its_wakeups_carry_none() {
        let names = thread_names(&[(1, "a"), (2, "b"), (3, "holder")]);
        // The holder (3) woke the waiters four times; only one wakeup has
        // its stack (90), the others were sampled out (91: not taken). A
        // second waker (4) woke once, with a stack.
        let sampled_out = |f: FutexWait| FutexWait {
            waker_user_stack_id: 91,
            ..f
        };
        let waits = [
            futex(1, 0, 10 * MS, 0xaa0, 8, 3),
            sampled_out(futex(2, MS, 10 * MS, 0xaa0, 8, 3)),
            sampled_out(futex(1, 20 * MS, 10 * MS, 0xaa0, 8, 3)),
            sampled_out(futex(2, 21 * MS, 10 * MS, 0xaa0, 8, 3)),
            FutexWait {
                waker_user_stack_id: 92,
                ..futex(1, 40 * MS, 10 * MS, 0xaa0, 8, 4)
            },
        ];
        let inp = futex_inputs(&waits, &[], &names);
        let mut n = namer(HashMap::from([
            (8, vec!["wait_for_bank_lock"]),
            (90, vec!["holder", "hold_bank_lock", "unlock"]),
            (91, vec!["[user stack not taken]"]),
            (92, vec!["other", "notify"]),
        ]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].waker_stack, ["holder", "hold_bank_lock", "unlock"]);
    }
    #[test]
    fn the_finding_starts_at_its_earliest_wait_counts_each_wait_and_fires_at_the_threshold() {
        let names = thread_names(&[(1, "a"), (2, "b"), (3, "holder")]);
        // Waits arrive in end order: the later-starting one first. 4 + 6
        // = exactly the 10 ms threshold.
        let waits = [
            futex(1, 5 * MS, 4 * MS, 0xaa0, 8, 3),
            futex(2, 2 * MS, 6 * MS, 0xaa0, 8, 3),
        ];
        let inp = futex_inputs(&waits, &[], &names);
        let mut n = namer(HashMap::from([(8, vec!["wait_for_bank_lock"])]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].start_ns, 2 * MS);
        assert_eq!(f[0].magnitudes["waits"], 2.0);
        assert!(f[0].explanation.contains("in 2 waits"), "{}", f[0].explanation);
        // The same in start order: still the earliest.
        let waits = [waits[1], waits[0]];
        let inp = futex_inputs(&waits, &[], &names);
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f[0].start_ns, 2 * MS);
        // 1 ns under: nothing.
        let waits = [
            futex(1, 5 * MS, 4 * MS, 0xaa0, 8, 3),
            futex(2, 2 * MS, 6 * MS - 1, 0xaa0, 8, 3),
        ];
        let inp = futex_inputs(&waits, &[], &names);
        assert!(detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n).is_empty());
    }

    #[test]
    fn a_wakeup_from_an_interrupt_or_from_no_thread_names_no_waker() {
        let names = thread_names(&[(1, "a"), (2, "b"), (3, "holder"), (5, "interrupted")]);
        let waits = [
            futex(1, 0, 10 * MS, 0xaa0, 8, 3),
            // Woken in a timer interrupt that found thread 5 running.
            FutexWait {
                waker_context: profiler_ebpf::waker::TIMER,
                ..futex(2, 0, 10 * MS, 0xaa0, 8, 5)
            },
            // No waker recorded.
            futex(2, 20 * MS, 10 * MS, 0xaa0, 8, 0),
        ];
        let inp = futex_inputs(&waits, &[], &names);
        let mut n = namer(HashMap::from([(8, vec!["wait_for_bank_lock"])]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        let e = &f[0].explanation;
        assert!(e.contains("woken by holder/3") && !e.contains("/5"), "{e}");
        assert!(!e.contains("/0"), "{e}");
        // A waker in a task context other than a system call (a page
        // fault) is a task: named.
        let waits = [FutexWait {
            waker_context: profiler_ebpf::waker::TASK,
            ..futex(2, 0, 10 * MS, 0xaa0, 8, 5)
        }];
        let inp = futex_inputs(&waits, &[], &names);
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert!(
            f[0].explanation.contains("woken by holder/5"),
            "{}",
            f[0].explanation
        );
    }
}
