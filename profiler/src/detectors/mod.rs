//! Detectors: pure functions from a session's events to [`Finding`]s.
//!
//! One file per detector. Each takes the events it needs (plain slices),
//! a [`DetectorConfig`], the `slots::Buckets` findings are cut along (the
//! slots) and a way to name stacks; none touches the kernel, so each is
//! unit-tested on constructed event streams.
//!
//! [`kvm_mmu_invalidation`] is the host's: its inputs are the samples
//! `host` classifies from its probes, counted per second.
//!
//! [`memory_access`] decodes the samples' instructions against the
//! target's code into the memory they touched: the cache-line detector's
//! input (it touches no kernel either).
//!
//! Not here: aggregating events into the inputs and naming stacks
//! (`pipeline`), reading the host's probes and VM processes (`host`).

pub mod cache_line_ping_pong;
pub mod cpu_contention;
pub mod kvm_mmu_invalidation;
pub mod lock_contention;
pub mod main_loop_gap;
pub mod memory_access;
pub mod memory_pressure;
pub mod program_cache;
pub mod sync_allocator_purge;

use crate::slots::Buckets;
use std::collections::{BTreeMap, HashMap};

use profiler_ebpf::{CacheWork, FutexWait, LoopMark, MadviseCall, MemStall};
use serde::Serialize;

use crate::records::{Interval, StackKey};

/// What kind of stall a finding is (serialized as its name). In
/// alphabetical order, so that findings sort as their names do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum FindingKind {
    /// A cache line written by one thread and touched from another CPU
    /// ([`cache_line_ping_pong`]).
    CacheLinePingPong,
    /// A hot thread runnable but without a CPU ([`cpu_contention`]).
    CpuContention,
    /// The host invalidated a VM's KVM mappings (`slotprof host`).
    KvmMmuInvalidation,
    /// A wait on a futex another thread held ([`lock_contention`]).
    LockContention,
    /// A main-loop iteration over the threshold ([`main_loop_gap`]).
    MainLoopGap,
    /// A thread stalled reclaiming or compacting memory, or waiting for a
    /// page ([`memory_pressure`]).
    MemoryPressure,
    /// A thread loading, verifying, JIT-compiling or evicting programs in
    /// the runtime's program cache ([`program_cache`]).
    ProgramCache,
    /// An allocator returning memory on a hot thread ([`sync_allocator_purge`]).
    SyncAllocatorPurge,
}

impl FindingKind {
    /// Every kind, in order.
    pub const ALL: [FindingKind; 8] = [
        FindingKind::CacheLinePingPong,
        FindingKind::CpuContention,
        FindingKind::KvmMmuInvalidation,
        FindingKind::LockContention,
        FindingKind::MainLoopGap,
        FindingKind::MemoryPressure,
        FindingKind::ProgramCache,
        FindingKind::SyncAllocatorPurge,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::CacheLinePingPong => "CacheLinePingPong",
            FindingKind::CpuContention => "CpuContention",
            FindingKind::KvmMmuInvalidation => "KvmMmuInvalidation",
            FindingKind::LockContention => "LockContention",
            FindingKind::MainLoopGap => "MainLoopGap",
            FindingKind::MemoryPressure => "MemoryPressure",
            FindingKind::ProgramCache => "ProgramCache",
            FindingKind::SyncAllocatorPurge => "SyncAllocatorPurge",
        }
    }
}

impl std::fmt::Display for FindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Something slotprof found, with what it means and what to do.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub kind: FindingKind,
    /// The slot it happened in (None without a slot source).
    pub slot: Option<u64>,
    pub pid: u32,
    pub tid: u32,
    pub thread: String,
    pub start_ns: u64,
    pub duration_ns: u64,
    /// The kind's own numbers (counts, bytes, ms).
    pub magnitudes: BTreeMap<&'static str, f64>,
    /// What it came down to, for kinds that decompose (MainLoopGap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// The most telling stack, root first.
    pub stack: Vec<String>,
    /// For waits: the stack of the thread that ended them, when known.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waker_stack: Vec<String>,
    /// For CPU waits: the tasks that had the CPU, longest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ran_instead: Vec<cpu_contention::RanInstead>,
    /// One line: what happened.
    pub explanation: String,
    /// What to do about it.
    pub advice: String,
}

