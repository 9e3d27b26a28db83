//! `MemoryPressure`: time a thread of the target lost to the kernel's
//! memory management, per slot: direct reclaim, its cgroup's reclaim
//! (over memory.high or the limit) and direct compaction, timed by their
//! tracepoints (any thread); and, for hot threads (the loop thread,
//! `--hot-thread`), off-CPU waits whose kernel stack is a page fault
//! waiting for its page (a file page read in, a swap-in) or memory.high's
//! throttling sleep. The second reference paper's point: validators short
//! of RAM fall behind on page faults and reclaim.
//!
//! Not here: kswapd's and kcompactd's own work (their CPU time shows as
//! CpuContention when it takes a hot thread's core), and faults shorter
//! than `--min-offcpu` (the fault tracepoint has no duration).

use std::collections::{BTreeMap, HashMap};

use profiler_ebpf::mem_stall;

use super::{ms, Buckets, DetectorConfig, Finding, FindingKind, Inputs, NameStack};
use crate::records::Interval;

/// Where the time went, in the order causes are named when equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Part {
    CgroupReclaim,
    DirectReclaim,
    DirectCompaction,
    Throttle,
    FileFault,
    SwapIn,
}

impl Part {
    const ALL: [Part; 6] = [
        Part::CgroupReclaim,
        Part::DirectReclaim,
        Part::DirectCompaction,
        Part::Throttle,
        Part::FileFault,
        Part::SwapIn,
    ];

    fn of_stall(what: u32) -> Option<Part> {
        match what {
            mem_stall::DIRECT_RECLAIM => Some(Part::DirectReclaim),
            mem_stall::CGROUP_RECLAIM => Some(Part::CgroupReclaim),
            mem_stall::DIRECT_COMPACTION => Some(Part::DirectCompaction),
            _ => None,
        }
    }

    /// A hot thread's off-CPU wait by its kernel stack (root first);
    /// None when it is not a memory wait, or is one the tracepoints time
    /// already (inside reclaim or compaction).
    fn of_wait(frames: &[String]) -> Option<Part> {
        let has = |p: &str| frames.iter().any(|f| f.contains(p));
        if has("try_to_free_pages")
            || has("try_to_free_mem_cgroup_pages")
            || has("compact_zone")
            || has("try_to_compact_pages")
        {
            return None;
        }
        if has("mem_cgroup_handle_over_high") {
            return Some(Part::Throttle);
        }
        if !(has("exc_page_fault") || has("handle_mm_fault")) {
            return None;
        }
        if has("do_swap_page") || has("swap_read") || has("swapin") {
            Some(Part::SwapIn)
        } else if has("filemap_fault") || has("folio_wait") || has("__folio_lock") {
            Some(Part::FileFault)
        } else {
            None
        }
    }

    fn label(self) -> &'static str {
        match self {
            Part::CgroupReclaim => "cgroup reclaim",
            Part::DirectReclaim => "direct reclaim",
            Part::DirectCompaction => "direct compaction",
            Part::Throttle => "memory.high throttling",
            Part::FileFault => "file page faults",
            Part::SwapIn => "swap-ins",
        }
    }

    fn magnitude(self) -> &'static str {
        match self {
            Part::CgroupReclaim => "cgroup_reclaim_ms",
            Part::DirectReclaim => "direct_reclaim_ms",
            Part::DirectCompaction => "direct_compaction_ms",
            Part::Throttle => "throttle_ms",
            Part::FileFault => "file_fault_ms",
            Part::SwapIn => "swap_in_ms",
        }
    }

    fn advice(self) -> &'static str {
        match self {
            Part::CgroupReclaim | Part::Throttle => {
                "the process is over its cgroup's memory.high or limit: raise it (systemd MemoryHigh=/MemoryMax=) \
                 or give the node more RAM; validators below ~256 GB fall behind on reclaim and faults"
            }
            Part::DirectReclaim => {
                "the machine ran out of free memory and the allocating thread reclaimed it itself: add RAM, \
                 raise vm.min_free_kbytes / vm.watermark_scale_factor so kswapd starts earlier, and keep page \
                 cache (accounts, snapshots) from filling memory"
            }
            Part::DirectCompaction => {
                "a higher-order allocation compacted memory in the thread's own context: use 4 KiB pages where \
                 huge ones are not needed (transparent_hugepage=madvise, defrag=defer+madvise) and keep free \
                 memory up"
            }
            Part::FileFault => {
                "pages of mapped files (accounts, the ledger) were read back in on access: the working set does \
                 not fit in RAM; add RAM or move the accounts off mmap'd files onto faster storage"
            }
            Part::SwapIn => {
                "the thread waited for swapped-out memory: a validator should not swap (swapoff, or \
                 vm.swappiness=0 and memory.swap.max=0 for its cgroup)"
            }
        }
    }
}

