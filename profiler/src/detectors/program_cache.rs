//! `ProgramCache`: time a thread of the target spent in the runtime's
//! program cache, per slot: loading programs (parsing their ELF),
//! verifying and JIT-compiling them (what a cache miss costs), and
//! evicting or pruning entries. Each call is timed in the kernel from a
//! uprobe at the function's entry to a uretprobe at its return
//! (`kernel::cache_functions` finds the functions by name, per release).
//! The incident's point: one 5.9 s replay had 4.8 s of program-cache work.
//!
//! The stack shown is the hottest on-CPU sample of the thread inside its
//! longest call (what the compiler or the loader was busy with), when the
//! sampler caught one.

use std::collections::{BTreeMap, HashMap};

use profiler_ebpf::cache_work;

use super::{ms, Buckets, DetectorConfig, Finding, FindingKind, Inputs, NameStack};
use crate::records::StackKey;

/// The kinds of work, as the uprobes' cookies say: their magnitude and
/// what the explanation calls them.
const KINDS: [(u32, &str, &str); 4] = [
    (cache_work::LOAD, "load_ms", "loading"),
    (cache_work::VERIFY, "verify_ms", "verifying"),
    (cache_work::JIT, "jit_ms", "JIT-compiling"),
    (cache_work::EVICT, "evict_ms", "evicting or pruning"),
];

fn kind_name(what: u32) -> Option<(&'static str, &'static str)> {
    KINDS.iter().find(|k| k.0 == what).map(|k| (k.1, k.2))
}

#[derive(Default)]
struct Acc {
    slot: Option<u64>,
    first_ns: u64,
    comm: String,
    /// Per kind: (calls, ns).
    by_kind: BTreeMap<u32, (u64, u64)>,
    ns: u64,
    /// The longest call: (start, end, kind).
    longest: (u64, u64, u32),
}

pub fn detect(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let mut acc: BTreeMap<(u64, u32), Acc> = BTreeMap::new();
    for w in inputs.cache_work {
        if w.tgid != inputs.pid || kind_name(w.what).is_none() || w.end_ns < w.start_ns {
            continue;
        }
        let Some((slot, bucket)) = buckets.of(w.start_ns) else {
            continue;
        };
        let ns = w.end_ns - w.start_ns;
        let a = acc.entry((bucket, w.tid)).or_default();
        if a.ns == 0 && a.by_kind.is_empty() || w.start_ns < a.first_ns {
            a.first_ns = w.start_ns;
        }
        a.slot = slot;
        if a.comm.is_empty() {
            a.comm = crate::kernel::events::comm_str(&w.comm);
        }
        let k = a.by_kind.entry(w.what).or_default();
        k.0 += 1;
        k.1 += ns;
        a.ns += ns;
        if ns > a.longest.1 - a.longest.0 {
            a.longest = (w.start_ns, w.end_ns, w.what);
        }
    }
    acc.into_iter()
        .filter(|(_, a)| a.ns >= config.program_cache_threshold_ns)
        .map(|((_, tid), a)| finding(inputs, tid, a, names))
        .collect()
}

/// The thread's most frequent sampled stack in `[from, to)`.
fn hottest_stack(inputs: &Inputs, tid: u32, from: u64, to: u64) -> Option<StackKey> {
    let mut counts: HashMap<(i32, i32), (u64, StackKey)> = HashMap::new();
    for (ts, key) in inputs.samples {
        if key.tid == tid && *ts >= from && *ts < to {
            counts
                .entry((key.user_stack_id, key.kernel_stack_id))
                .or_insert((0, *key))
                .0 += 1;
        }
    }
    counts
        .into_values()
        .max_by_key(|(n, k)| (*n, std::cmp::Reverse((k.user_stack_id, k.kernel_stack_id))))
        .map(|(_, k)| k)
}