/// Which thread runs the main loop.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum LoopThread {
    Name(String),
    Tid(u32),
}

impl std::str::FromStr for LoopThread {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("--loop-thread wants a thread name or a tid".into());
        }
        Ok(s.parse()
            .map(LoopThread::Tid)
            .unwrap_or_else(|_| LoopThread::Name(s.to_string())))
    }
}

/// Detector settings (CLI flags). A recording made before a setting
/// existed reads it as its default.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct DetectorConfig {
    /// The main-loop thread, if named; else the thread that calls the
    /// loop symbol, if given.
    pub loop_thread: Option<LoopThread>,
    /// An iteration longer than this is a gap.
    pub gap_threshold_ns: u64,
    /// Threads (by name) whose madvise time matters besides the loop thread.
    pub hot_threads: Vec<String>,
    /// madvise time per thread per slot that makes a purge finding.
    pub purge_threshold_ns: u64,
    /// Futex wait per address per slot that makes a contention finding.
    pub lock_threshold_ns: u64,
    /// Runnable-but-waiting time per hot thread per slot that makes a
    /// CpuContention.
    pub cpu_wait_threshold_ns: u64,
    /// Memory-stall time per thread per slot that makes a MemoryPressure.
    pub memory_stall_threshold_ns: u64,
    /// Program-cache time per thread per slot that makes a ProgramCache.
    pub program_cache_threshold_ns: u64,
    /// On-CPU sampling period.
    pub sample_period_ns: u64,
    /// `--topology`: CCXs from a file instead of sysfs.
    pub topology: Option<std::path::PathBuf>,
    /// Share of samples on a line that makes a CacheLinePingPong.
    pub pingpong_threshold: f64,
}

impl Default for DetectorConfig {
    fn default() -> Self {
        Self {
            loop_thread: None,
            gap_threshold_ns: 5_000_000,
            hot_threads: Vec::new(),
            purge_threshold_ns: 1_000_000,
            lock_threshold_ns: 10_000_000,
            cpu_wait_threshold_ns: 5_000_000,
            memory_stall_threshold_ns: 5_000_000,
            program_cache_threshold_ns: 5_000_000,
            sample_period_ns: 1_000_000_000 / 99,
            topology: None,
            pingpong_threshold: 0.05,
        }
    }
}

/// Futex waits kept elsewhere (a session's, mostly in a temporary file):
/// read in order, as often as asked.
pub trait FutexSource {
    fn waits(&self) -> Box<dyn Iterator<Item = FutexWait> + '_>;
}

/// The futex waits the detectors read: a slice (a chunk's, a test's) or
/// a session's [`FutexSource`].
#[derive(Clone, Copy)]
pub enum FutexWaits<'a> {
    Slice(&'a [FutexWait]),
    Source(&'a dyn FutexSource),
}

impl Default for FutexWaits<'_> {
    fn default() -> Self {
        FutexWaits::Slice(&[])
    }
}

impl<'a> From<&'a [FutexWait]> for FutexWaits<'a> {
    fn from(s: &'a [FutexWait]) -> Self {
        FutexWaits::Slice(s)
    }
}

impl<'a> FutexWaits<'a> {
    /// Every wait, in order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = FutexWait> + 'a> {
        match *self {
            FutexWaits::Slice(s) => Box::new(s.iter().copied()),
            FutexWaits::Source(s) => s.waits(),
        }
    }
}

/// Everything the detectors read.
pub struct Inputs<'a> {
    pub pid: u32,
    pub samples: &'a [(u64, StackKey)],
    pub intervals: &'a [Interval],
    pub madvise: &'a [MadviseCall],
    /// Reclaim and compaction stalls of the target's threads.
    pub mem_stalls: &'a [MemStall],
    /// Program-cache calls (load, verify, JIT, evict) of the target.
    pub cache_work: &'a [CacheWork],
    /// Futex waits over the minimum, streamed (a session's are mostly in
    /// a temporary file).
    pub futex: FutexWaits<'a>,
    pub loop_marks: &'a [LoopMark],
    /// Short futex waits counted in the kernel: (address, waits, ns).
    pub short_futex: &'a [(u64, u64, u64)],
    pub thread_names: &'a HashMap<u32, String>,
}

