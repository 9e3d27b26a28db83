//! `CpuContention`: a hot thread (the loop thread, `--hot-thread`) that was
//! runnable but had no CPU, per slot, and who had the CPU instead.
//!
//! The measurement is bcc's runqlat/runqslower's: from the wakeup (or the
//! preemption) of the thread to its switch-in, read from its off-CPU
//! intervals ([`Interval::runnable_ns`]), so only waits inside an interval
//! of at least `--min-offcpu` are seen. Who had the CPU is the task whose
//! run on that CPU overlapped the wait the most (the kernel logs each CPU's
//! last runs; runqslower names only the task it took the CPU back from,
//! which after a long wait is often a kworker that ran for a moment): a
//! kernel thread (kcompactd, ksoftirqd, a kworker), another process, or a
//! thread of the target's own. A wait the idle task had the CPU for had no
//! one taking the CPU: it is the wakeup's way to a sleeping CPU (an IPI and
//! a C-state exit; on a VM the host running the vCPU again) and is not
//! counted (the kernel's own run_delay starts later, at the enqueue), only
//! shown beside a finding as `idle_wakeup_ms`.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::{ms, Buckets, DetectorConfig, Finding, FindingKind, Inputs, NameStack};
use crate::records::{Interval, Runner};

/// What kind of task had the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunnerClass {
    /// A kernel thread.
    KernelThread,
    /// A process other than the target.
    OtherProcess,
    /// A thread of the target.
    SameProcess,
}

impl RunnerClass {
    /// The class of the task that had the CPU; `None` for the idle task (the
    /// CPU was free, the thread was just not on it yet: not contention, see
    /// the module's comment).
    pub fn of(r: &Runner, pid: u32) -> Option<Self> {
        if r.tid == 0 {
            None
        } else if r.kthread {
            Some(RunnerClass::KernelThread)
        } else if r.tgid == pid {
            Some(RunnerClass::SameProcess)
        } else {
            Some(RunnerClass::OtherProcess)
        }
    }

    fn label(self) -> &'static str {
        match self {
            RunnerClass::KernelThread => "a kernel thread",
            RunnerClass::OtherProcess => "another process",
            RunnerClass::SameProcess => "the process's own threads",
        }
    }

    fn magnitude(self) -> &'static str {
        match self {
            RunnerClass::KernelThread => "kernel_thread_ms",
            RunnerClass::OtherProcess => "other_process_ms",
            RunnerClass::SameProcess => "same_process_ms",
        }
    }

    fn advice(self, top: &str) -> String {
        match self {
            RunnerClass::KernelThread if top.starts_with("kcompactd") => {
                "kcompactd (memory compaction) took the core: lower vm.compaction_proactiveness, \
                 or keep the hot threads off the cores kcompactd runs on"
                    .into()
            }
            RunnerClass::KernelThread if top.starts_with("ksoftirqd") => {
                "softirq work (network, timers) took the core: move device interrupts (IRQ \
                 affinity, RPS) off the hot threads' cores"
                    .into()
            }
            RunnerClass::KernelThread => format!(
                "the kernel thread {top} took the core: keep kernel work off the hot threads' cores \
                 (isolcpus/nohz_full, workqueue cpumask, IRQ affinity)"
            ),
            RunnerClass::OtherProcess => format!(
                "another process ({top}) ran on the hot thread's core: give the validator cores of \
                 its own (cpuset/systemd AllowedCPUs=) and move other work off them"
            ),
            RunnerClass::SameProcess => format!(
                "the process's own thread {top} ran instead: more busy threads than cores; pin the \
                 hot thread to a core of its own (e.g. --poh-pinned-cpu-core) or cap the thread pools"
            ),
        }
    }
}

/// One task that had the CPU while a hot thread waited for it.
#[derive(Clone, Debug, Serialize)]
pub struct RanInstead {
    pub comm: String,
    pub pid: u32,
    pub tid: u32,
    pub class: RunnerClass,
    /// The hot thread's waits that ended with this task leaving the CPU.
    pub waits: u64,
    pub ms: f64,
}

#[derive(Default)]
struct Acc {
    slot: Option<u64>,
    first_ns: u64,
    waits: u64,
    ns: u64,
    longest_ns: u64,
    /// The stack of the longest wait.
    longest: Option<Interval>,
    by_runner: HashMap<Runner, (u64, u64)>,
    /// Waits that ended on an idle CPU (not contention).
    idle_ns: u64,
}

pub fn detect(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let hot = inputs.hot_tids(config);
    let mut acc: BTreeMap<(u64, u32), Acc> = BTreeMap::new();
    for i in inputs.intervals.iter().filter(|i| hot.contains(&i.key.tid)) {
        let ns = i.runnable_ns();
        if ns == 0 {
            continue;
        }
        let from = i.end_ns - ns;
        let Some((slot, bucket)) = buckets.of(from) else {
            continue;
        };
        let a = acc.entry((bucket, i.key.tid)).or_default();
        a.slot = slot;
        if RunnerClass::of(&i.ran, inputs.pid).is_none() {
            a.idle_ns += ns;
            continue;
        }
        if a.waits == 0 || from < a.first_ns {
            a.first_ns = from;
        }
        a.waits += 1;
        a.ns += ns;
        if ns > a.longest_ns {
            a.longest_ns = ns;
            a.longest = Some(*i);
        }
        let r = a.by_runner.entry(i.ran).or_default();
        r.0 += 1;
        r.1 += ns;
    }
    let mut findings = Vec::new();
    for ((_, tid), a) in acc {
        if a.ns < config.cpu_wait_threshold_ns {
            continue;
        }
        findings.push(finding(inputs, tid, a, names));
    }
    findings
}