fn finding(inputs: &Inputs, tid: u32, a: Acc, names: &mut NameStack) -> Finding {
    let mut magnitudes = BTreeMap::from([
        ("work_ms", ms(a.ns)),
        ("longest_ms", ms(a.longest.1 - a.longest.0)),
    ]);
    let mut parts = Vec::new();
    let mut calls = 0;
    for (what, (n, ns)) in &a.by_kind {
        let Some((name, doing)) = kind_name(*what) else {
            continue;
        };
        calls += n;
        magnitudes.insert(name, ms(*ns));
        parts.push(format!("{doing} {:.1} ms ({n} calls)", ms(*ns)));
    }
    magnitudes.insert("calls", calls as f64);
    // Each load is one program missing from the cache (what the node's own
    // loaded-programs-cache-stats counts as a miss).
    magnitudes.insert(
        "programs_loaded",
        a.by_kind.get(&cache_work::LOAD).map_or(0, |k| k.0) as f64,
    );
    // The cause: eviction on its own, or the cost of a miss (load, verify
    // and JIT together).
    let evict_ns = a.by_kind.get(&cache_work::EVICT).map_or(0, |k| k.1);
    let miss_ns = a.ns - evict_ns;
    let (cause, advice) = if miss_ns >= evict_ns {
        (
            "programs loaded and compiled (cache misses)",
            "programs missing from the program cache were loaded, verified and JIT-compiled on \
             this thread within the slot: more programs in use than the cache holds (a miss \
             every slot), or entries invalidated (a redeployed program, an epoch boundary's \
             recompilation). The node's loaded-programs-cache-stats metric counts its misses and \
             evictions per slot; a larger program cache (1024-2048 entries) cut program-cache \
             latency by up to 90% in the validator RAM/program-cache study",
        )
    } else {
        (
            "cache entries evicted or pruned",
            "the program cache evicted or pruned entries on this thread within the slot: a cache \
             too small for the programs in use evicts every slot, and each eviction is a reload \
             later; see loaded-programs-cache-stats (evictions per slot) and size the cache \
             above the working set",
        )
    };
    let thread = inputs.thread_name_or(tid, &a.comm);
    let (from, to, what) = a.longest;
    let stack = hottest_stack(inputs, tid, from, to)
        .map(|k| super::key_stack(&k, names))
        .unwrap_or_default();
    let longest_doing = kind_name(what).map_or("", |k| k.1);
    Finding {
        kind: FindingKind::ProgramCache,
        slot: a.slot,
        pid: inputs.pid,
        tid,
        thread: thread.clone(),
        start_ns: a.first_ns,
        duration_ns: a.ns,
        magnitudes,
        cause: Some(cause.into()),
        stack,
        waker_stack: Vec::new(),
        ran_instead: Vec::new(),
        explanation: format!(
            "{thread} spent {:.1} ms in the program cache: {} (longest call {:.1} ms {longest_doing})",
            ms(a.ns),
            parts.join(", "),
            ms(to - from)
        ),
        advice: advice.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use profiler_ebpf::{CacheWork, EventKind};

    const MS: u64 = 1_000_000;

    fn work(tid: u32, what: u32, start: u64, end: u64) -> CacheWork {
        CacheWork {
            kind: EventKind::CacheWork as u32,
            cpu: 0,
            start_ns: start,
            end_ns: end,
            tgid: 1,
            tid,
            what,
            _pad: 0,
            comm: comm("replay"),
        }
    }

    fn run(work: &[CacheWork], samples: &[(u64, StackKey)]) -> Vec<Finding> {
        let names = HashMap::from([(7, "solReplayTx00".to_string())]);
        let mut inputs = empty_inputs(&names);
        inputs.cache_work = work;
        inputs.samples = samples;
        let config = DetectorConfig::default();
        let t = crate::slots::Timeline::clock(std::time::Duration::from_millis(400), 0, None, 0, 4000 * MS);
        let buckets = Buckets::new(Some(&t), 0);
        detect(&inputs, &config, &buckets, &mut |_, id, kernel| {
            if kernel {
                Vec::new()
            } else {
                vec![format!("stack{id}")]
            }
        })
    }

    #[test]
    fn a_miss_is_load_verify_and_jit_of_the_thread_in_its_slot() {
        let w = [
            work(7, cache_work::LOAD, 410 * MS, 412 * MS),
            work(7, cache_work::VERIFY, 412 * MS, 413 * MS),
            work(7, cache_work::JIT, 413 * MS, 421 * MS),
            // Another thread's short evictions: under the threshold.
            work(9, cache_work::EVICT, 500 * MS, 501 * MS),
            // Another process's work is not the target's.
            CacheWork {
                tgid: 2,
                ..work(7, cache_work::JIT, 430 * MS, 490 * MS)
            },
        ];
        let samples = [
            (414 * MS, key(7, "replay", 5, -1)),
            (415 * MS, key(7, "replay", 5, -1)),
            (416 * MS, key(7, "replay", 6, -1)),
            // Outside the longest call.
            (411 * MS, key(7, "replay", 8, -1)),
            (412 * MS, key(7, "replay", 8, -1)),
            (412 * MS + 1, key(7, "replay", 8, -1)),
        ];
        let f = run(&w, &samples);
        assert_eq!(f.len(), 1, "{f:#?}");
        let f = &f[0];
        assert_eq!((f.kind, f.slot, f.tid), (FindingKind::ProgramCache, Some(1), 7));
        assert_eq!(f.thread, "solReplayTx00");
        assert_eq!(f.start_ns, 410 * MS);
        assert_eq!(f.duration_ns, 11 * MS);
        assert_eq!(f.magnitudes["jit_ms"], 8.0);
        assert_eq!(f.magnitudes["load_ms"], 2.0);
        assert_eq!(f.magnitudes["verify_ms"], 1.0);
        assert_eq!(f.magnitudes["calls"], 3.0);
        assert_eq!(f.magnitudes["programs_loaded"], 1.0);
        assert_eq!(f.magnitudes["longest_ms"], 8.0);
        assert_eq!(
            f.cause.as_deref(),
            Some("programs loaded and compiled (cache misses)")
        );
        assert_eq!(f.stack, vec!["stack5"], "the hottest stack inside the JIT call");
        assert!(
            f.explanation.contains("JIT-compiling 8.0 ms (1 calls)"),
            "{}",
            f.explanation
        );
    }

    #[test]
    fn eviction_heavy_slots_say_so_and_slots_are_apart() {
        let w = [
            work(7, cache_work::EVICT, 10 * MS, 17 * MS),
            work(7, cache_work::LOAD, 20 * MS, 21 * MS),
            // The next slot: its own finding.
            work(7, cache_work::JIT, 810 * MS, 816 * MS),
        ];
        let f = run(&w, &[]);
        assert_eq!(f.len(), 2, "{f:#?}");
        assert_eq!(f[0].slot, Some(0));
        assert_eq!(f[0].cause.as_deref(), Some("cache entries evicted or pruned"));
        assert_eq!(f[0].magnitudes["evict_ms"], 7.0);
        assert!(f[0].stack.is_empty(), "no samples, no stack");
        assert_eq!(f[1].slot, Some(2));
        assert_eq!(f[1].duration_ns, 6 * MS);
    }

    #[test]
    fn hostile_records_are_ignored() {
        let w = [
            // Unknown kind (not a cookie slotprof gives), and time running
            // backwards: neither counts.
            work(7, 99, 10 * MS, 30 * MS),
            work(7, cache_work::JIT, 30 * MS, 10 * MS),
        ];
        assert!(run(&w, &[]).is_empty());
    }
}