impl<'a> Inputs<'a> {
    /// Inputs of process `pid` with no events: what a detector that reads
    /// only the pid and the thread names gets (the cache-line one), and what
    /// the unit tests fill in.
    pub fn empty(pid: u32, thread_names: &'a HashMap<u32, String>) -> Inputs<'a> {
        Inputs {
            pid,
            samples: &[],
            intervals: &[],
            madvise: &[],
            mem_stalls: &[],
            cache_work: &[],
            futex: Default::default(),
            loop_marks: &[],
            short_futex: &[],
            thread_names,
        }
    }

    pub(crate) fn thread_name(&self, tid: u32) -> String {
        self.thread_name_or(tid, "")
    }

    /// The thread's name, else `comm` (a name the record itself carried,
    /// for a thread that left before the names were read), else its tid.
    pub(crate) fn thread_name_or(&self, tid: u32, comm: &str) -> String {
        match self.thread_names.get(&tid) {
            Some(n) => n.clone(),
            None if !comm.is_empty() => comm.to_string(),
            None => format!("tid {tid}"),
        }
    }

    /// Threads whose every stall counts (see [`hot_tids`]).
    pub fn hot_tids(&self, config: &DetectorConfig) -> Vec<u32> {
        hot_tids(self.thread_names, self.loop_marks, config)
    }

    /// The loop thread's tid (see [`loop_tid`]).
    pub fn loop_tid(&self, config: &DetectorConfig) -> Option<u32> {
        loop_tid(self.thread_names, self.loop_marks, config)
    }
}

/// Threads whose every stall counts: `--hot-thread` names and the loop
/// thread.
pub fn hot_tids(
    thread_names: &HashMap<u32, String>,
    loop_marks: &[LoopMark],
    config: &DetectorConfig,
) -> Vec<u32> {
    let mut hot: Vec<u32> = thread_names
        .iter()
        .filter(|(_, n)| config.hot_threads.iter().any(|h| h == *n))
        .map(|(t, _)| *t)
        .collect();
    hot.extend(loop_tid(thread_names, loop_marks, config));
    hot
}

/// The loop thread's tid, from the config or the loop marks.
pub fn loop_tid(
    thread_names: &HashMap<u32, String>,
    loop_marks: &[LoopMark],
    config: &DetectorConfig,
) -> Option<u32> {
    match &config.loop_thread {
        Some(LoopThread::Tid(t)) => Some(*t),
        Some(LoopThread::Name(n)) => {
            let mut tids: Vec<u32> = thread_names
                .iter()
                .filter(|(_, name)| *name == n)
                .map(|(t, _)| *t)
                .collect();
            tids.sort_unstable();
            tids.first().copied()
        }
        None => loop_marks.first().map(|m| m.tid),
    }
}

/// Names a stack: (tgid, stack id, kernel?) -> frames, root first.
pub type NameStack<'a> = dyn FnMut(u32, i32, bool) -> Vec<String> + 'a;

/// Runs every detector.
pub fn run_all(
    inputs: &Inputs,
    config: &DetectorConfig,
    buckets: &Buckets,
    names: &mut NameStack,
) -> Vec<Finding> {
    let mut findings: Vec<Finding> = EVENT_DETECTORS
        .iter()
        .flat_map(|(_, detect)| detect(inputs, config, buckets, names))
        .collect();
    findings.sort_by_key(|f| (f.start_ns, f.kind));
    findings
}

/// A detector over the event stream: the signature every one of them has.
pub type Detect = fn(&Inputs, &DetectorConfig, &Buckets, &mut NameStack) -> Vec<Finding>;

/// The detectors [`run_all`] runs, with the kind each finds. The other two
/// kinds read other inputs: [`FindingKind::CacheLinePingPong`] decoded
/// memory accesses ([`cache_line_ping_pong::detect`], through
/// `pipeline::cache_lines`), [`FindingKind::KvmMmuInvalidation`] the host's
/// per-second counts ([`kvm_mmu_invalidation::detect`], run by `host`).
pub const EVENT_DETECTORS: [(FindingKind, Detect); 6] = [
    (FindingKind::MainLoopGap, main_loop_gap::detect),
    (FindingKind::SyncAllocatorPurge, sync_allocator_purge::detect),
    (FindingKind::LockContention, lock_contention::detect),
    (FindingKind::CpuContention, cpu_contention::detect),
    (FindingKind::MemoryPressure, memory_pressure::detect),
    (FindingKind::ProgramCache, program_cache::detect),
];

/// An off-CPU interval's whole stack, root first: its user part, then
/// its kernel part.
pub(crate) fn interval_stack(i: &Interval, names: &mut NameStack) -> Vec<String> {
    key_stack(&i.key, names)
}

/// A stack key's whole stack, root first: its user part, then its kernel
/// part.
pub(crate) fn key_stack(k: &StackKey, names: &mut NameStack) -> Vec<String> {
    let mut s = names(k.tgid, k.user_stack_id, false);
    s.extend(names(k.tgid, k.kernel_stack_id, true));
    s
}

/// Overlap of `[a0, a1)` and `[b0, b1)` in ns.
pub(crate) fn overlap(a0: u64, a1: u64, b0: u64, b1: u64) -> u64 {
    a1.min(b1).saturating_sub(a0.max(b0))
}

pub(crate) fn ms(ns: u64) -> f64 {
    (ns as f64 / 1e4).round() / 100.0
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Constructed events for the detectors' unit tests.
    use profiler_ebpf::{EventKind, COMM_LEN};

    use super::*;

    /// Inputs of process 1 with no events at all (tests fill in theirs).
    pub fn empty_inputs(names: &HashMap<u32, String>) -> Inputs<'_> {
        Inputs::empty(1, names)
    }

