//! `SyncAllocatorPurge`: a hot thread returning memory to the kernel
//! itself — madvise(MADV_DONTNEED / MADV_FREE), the way jemalloc purges
//! dirty pages when it has no background thread — for more than a
//! threshold per slot (default 1 ms). Each call can flush TLBs and, with
//! other CPUs running the process, send shootdown IPIs to all of them.
//!
//! Hot threads: the main-loop thread, `--hot-thread NAME`s, or by default
//! the process's main thread.

use std::collections::{BTreeMap, HashMap};

use super::{ms, Buckets, DetectorConfig, Finding, Inputs, NameStack};

/// Whether an madvise `behavior` returns memory: MADV_DONTNEED (4) or
/// MADV_FREE (8), the calls an allocator purges with.
pub fn is_purge(behavior: u32) -> bool {
    behavior == 4 || behavior == 8
}

/// Frames of an allocator setting itself up (jemalloc's `malloc_init_hard`
/// madvises its first chunk): a one-time start-up cost, not a purge.
fn allocator_init_frame(frame: &str) -> bool {
    frame.contains("malloc_init")
}

/// Frames that say an allocator is purging.
pub fn allocator_frame(frame: &str) -> bool {
    let f = frame.to_ascii_lowercase();
    [
        "jemalloc",
        "je_",
        "_rjem_",
        "purge",
        "decay",
        "tcmalloc",
        "mimalloc",
        "malloc_trim",
        "arena_",
    ]
    .iter()
    .any(|p| f.contains(p))
}

#[derive(Default)]
struct Acc {
    calls: u64,
    bytes: u64,
    ns: u64,
    tlb_local: u64,
    tlb_ipis: u64,
    first_ns: u64,
    last_ns: u64,
    /// Stack id -> ns spent under it.
    stacks: HashMap<i32, u64>,
    slot: Option<u64>,
}