#[derive(Default)]
struct Acc {
    slot: Option<u64>,
    first_ns: u64,
    ns: HashMap<Part, u64>,
    events: u64,
    reclaimed: u64,
    comm: String,
    /// The longest page/throttle wait (for its stack).
    longest: Option<Interval>,
    longest_ns: u64,
}

impl Acc {
    fn add(&mut self, slot: Option<u64>, from: u64, part: Part, ns: u64) {
        if self.events == 0 || from < self.first_ns {
            self.first_ns = from;
        }
        self.slot = slot;
        self.events += 1;
        *self.ns.entry(part).or_default() += ns;
    }

    fn total(&self) -> u64 {
        self.ns.values().sum()
    }
}

pub fn detect(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let mut acc: BTreeMap<(u64, u32), Acc> = BTreeMap::new();
    for m in inputs.mem_stalls.iter().filter(|m| m.tgid == inputs.pid) {
        let (Some(part), Some((slot, bucket))) = (Part::of_stall(m.what), buckets.of(m.start_ns)) else {
            continue;
        };
        let a = acc.entry((bucket, m.tid)).or_default();
        a.add(slot, m.start_ns, part, m.end_ns.saturating_sub(m.start_ns));
        a.reclaimed += m.nr_reclaimed;
        if a.comm.is_empty() {
            a.comm = crate::kernel::events::comm_str(&m.comm);
        }
    }
    let hot = inputs.hot_tids(config);
    let mut by_stack: HashMap<(u32, i32), Option<Part>> = HashMap::new();
    for i in inputs.intervals.iter().filter(|i| hot.contains(&i.key.tid)) {
        let part = *by_stack
            .entry((i.key.tgid, i.key.kernel_stack_id))
            .or_insert_with(|| Part::of_wait(&names(i.key.tgid, i.key.kernel_stack_id, true)));
        let (Some(part), Some((slot, bucket))) = (part, buckets.of(i.start_ns)) else {
            continue;
        };
        let ns = i.offcpu_ns();
        let a = acc.entry((bucket, i.key.tid)).or_default();
        a.add(slot, i.start_ns, part, ns);
        if ns > a.longest_ns {
            a.longest_ns = ns;
            a.longest = Some(*i);
        }
    }
    acc.into_iter()
        .filter(|(_, a)| a.total() >= config.memory_stall_threshold_ns)
        .map(|((_, tid), a)| finding(inputs, tid, a, names))
        .collect()
}