    pub fn comm(s: &str) -> [u8; COMM_LEN] {
        let mut c = [0; COMM_LEN];
        c[..s.len()].copy_from_slice(s.as_bytes());
        c
    }

    pub fn key(tid: u32, name: &str, user: i32, kernel: i32) -> StackKey {
        StackKey {
            tgid: 1,
            tid,
            comm: comm(name),
            user_stack_id: user,
            kernel_stack_id: kernel,
        }
    }

    pub fn madvise(tid: u32, start: u64, dur: u64, len: u64, stack: i32) -> MadviseCall {
        MadviseCall {
            kind: EventKind::Madvise as u32,
            cpu: 0,
            start_ns: start,
            end_ns: start + dur,
            tgid: 1,
            tid,
            len,
            behavior: 4,
            user_stack_id: stack,
            ret: 0,
            tlb_local: 1,
            tlb_ipis: 2,
            comm: comm("main"),
        }
    }

    pub fn futex(tid: u32, start: u64, dur: u64, uaddr: u64, stack: i32, waker: u32) -> FutexWait {
        FutexWait {
            kind: EventKind::FutexWait as u32,
            cpu: 0,
            start_ns: start,
            end_ns: start + dur,
            tgid: 1,
            tid,
            uaddr,
            op: 128,
            user_stack_id: stack,
            ret: 0,
            waker_tid: waker,
            waker_user_stack_id: if waker != 0 { 90 } else { -1 },
            waker_context: -1,
            _pad: 0,
            waker_woken_ns: 0,
            comm: comm("waiter"),
            waker_comm: comm("holder"),
        }
    }

    pub fn mark(tid: u32, ts: u64) -> LoopMark {
        LoopMark {
            kind: EventKind::LoopMark as u32,
            cpu: 0,
            ts_ns: ts,
            tgid: 1,
            tid,
            page_faults: ts / 1_000_000,
        }
    }