pub fn detect(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let mut hot = inputs.hot_tids(config);
    if hot.is_empty() {
        hot.push(inputs.pid);
    }
    let mut acc: BTreeMap<(u64, u32), Acc> = BTreeMap::new();
    let mut init_stack: HashMap<i32, bool> = HashMap::new();
    for m in inputs.madvise {
        if !is_purge(m.behavior) || !hot.contains(&m.tid) {
            continue;
        }
        let init = *init_stack.entry(m.user_stack_id).or_insert_with(|| {
            names(inputs.pid, m.user_stack_id, false)
                .iter()
                .any(|f| allocator_init_frame(f))
        });
        if init {
            continue;
        }
        let Some((slot, bucket)) = buckets.of(m.start_ns) else {
            continue;
        };
        let a = acc.entry((bucket, m.tid)).or_default();
        let dur = m.end_ns.saturating_sub(m.start_ns);
        if a.calls == 0 {
            a.first_ns = m.start_ns;
        }
        a.calls += 1;
        a.bytes += m.len;
        a.ns += dur;
        a.tlb_local += m.tlb_local as u64;
        a.tlb_ipis += m.tlb_ipis as u64;
        a.last_ns = a.last_ns.max(m.end_ns);
        *a.stacks.entry(m.user_stack_id).or_default() += dur;
        a.slot = slot;
    }
    let mut findings = Vec::new();
    for ((_, tid), a) in acc {
        if a.ns <= config.purge_threshold_ns {
            continue;
        }
        let top = a
            .stacks
            .iter()
            .max_by_key(|(id, ns)| (**ns, **id))
            .map(|(id, _)| *id)
            .unwrap_or(-1);
        let stack = names(inputs.pid, top, false);
        let allocator = stack.iter().any(|f| allocator_frame(f));
        let thread = inputs.thread_name(tid);
        findings.push(Finding {
            kind: crate::detectors::FindingKind::SyncAllocatorPurge,
            slot: a.slot,
            pid: inputs.pid,
            tid,
            thread: thread.clone(),
            start_ns: a.first_ns,
            duration_ns: a.ns,
            magnitudes: BTreeMap::from([
                ("madvise_calls", a.calls as f64),
                ("bytes", a.bytes as f64),
                ("madvise_ms", ms(a.ns)),
                ("tlb_flushes", a.tlb_local as f64),
                ("shootdown_ipis", a.tlb_ipis as f64),
                ("allocator_frames", if allocator { 1.0 } else { 0.0 }),
                ("threshold_ms", ms(config.purge_threshold_ns)),
            ]),
            cause: None,
            stack,
            waker_stack: Vec::new(),
            ran_instead: Vec::new(),
            explanation: format!(
                "{thread} spent {:.1} ms in {} madvise(DONTNEED/FREE) calls returning {:.1} MiB to the kernel, \
                 with {} TLB flushes and {} shootdown IPIs{}",
                ms(a.ns),
                a.calls,
                a.bytes as f64 / (1 << 20) as f64,
                a.tlb_local,
                a.tlb_ipis,
                if allocator { ", from the allocator's purge path" } else { "" }
            ),
            advice: "purge off the hot thread: with jemalloc set background_thread:true (MALLOC_CONF, or \
                     _RJEM_MALLOC_CONF for tikv-jemallocator) and a nonzero dirty_decay_ms; drop big structures \
                     on a reaper thread instead of the hot one"
                .to_string(),
        });
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detectors::test_support::*;

    const MS: u64 = 1_000_000;

    /// Inputs of process 1 holding only madvise calls.
    fn madvise_inputs<'a>(
        calls: &'a [profiler_ebpf::MadviseCall],
        names: &'a HashMap<u32, String>,
    ) -> Inputs<'a> {
        Inputs {
            madvise: calls,
            ..empty_inputs(names)
        }
    }

    #[test]
    fn purges_on_the_hot_thread_over_the_threshold_fire_per_slot() {
        let names = HashMap::from([(1, "main".to_string()), (2, "jemalloc_bg_thd".to_string())]);
        let mut calls = Vec::new();
        // Slot 0 (0-400 ms): 10 x 0.3 ms on main; slot 1: 2 x 0.3 ms (under 1 ms).
        for i in 0..10 {
            calls.push(madvise(1, i * 10 * MS, 300_000, 1 << 20, 5));
        }
        for i in 0..2 {
            calls.push(madvise(1, 400 * MS + i * 10 * MS, 300_000, 1 << 20, 5));
        }
        // The background thread purges a lot, but it is not hot.
        for i in 0..50 {
            calls.push(madvise(2, i * MS, 900_000, 1 << 20, 6));
        }
        let inp = madvise_inputs(&calls, &names);
        let mut n = namer(HashMap::from([(
            5,
            vec!["main", "drop_bank", "_rjem_je_tcache_bin_flush", "madvise"],
        )]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].tid, 1);
        assert_eq!(f[0].magnitudes["madvise_calls"], 10.0);
        assert_eq!(f[0].magnitudes["madvise_ms"], 3.0);
        assert_eq!(f[0].magnitudes["allocator_frames"], 1.0);
        assert_eq!(f[0].magnitudes["shootdown_ipis"], 20.0);
        assert!(f[0].explanation.contains("10 madvise"), "{}", f[0].explanation);
    }

    /// Seen under TCG in the test VM: jemalloc's start-up madvise on the
    /// main thread crossed 1 ms; it is set-up, not a purge.
    #[test]
    fn the_allocators_own_start_up_is_not_a_purge() {
        let names = HashMap::from([(1, "bank-loop".to_string())]);
        let calls: Vec<_> = (0..4).map(|i| madvise(1, i * MS, 400_000, 4096, 7)).collect();
        let inp = madvise_inputs(&calls, &names);
        let mut n = namer(HashMap::from([(
            7,
            vec![
                "__libc_start_main",
                "malloc_init_hard",
                "malloc_init_hard_a0_locked",
                "madvise",
            ],
        )]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert!(f.is_empty(), "{f:?}");
    }
    #[test]
    fn only_dontneed_and_free_are_purges() {
        assert!(is_purge(4) && is_purge(8));
        for other in [0, 1, 2, 3, 9, 10, 14, 15, 100] {
            assert!(!is_purge(other), "{other}");
        }
    }

    #[test]
    fn allocator_frames_are_named_ones_only() {
        for f in [
            "je_arena_decay",
            "_rjem_je_tcache_bin_flush",
            "jemalloc::purge",
            "tcmalloc::ReleaseMemory",
            "mi_heap_collect (mimalloc)",
            "malloc_trim",
            "arena_decay_impl",
            "PURGE_ALL",
        ] {
            assert!(allocator_frame(f), "{f}");
        }
        for f in ["main", "std::vec::Vec<T>::drop", "madvise", "drop_in_place"] {
            assert!(!allocator_frame(f), "{f}");
        }
    }

    #[test]
    fn totals_start_and_the_heaviest_stack_of_a_purge() {
        let names = HashMap::from([(1, "main".to_string())]);
        let mut calls = Vec::new();
        // Stack 5: 3 x 0.4 ms = 1.2 ms, from the start; stack 6: 1 x 0.5 ms
        // later (a higher id, and the longest single call).
        for i in 0..3 {
            calls.push(madvise(1, 10 * MS + i * MS, 400_000, 1 << 20, 5));
        }
        calls.push(madvise(1, 20 * MS, 500_000, 1 << 20, 6));
        let inp = madvise_inputs(&calls, &names);
        let mut n = namer(HashMap::from([
            (5, vec!["main", "drop_accounts"]),
            (6, vec!["main", "drop_bank"]),
        ]));
        let f = detect(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].start_ns, 10 * MS);
        assert_eq!(f[0].duration_ns, 1_700_000);
        assert_eq!(f[0].magnitudes["bytes"], (4 << 20) as f64);
        assert_eq!(f[0].magnitudes["tlb_flushes"], 4.0);
        assert_eq!(f[0].magnitudes["shootdown_ipis"], 8.0);
        assert_eq!(f[0].magnitudes["allocator_frames"], 0.0);
        assert_eq!(f[0].stack, ["main", "drop_accounts"]);
        assert!(
            !f[0].explanation.contains("allocator's purge path"),
            "{}",
            f[0].explanation
        );
    }
}