fn finding(inputs: &Inputs, tid: u32, a: Acc, names: &mut NameStack) -> Finding {
    let total = a.total();
    let top = Part::ALL
        .into_iter()
        .max_by_key(|p| (a.ns.get(p).copied().unwrap_or(0), std::cmp::Reverse(*p)))
        .unwrap_or(Part::DirectReclaim);
    let mut magnitudes = BTreeMap::from([
        ("stall_ms", ms(total)),
        ("events", a.events as f64),
        ("pages_reclaimed", a.reclaimed as f64),
    ]);
    let mut parts = Vec::new();
    for p in Part::ALL {
        if let Some(&ns) = a.ns.get(&p).filter(|ns| **ns > 0) {
            magnitudes.insert(p.magnitude(), ms(ns));
            parts.push(format!("{} {:.1} ms", p.label(), ms(ns)));
        }
    }
    let thread = inputs.thread_name_or(tid, &a.comm);
    let stack = a
        .longest
        .map(|i| super::interval_stack(&i, names))
        .unwrap_or_default();
    Finding {
        kind: FindingKind::MemoryPressure,
        slot: a.slot,
        pid: inputs.pid,
        tid,
        thread: thread.clone(),
        start_ns: a.first_ns,
        duration_ns: total,
        magnitudes,
        cause: Some(top.label().to_string()),
        stack,
        waker_stack: Vec::new(),
        ran_instead: Vec::new(),
        explanation: format!(
            "{thread} lost {:.1} ms to memory pressure in {} stalls: {}",
            ms(total),
            a.events,
            parts.join(", ")
        ),
        advice: top.advice().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::detectors::LoopThread;
    use profiler_ebpf::{EventKind, MemStall};

    const MS: u64 = 1_000_000;

    fn stall(tid: u32, start: u64, dur: u64, what: u32, pages: u64) -> MemStall {
        MemStall {
            kind: EventKind::MemStall as u32,
            cpu: 0,
            start_ns: start,
            end_ns: start + dur,
            tgid: 1,
            tid,
            what,
            _pad: 0,
            nr_reclaimed: pages,
            comm: comm("worker"),
        }
    }

    fn wait(tid: u32, start: u64, dur: u64, kernel: i32) -> Interval {
        Interval {
            start_ns: start,
            end_ns: start + dur,
            key: key(tid, "hot", 1, kernel),
            preempted: false,
            woken_ns: 0,
            ran: Default::default(),
            folded: None,
        }
    }

    fn run(stalls: &[MemStall], intervals: &[Interval], buckets: &Buckets) -> Vec<Finding> {
        let names = HashMap::from([(2, "hot".to_string()), (3, "worker".to_string())]);
        let inp = Inputs {
            mem_stalls: stalls,
            intervals,
            ..empty_inputs(&names)
        };
        let config = DetectorConfig {
            loop_thread: Some(LoopThread::Name("hot".into())),
            ..DetectorConfig::default()
        };
        let mut n = namer(HashMap::from([
            (1, vec!["main", "hot_loop"]),
            (
                100,
                vec![
                    "asm_exc_page_fault",
                    "handle_mm_fault",
                    "filemap_fault",
                    "folio_wait_bit_common",
                ],
            ),
            (
                101,
                vec![
                    "exit_to_user_mode_loop",
                    "mem_cgroup_handle_over_high",
                    "schedule_timeout",
                ],
            ),
            (
                102,
                vec![
                    "asm_exc_page_fault",
                    "handle_mm_fault",
                    "try_to_free_mem_cgroup_pages",
                    "io_schedule",
                ],
            ),
            (103, vec!["do_syscall_64", "futex_wait"]),
        ]));
        detect(&inp, &config, buckets, &mut n)
    }

    #[test]
    fn reclaim_compaction_faults_and_throttling_are_summed_per_thread_and_slot() {
        let stalls = [
            stall(3, 10 * MS, 4 * MS, mem_stall::CGROUP_RECLAIM, 300),
            stall(3, 20 * MS, 3 * MS, mem_stall::DIRECT_COMPACTION, 0),
            // Another process's stall is not the target's.
            MemStall {
                tgid: 9,
                ..stall(3, 30 * MS, 50 * MS, mem_stall::DIRECT_RECLAIM, 1)
            },
        ];
        let iv = [
            wait(2, 40 * MS, 6 * MS, 100),
            wait(2, 50 * MS, 2 * MS, 101),
            // Inside reclaim: timed by the tracepoints, not again here.
            wait(2, 60 * MS, 9 * MS, 102),
            // Not a memory wait.
            wait(2, 70 * MS, 30 * MS, 103),
        ];
        let f = run(&stalls, &iv, &Buckets::new(None, 0));
        assert_eq!(f.len(), 2, "{f:?}");
        let w = f.iter().find(|f| f.tid == 3).unwrap();
        assert_eq!(w.kind, FindingKind::MemoryPressure);
        assert_eq!(w.magnitudes["stall_ms"], 7.0);
        assert_eq!(w.magnitudes["cgroup_reclaim_ms"], 4.0);
        assert_eq!(w.magnitudes["direct_compaction_ms"], 3.0);
        assert_eq!(w.magnitudes["pages_reclaimed"], 300.0);
        assert_eq!(w.cause.as_deref(), Some("cgroup reclaim"));
        assert!(w.advice.contains("memory.high"), "{}", w.advice);
        let h = f.iter().find(|f| f.tid == 2).unwrap();
        assert_eq!(h.magnitudes["stall_ms"], 8.0);
        assert_eq!(h.magnitudes["file_fault_ms"], 6.0);
        assert_eq!(h.magnitudes["throttle_ms"], 2.0);
        assert_eq!(h.cause.as_deref(), Some("file page faults"));
        assert_eq!(h.stack.last().map(String::as_str), Some("folio_wait_bit_common"));
        assert!(
            h.explanation.contains("file page faults 6.0 ms"),
            "{}",
            h.explanation
        );
    }

    #[test]
    fn under_the_threshold_or_on_a_thread_that_is_not_hot_nothing_is_found() {
        let stalls = [stall(3, 10 * MS, 4 * MS, mem_stall::DIRECT_RECLAIM, 10)];
        // A fault wait of a thread that is not hot.
        let iv = [wait(3, 40 * MS, 60 * MS, 100)];
        assert!(run(&stalls, &iv, &Buckets::new(None, 0)).is_empty());
        // Split across two slots, 3 + 3 ms: under 5 ms in each.
        let t = crate::slots::Timeline::clock(std::time::Duration::from_millis(100), 0, None, 0, 400 * MS);
        let stalls = [
            stall(3, 90 * MS, 3 * MS, mem_stall::DIRECT_RECLAIM, 1),
            stall(3, 110 * MS, 3 * MS, mem_stall::DIRECT_RECLAIM, 1),
        ];
        assert!(run(&stalls, &[], &Buckets::new(Some(&t), 0)).is_empty());
    }
}