    /// Stacks by id for tests: user stacks 1.., kernel stacks 100...
    pub fn namer(stacks: HashMap<i32, Vec<&'static str>>) -> impl FnMut(u32, i32, bool) -> Vec<String> {
        move |_, id, _| {
            stacks
                .get(&id)
                .map(|v| v.iter().map(|s| s.to_string()).collect())
                .unwrap_or_default()
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_finding_kind_serializes_and_prints_as_its_name_and_sorts_as_names_do() {
        for k in FindingKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::json!(k.as_str()));
            assert_eq!(k.to_string(), k.as_str());
        }
        let mut by_enum = FindingKind::ALL.to_vec();
        by_enum.sort();
        let mut by_name = FindingKind::ALL.to_vec();
        by_name.sort_by_key(|k| k.as_str());
        assert_eq!(by_enum, by_name);
    }

    use super::{test_support::*, *};

    const MS: u64 = 1_000_000;

    fn inputs<'a>(
        madvise: &'a [MadviseCall],
        marks: &'a [LoopMark],
        names: &'a HashMap<u32, String>,
    ) -> Inputs<'a> {
        Inputs {
            madvise,
            loop_marks: marks,
            ..empty_inputs(names)
        }
    }

    #[test]
    fn hot_threads_are_the_named_ones_and_the_loop_thread() {
        let names = HashMap::from([
            (1, "main".to_string()),
            (2, "solBnkTxSched".to_string()),
            (3, "solPohTickProd".to_string()),
            (4, "solBnkTxSched".to_string()),
            (5, "other".to_string()),
        ]);
        let inp = inputs(&[], &[], &names);
        let config = DetectorConfig {
            hot_threads: vec!["solBnkTxSched".into()],
            loop_thread: Some(LoopThread::Name("solPohTickProd".into())),
            ..DetectorConfig::default()
        };
        let mut hot = inp.hot_tids(&config);
        hot.sort_unstable();
        assert_eq!(hot, [2, 3, 4]);
        assert_eq!(inp.hot_tids(&DetectorConfig::default()), Vec::<u32>::new());
        // Without a name, the thread that calls the loop function.
        let marks = [mark(5, 0), mark(5, MS)];
        let inp = inputs(&[], &marks, &names);
        assert_eq!(inp.hot_tids(&DetectorConfig::default()), [5]);
        let by_tid = DetectorConfig {
            loop_thread: Some(LoopThread::Tid(9)),
            ..DetectorConfig::default()
        };
        assert_eq!(inp.hot_tids(&by_tid), [9]);
    }

    #[test]
    fn run_all_runs_every_detector_and_orders_findings_by_time() {
        let names = HashMap::from([(1, "main".to_string())]);
        // A 30 ms gap in a 2 ms loop at 300 ms, and ten 0.3 ms purges from
        // 10 ms on the same (loop, so hot) thread.
        let mut marks: Vec<_> = (0..200).map(|i| mark(1, i * 2 * MS)).collect();
        marks.retain(|m| !(m.ts_ns > 300 * MS && m.ts_ns < 330 * MS));
        let calls: Vec<_> = (0..10)
            .map(|i| madvise(1, 10 * MS + i * 10 * MS, 300_000, 1 << 20, 5))
            .collect();
        let inp = inputs(&calls, &marks, &names);
        let mut n = namer(HashMap::from([(5, vec!["main", "drop_bank", "madvise"])]));
        let f = run_all(&inp, &DetectorConfig::default(), &Buckets::new(None, 0), &mut n);
        let kinds: Vec<_> = f.iter().map(|f| (f.kind.as_str(), f.start_ns / MS)).collect();
        assert_eq!(kinds, [("SyncAllocatorPurge", 10), ("MainLoopGap", 300)], "{f:?}");
    }

    #[test]
    fn overlap_and_milliseconds() {
        assert_eq!(overlap(0, 10, 5, 20), 5);
        assert_eq!(overlap(0, 10, 10, 20), 0);
        assert_eq!(overlap(5, 6, 0, 20), 1);
        assert_eq!(ms(1_234_567), 1.23);
        assert_eq!(ms(1_235_000), 1.24);
    }
}