fn finding(inputs: &Inputs, tid: u32, a: Acc, names: &mut NameStack) -> Finding {
    // Idle-CPU waits never reach `by_runner` (`detect` counts them apart).
    let classed = || {
        a.by_runner
            .iter()
            .filter_map(|(r, v)| Some((r, RunnerClass::of(r, inputs.pid)?, v)))
    };
    let mut ran: Vec<RanInstead> = classed()
        .map(|(r, class, &(waits, ns))| RanInstead {
            comm: crate::kernel::events::comm_str(&r.comm),
            pid: r.tgid,
            tid: r.tid,
            class,
            waits,
            ms: ms(ns),
        })
        .collect();
    ran.sort_by(|x, y| y.ms.total_cmp(&x.ms).then(x.tid.cmp(&y.tid)));
    let mut by_class: BTreeMap<RunnerClass, u64> = BTreeMap::new();
    for (_, class, &(_, ns)) in classed() {
        *by_class.entry(class).or_default() += ns;
    }
    // A finding has at least one counted wait, so at least one class.
    let top_class = by_class
        .iter()
        .max_by_key(|(c, ns)| (**ns, std::cmp::Reverse(**c)))
        .map(|(c, _)| *c)
        .unwrap_or(RunnerClass::OtherProcess);
    let top = ran
        .iter()
        .find(|r| r.class == top_class)
        .map(|r| format!("{} (pid {})", r.comm, r.pid))
        .unwrap_or_default();
    let mut magnitudes = BTreeMap::from([
        ("wait_ms", ms(a.ns)),
        ("waits", a.waits as f64),
        ("longest_ms", ms(a.longest_ns)),
    ]);
    for (c, ns) in &by_class {
        magnitudes.insert(c.magnitude(), ms(*ns));
    }
    if a.idle_ns > 0 {
        magnitudes.insert("idle_wakeup_ms", ms(a.idle_ns));
    }
    let thread = inputs.thread_name(tid);
    let who: Vec<String> = ran
        .iter()
        .take(3)
        .map(|r| format!("{} (pid {}, {}) {:.1} ms", r.comm, r.pid, r.class.label(), r.ms))
        .collect();
    let stack = a
        .longest
        .map(|i| super::interval_stack(&i, names))
        .unwrap_or_default();
    Finding {
        kind: FindingKind::CpuContention,
        slot: a.slot,
        pid: inputs.pid,
        tid,
        thread: thread.clone(),
        start_ns: a.first_ns,
        duration_ns: a.ns,
        magnitudes,
        cause: Some(top_class.label().to_string()),
        stack,
        waker_stack: Vec::new(),
        ran_instead: ran,
        explanation: format!(
            "{thread} was runnable but had no CPU for {:.1} ms in {} waits (longest {:.1} ms); \
             the CPU went to {}",
            ms(a.ns),
            a.waits,
            ms(a.longest_ns),
            who.join(", ")
        ),
        advice: top_class.advice(&top),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::detectors::LoopThread;

    const MS: u64 = 1_000_000;

    fn runner(tid: u32, tgid: u32, name: &str, kthread: bool) -> Runner {
        Runner {
            tid,
            tgid,
            comm: comm(name),
            kthread,
        }
    }

    /// An interval of `tid`: blocked from `start`, woken at `woken`,
    /// running again at `end` (preempted: `woken` 0 and runnable all along).
    fn wait(tid: u32, start: u64, woken: u64, end: u64, preempted: bool, ran: Runner) -> Interval {
        Interval {
            start_ns: start,
            end_ns: end,
            key: key(tid, "hot", 1, 100),
            preempted,
            woken_ns: woken,
            ran,
            folded: None,
        }
    }

    fn config() -> DetectorConfig {
        DetectorConfig {
            loop_thread: Some(LoopThread::Name("hot".into())),
            hot_threads: vec!["worker".into()],
            ..DetectorConfig::default()
        }
    }

    fn names() -> HashMap<u32, String> {
        HashMap::from([(2, "hot".into()), (3, "worker".into()), (4, "idle-pool".into())])
    }

    fn run(intervals: &[Interval], buckets: &Buckets) -> Vec<Finding> {
        let names = names();
        let inp = Inputs {
            intervals,
            ..empty_inputs(&names)
        };
        let mut n = namer(HashMap::from([
            (1, vec!["main", "hot_loop"]),
            (100, vec!["schedule"]),
        ]));
        detect(&inp, &config(), buckets, &mut n)
    }

    #[test]
    fn a_hot_thread_preempted_by_another_process_is_found_with_who_ran() {
        let hog = runner(900, 900, "hog", false);
        // Preempted 30 ms at 100 ms, then woken and waiting 4 ms for the
        // same hog, then 2 ms for kcompactd.
        let iv = [
            wait(2, 100 * MS, 0, 130 * MS, true, hog),
            wait(2, 200 * MS, 201 * MS, 205 * MS, false, hog),
            wait(
                2,
                300 * MS,
                310 * MS,
                312 * MS,
                false,
                runner(40, 40, "kcompactd0", true),
            ),
        ];
        let f = run(&iv, &Buckets::new(None, 0));
        assert_eq!(f.len(), 1, "{f:?}");
        let f = &f[0];
        assert_eq!(f.kind, FindingKind::CpuContention);
        assert_eq!((f.tid, f.thread.as_str()), (2, "hot"));
        assert_eq!(f.start_ns, 100 * MS);
        assert_eq!(f.duration_ns, 36 * MS);
        assert_eq!(f.magnitudes["wait_ms"], 36.0);
        assert_eq!(f.magnitudes["waits"], 3.0);
        assert_eq!(f.magnitudes["longest_ms"], 30.0);
        assert_eq!(f.magnitudes["other_process_ms"], 34.0);
        assert_eq!(f.magnitudes["kernel_thread_ms"], 2.0);
        assert_eq!(f.cause.as_deref(), Some("another process"));
        assert_eq!(f.ran_instead[0].comm, "hog");
        assert_eq!((f.ran_instead[0].pid, f.ran_instead[0].waits), (900, 2));
        assert_eq!(f.ran_instead[1].class, RunnerClass::KernelThread);
        assert_eq!(f.stack, ["main", "hot_loop", "schedule"]);
        assert!(
            f.explanation.contains("hog (pid 900, another process) 34.0 ms"),
            "{}",
            f.explanation
        );
        assert!(f.advice.contains("cpuset"), "{}", f.advice);
    }

    #[test]
    fn waits_are_judged_per_slot_and_thread_against_the_threshold() {
        let hog = runner(900, 900, "hog", false);
        // Slots of 100 ms: 3 ms + 3 ms in slot 0 (6 ms: found), 4 ms in
        // slot 1 (under 5 ms), 6 ms of the worker in slot 1 (found).
        let iv = [
            wait(2, 10 * MS, 0, 13 * MS, true, hog),
            wait(2, 50 * MS, 0, 53 * MS, true, hog),
            wait(2, 150 * MS, 0, 154 * MS, true, hog),
            wait(3, 160 * MS, 0, 166 * MS, true, runner(2, 1, "hot", false)),
        ];
        let t = crate::slots::Timeline::clock(std::time::Duration::from_millis(100), 0, None, 0, 400 * MS);
        let f = run(&iv, &Buckets::new(Some(&t), 0));
        let got: Vec<_> = f
            .iter()
            .map(|f| (f.slot, f.tid, f.magnitudes["wait_ms"]))
            .collect();
        assert_eq!(got, [(Some(0), 2, 6.0), (Some(1), 3, 6.0)], "{f:?}");
        assert_eq!(f[1].cause.as_deref(), Some("the process's own threads"));
    }

    #[test]
    fn threads_that_are_not_hot_and_blocked_time_do_not_count() {
        let hog = runner(900, 900, "hog", false);
        let iv = [
            // A thread no one called hot, waiting 50 ms.
            wait(4, 0, 0, 50 * MS, true, hog),
            // The hot thread blocked 50 ms, runnable only its last 1 ms.
            wait(2, 100 * MS, 149 * MS, 150 * MS, false, hog),
            // Blocked, its wakeup not seen: no runnable time known.
            wait(2, 200 * MS, 0, 260 * MS, false, hog),
        ];
        assert!(run(&iv, &Buckets::new(None, 0)).is_empty());
    }

    #[test]
    fn a_wait_that_ends_on_an_idle_cpu_is_no_contention_and_a_kernel_thread_gets_its_advice() {
        // 9 ms until the idle CPU ran it: the wakeup's way, no one took the CPU.
        let iv = [wait(2, 0, 1, 9 * MS, false, Runner::default())];
        assert!(run(&iv, &Buckets::new(None, 0)).is_empty());
        // Shown beside a finding that has contention.
        let iv = [
            wait(2, 0, 1, 9 * MS, false, Runner::default()),
            wait(2, 20 * MS, 0, 29 * MS, true, runner(12, 12, "ksoftirqd/0", true)),
        ];
        let f = run(&iv, &Buckets::new(None, 0));
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].magnitudes["wait_ms"], 9.0);
        assert_eq!(f[0].magnitudes["idle_wakeup_ms"], 9.0);
        assert_eq!(f[0].start_ns, 20 * MS);
        assert_eq!(f[0].ran_instead.len(), 1);
        assert_eq!(f[0].cause.as_deref(), Some("a kernel thread"));
        assert!(f[0].advice.contains("IRQ affinity"), "{}", f[0].advice);
    }
}
