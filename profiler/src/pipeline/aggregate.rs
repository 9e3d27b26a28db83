//! Keeping events by thread, stack and time, then naming the stacks.
//!
//! Ingestion is constant-time per event (an append of stack ids and a
//! timestamp); names are resolved once per distinct stack at the end, and
//! shared between the whole-session profile and every slot's.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

/// Maps on the per-interval path (foldhash: seeded per process, cheaper than
/// SipHash on small keys).
type FastMap<K, V> = foldhash::HashMap<K, V>;

use flamegraphs::Folded;
use profiler_ebpf::{
    stack_lost, CpuSample, LoopMark, MadviseCall, OffCpuFold, OffCpuInterval, OffCpuStart, UserRegs, COMM_LEN,
};
use serde::Serialize;
use symbolizer::Symbolizer;

pub use crate::records::{syscall_wait_frame, waker_is_task, Interval, StackKey};
use crate::{
    kernel::events::{comm_str, Event},
    pipeline::intervals::IntervalStore,
    slots::Timeline,
};

/// Per-thread totals, for the summary.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ThreadTotals {
    pub tid: u32,
    pub comm: String,
    pub samples: u64,
    pub offcpu_ns: u64,
    pub offcpu_intervals: u64,
}

/// One of the longest off-CPU intervals, with who ended it.
#[derive(Clone, Debug, Serialize)]
pub struct LongInterval {
    pub tid: u32,
    pub comm: String,
    pub start_ns: u64,
    pub duration_ns: u64,
    /// "blocked" or "preempted" (runnable, waiting for a CPU).
    pub kind: &'static str,
    /// Who woke it: `comm/tid (syscall)` for a task, `timer` or `interrupt`
    /// when the wakeup ran in interrupt context (then the task that was
    /// running is not the waker, and is not named).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waker: Option<String>,
    /// Closed by the end of the session rather than by a switch-in.
    pub cut_at_end: bool,
    #[serde(skip)]
    waker_task: Option<(String, u32)>,
    #[serde(skip)]
    waker_context: i32,
}

/// Slots whose counts are built in one pass over the events
/// ([`Aggregator::resolve_slots_each`]).
pub const SLOTS_PER_PASS: usize = 128;

/// How many of the longest intervals the summary lists.
const LONGEST_KEPT: usize = 20;

/// Everything counted so far.
#[derive(Default)]
pub struct Aggregator {
    /// Every on-CPU sample: time and stack.
    sample_log: Vec<(u64, StackKey)>,
    /// The CPU of each sample of `sample_log` (same index).
    sample_cpus: Vec<u16>,
    /// Every off-CPU interval (off the heap past the newest 65,536).
    interval_log: IntervalStore,
    /// Every madvise call of the target.
    pub madvise_log: Vec<MadviseCall>,
    /// Every memory stall (reclaim, compaction) of the target's threads.
    pub mem_stall_log: Vec<profiler_ebpf::MemStall>,
    /// Every program-cache call (load, verify, JIT, evict) of the target.
    pub cache_work_log: Vec<profiler_ebpf::CacheWork>,
    /// Every futex wait over the minimum (off the heap past the newest
    /// 32,768).
    pub futex_log: super::futex_store::FutexStore,
    /// Main-loop iteration starts (`--loop-symbol`).
    pub loop_marks: Vec<LoopMark>,
    /// Registers of the samples taken in user mode (cache-line detector).
    pub user_regs: Vec<UserRegs>,
    threads: HashMap<u32, ThreadTotals>,
    longest: Vec<LongInterval>,
    pub samples: u64,
    /// Off-CPU intervals, folded ones included, and their time.
    pub offcpu_intervals: u64,
    pub offcpu_ns: u64,
    /// Of `offcpu_intervals`, those the kernel folded, and the records
    /// they came in.
    pub offcpu_folded: u64,
    pub offcpu_folds: u64,
    /// Records that did not decode (never expected; counted, not trusted).
    malformed: u64,
    /// Every event counted, as records (`events::write_raw`), while a
    /// recording for `replay` is asked for (`--save-replay`).
    recording: Option<Vec<u8>>,
}

/// Stacks by id, read from the kernel's stack map before it goes away.
pub use crate::kernel::probes::StackTable;

/// The two flamegraph inputs and what was learnt while building them.
#[derive(Clone, Default)]
pub struct Profiles {
    /// Root frame is the thread name; values are samples.
    pub oncpu: Folded,
    /// Same shape; values are nanoseconds off-CPU.
    pub offcpu: Folded,
    /// The same values by thread id and CPU (the folded text keeps the
    /// thread's name only): what pprof's labels are made of. Empty where
    /// the profile was summed by stack alone (an hour's).
    pub rows: Vec<Row>,
    /// Median number of user frames in on-CPU samples that had a user stack.
    pub median_user_depth: Option<usize>,
}

/// A stack's on-CPU samples on one CPU, or its off-CPU time, for one
/// thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// The folded stack (`thread;root;...;leaf`, as in the folded
    /// profiles), shared by the rows of that stack.
    pub stack: Arc<str>,
    /// None where the thread is not known by id.
    pub tid: Option<u32>,
    /// On-CPU samples: the CPU they ran on.
    pub cpu: Option<u16>,
    pub samples: u64,
    pub offcpu_ns: u64,
    /// Where the stack's frames (after the thread) came from, root first;
    /// None where only the names are known.
    pub locs: Option<RowLocs>,
}

/// Where a row's frames came from: its user part's, its kernel part's
/// (each shared with every stack that has it), and the preemption marker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowLocs {
    pub user: Arc<[Loc]>,
    pub kernel: Arc<[Loc]>,
    pub preempted: bool,
}

impl RowLocs {
    /// Every frame's, root first.
    pub fn iter(&self) -> impl Iterator<Item = &Loc> {
        static MARKER: Loc = Loc::marker();
        self.user
            .iter()
            .chain(self.kernel.iter())
            .chain(self.preempted.then_some(&MARKER))
    }
}

/// Where a run of a stack's frame names came from (root first, like the
/// names): a user address in a file mapping gives one name, or several
/// for inlined calls (outermost first); a kernel address, or a marker
/// (`[user stack lost]`, the preemption marker), gives one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loc {
    /// 0 for a marker.
    pub address: u64,
    /// The file mapping of a user address (None: kernel, anonymous or
    /// pseudo mapping, marker).
    pub module: Option<Arc<symbolizer::Module>>,
    /// How many names it gave.
    pub names: u16,
    /// The names came from symbols (not `[unknown] file+0x...`).
    pub symbolized: bool,
}

impl Loc {
    const fn marker() -> Self {
        Self {
            address: 0,
            module: None,
            names: 1,
            symbolized: true,
        }
    }
}

/// What tells a [`Row`] from the other rows of a profile: its stack,
/// thread and CPU.
pub type RowKey = (Arc<str>, Option<u32>, Option<u16>);

impl Row {
    pub fn key(&self) -> RowKey {
        (self.stack.clone(), self.tid, self.cpu)
    }
}

impl Profiles {
    /// Adds `other`'s stacks.
    pub fn merge(&mut self, other: &Profiles) {
        self.oncpu.merge(&other.oncpu);
        self.offcpu.merge(&other.offcpu);
        self.rows.extend(other.rows.iter().cloned());
    }
}

impl Aggregator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one decoded record.
    /// An aggregator that also keeps every event it counts, for a
    /// recording (`replay`; `--save-replay`).
    pub fn recording() -> Self {
        Self {
            recording: Some(Vec::new()),
            ..Self::new()
        }
    }

    /// The events kept for a recording (empty without [`Self::recording`]).
    pub fn take_recording(&mut self) -> Vec<u8> {
        self.recording.take().unwrap_or_default()
    }

    /// A record that could not be read (or kept).
    pub fn note_malformed(&mut self) {
        self.malformed += 1;
    }

    /// Records that could not be read.
    pub fn malformed(&self) -> u64 {
        self.malformed
    }

    /// The last loop mark of an earlier window: where this window's first
    /// iteration began (the gap detector needs its start).
    pub fn seed_loop_mark(&mut self, mark: LoopMark) {
        self.loop_marks.push(mark);
    }

    pub fn ingest(&mut self, event: &Event) {
        // Samples' registers are the cache-line detector's, which a
        // recording does not replay: left out (a fifth of a recording).
        if let (Some(r), false) = (&mut self.recording, matches!(event, Event::UserRegs(_))) {
            let _ = crate::kernel::events::write_raw(r, &event.to_bytes());
        }
        match event {
            Event::Sample(s) => self.sample(s),
            Event::OffCpu(o) => self.interval(o, false),
            Event::OffCpuFold(f) => self.fold(f),
            // Slot marks belong to the slot timeline, not the profile.
            Event::SlotMark(_) => {}
            Event::Madvise(m) => self.madvise_log.push(*m),
            Event::MemStall(m) => self.mem_stall_log.push(*m),
            Event::CacheWork(w) => self.cache_work_log.push(*w),
            Event::FutexWait(f) => self.futex_log.push(f),
            Event::LoopMark(l) => self.loop_marks.push(*l),
            Event::UserRegs(r) => self.user_regs.push(*r),
            Event::Host(_) => {}
        }
    }

    /// The thread's totals; its name follows the latest `comm` seen
    /// (threads name themselves after they start).
    fn thread(&mut self, tid: u32, comm: &[u8; COMM_LEN]) -> &mut ThreadTotals {
        let t = self.threads.entry(tid).or_insert_with(|| ThreadTotals {
            tid,
            ..Default::default()
        });
        if t.comm.as_bytes() != &comm[..comm.iter().position(|&b| b == 0).unwrap_or(COMM_LEN)] {
            t.comm = comm_str(comm);
        }
        t
    }

    fn sample(&mut self, s: &CpuSample) {
        let key = StackKey {
            tgid: s.tgid,
            tid: s.tid,
            comm: s.comm,
            user_stack_id: s.user_stack_id,
            kernel_stack_id: s.kernel_stack_id,
        };
        self.sample_log.push((s.ts_ns, key));
        self.sample_cpus.push(s.cpu.min(u16::MAX as u32) as u16);
        self.samples += 1;
        self.thread(s.tid, &s.comm).samples += 1;
    }

    /// Counts an off-CPU interval; `cut_at_end` marks one still open when
    /// the session ended.
    pub fn interval(&mut self, o: &OffCpuInterval, cut_at_end: bool) {
        let ns = o.end_ns.saturating_sub(o.start_ns);
        let preempted = o.state == 0;
        let key = StackKey {
            tgid: o.tgid,
            tid: o.tid,
            comm: o.comm,
            user_stack_id: o.user_stack_id,
            kernel_stack_id: o.kernel_stack_id,
        };
        self.interval_log.push(&Interval {
            start_ns: o.start_ns,
            end_ns: o.end_ns,
            key,
            preempted,
            woken_ns: o.woken_ns,
            ran: crate::records::Runner::of(o),
            folded: None,
        });
        self.offcpu_intervals += 1;
        self.offcpu_ns += ns;
        let t = self.thread(o.tid, &o.comm);
        t.offcpu_ns += ns;
        t.offcpu_intervals += 1;
        self.keep_if_long(o, ns, preempted, cut_at_end);
    }

    /// Counts short waits the kernel folded into one record: their time
    /// exact, spread over their span in the profiles.
    pub fn fold(&mut self, f: &OffCpuFold) {
        // (A part of a fold cut at a slot's end may hold no whole wait.)
        if f.offcpu_ns == 0 || f.last_end_ns <= f.first_start_ns {
            return;
        }
        let key = StackKey {
            tgid: f.tgid,
            tid: f.tid,
            comm: f.comm,
            user_stack_id: f.user_stack_id,
            kernel_stack_id: f.kernel_stack_id,
        };
        let folded = crate::records::Folded {
            intervals: f.intervals,
            offcpu_ns: f.offcpu_ns.min(f.last_end_ns - f.first_start_ns),
            runnable_ns: f.runnable_ns,
        };
        self.interval_log.push(&Interval {
            start_ns: f.first_start_ns,
            end_ns: f.last_end_ns,
            key,
            preempted: false,
            woken_ns: 0,
            ran: Default::default(),
            folded: Some(folded),
        });
        self.offcpu_intervals += u64::from(f.intervals);
        self.offcpu_folded += u64::from(f.intervals);
        self.offcpu_folds += 1;
        self.offcpu_ns += folded.offcpu_ns;
        let t = self.thread(f.tid, &f.comm);
        t.offcpu_ns += folded.offcpu_ns;
        t.offcpu_intervals += u64::from(f.intervals);
    }

    /// Counts a thread that is still off-CPU when the session ends, from
    /// its kernel-side start record, up to `end_ns`.
    pub fn still_off_cpu(&mut self, tid: u32, start: &OffCpuStart, end_ns: u64, comm: &str) {
        let mut c = [0u8; COMM_LEN];
        let n = comm.len().min(COMM_LEN - 1);
        c[..n].copy_from_slice(&comm.as_bytes()[..n]);
        let interval = OffCpuInterval {
            kind: profiler_ebpf::EventKind::OffCpu as u32,
            cpu: 0,
            start_ns: start.start_ns,
            end_ns,
            tgid: start.tgid,
            tid,
            user_stack_id: start.user_stack_id,
            kernel_stack_id: start.kernel_stack_id,
            state: start.state,
            waker_tid: 0,
            waker_tgid: 0,
            waker_context: -1,
            comm: c,
            waker_comm: [0; COMM_LEN],
            woken_ns: 0,
            ran_tid: 0,
            ran_tgid: 0,
            ran_flags: 0,
            _pad: 0,
            ran_comm: [0; COMM_LEN],
        };
        if let Some(r) = &mut self.recording {
            let _ = crate::kernel::events::write_raw(r, &Event::OffCpu(interval).to_bytes());
        }
        self.interval(&interval, true);
    }

    fn keep_if_long(&mut self, o: &OffCpuInterval, ns: u64, preempted: bool, cut_at_end: bool) {
        if self.longest.len() == LONGEST_KEPT && self.longest.last().is_some_and(|l| l.duration_ns >= ns) {
            return;
        }
        let item = LongInterval {
            tid: o.tid,
            comm: comm_str(&o.comm),
            start_ns: o.start_ns,
            duration_ns: ns,
            kind: if preempted { "preempted" } else { "blocked" },
            waker: None,
            cut_at_end,
            waker_task: (o.waker_tid != 0).then(|| (comm_str(&o.waker_comm), o.waker_tid)),
            waker_context: o.waker_context,
        };
        let at = self.longest.partition_point(|l| l.duration_ns >= ns);
        self.longest.insert(at, item);
        self.longest.truncate(LONGEST_KEPT);
    }

    /// Every stack id the counted events refer to.
    pub fn stack_ids(&self) -> std::io::Result<HashSet<i32>> {
        let mut ids: HashSet<i32> = self
            .sample_log
            .iter()
            .map(|(_, k)| k)
            .flat_map(|k| [k.user_stack_id, k.kernel_stack_id])
            .chain(self.madvise_log.iter().map(|m| m.user_stack_id))
            .chain(
                self.futex_log
                    .iter()
                    .flat_map(|f| [f.user_stack_id, f.waker_user_stack_id]),
            )
            .filter(|&id| id >= 0)
            .collect();
        self.interval_log.for_each(|i| {
            ids.extend(
                [i.key.user_stack_id, i.key.kernel_stack_id]
                    .into_iter()
                    .filter(|&id| id >= 0),
            )
        })?;
        Ok(ids)
    }

    /// Per-thread totals, busiest first.
    pub fn threads(&self) -> Vec<ThreadTotals> {
        let mut v: Vec<_> = self.threads.values().cloned().collect();
        v.sort_by(|a, b| {
            (b.samples, b.offcpu_ns)
                .cmp(&(a.samples, a.offcpu_ns))
                .then(a.tid.cmp(&b.tid))
        });
        v
    }

    /// The longest off-CPU intervals, longest first, with their wakers named.
    pub fn longest_intervals(&self) -> Vec<LongInterval> {
        let mut out = self.longest.clone();
        for l in &mut out {
            l.waker = describe_waker(l.waker_task.as_ref(), l.waker_context);
        }
        out
    }

    /// Names every counted stack and builds the whole session's profiles.
    pub fn resolve(&self, stacks: &StackTable, sym: &mut Symbolizer) -> std::io::Result<Profiles> {
        let mut names = StackNamer::new(stacks, sym);
        let mut on: FastMap<(StackKey, u16), u64> = FastMap::default();
        for ((_, key), &cpu) in self.sample_log.iter().zip(&self.sample_cpus) {
            *on.entry((*key, cpu)).or_default() += 1;
        }
        let mut off: FastMap<(StackKey, bool), u64> = FastMap::default();
        self.interval_log.for_each(|i| {
            *off.entry((i.key, i.preempted)).or_default() += i.offcpu_ns();
        })?;
        Ok(names.profiles(&on, &off))
    }

    /// One profile per slot of `timeline` (indexed like its slots): samples
    /// land in the slot of their timestamp, off-CPU intervals are split at
    /// slot boundaries. Events outside every slot are left out.
    pub fn resolve_slots(
        &self,
        timeline: &Timeline,
        stacks: &StackTable,
        sym: &mut Symbolizer,
    ) -> anyhow::Result<Vec<Profiles>> {
        let mut out = Vec::with_capacity(timeline.slots().len());
        self.resolve_slots_each(timeline, stacks, sym, |_, p| {
            out.push(p);
            Ok(())
        })?;
        Ok(out)
    }

    /// [`Self::resolve_slots`] handed out slot by slot, in order: only one
    /// slot's named profiles exist at a time (a busy node's session has
    /// hundreds of slots of thousands of stacks each), and the counts are
    /// built [`SLOTS_PER_PASS`] slots at a time, one pass over the events
    /// each (a 10-minute attach to a busy node has ~1,400 slots).
    pub fn resolve_slots_each(
        &self,
        timeline: &Timeline,
        stacks: &StackTable,
        sym: &mut Symbolizer,
        mut each: impl FnMut(usize, Profiles) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let slots = timeline.slots();
        let mut names = StackNamer::new(stacks, sym);
        for first in (0..slots.len()).step_by(SLOTS_PER_PASS) {
            let last = (first + SLOTS_PER_PASS).min(slots.len());
            let (lo, hi) = (slots[first].start_ns, slots[last - 1].end_ns);
            let mut on: Vec<FastMap<(StackKey, u16), u64>> = vec![FastMap::default(); last - first];
            let mut off: Vec<FastMap<(StackKey, bool), u64>> = vec![FastMap::default(); last - first];
            for ((ts, key), &cpu) in self.sample_log.iter().zip(&self.sample_cpus) {
                if let Some(i) = timeline.slot_at(*ts).filter(|i| (first..last).contains(i)) {
                    *on[i - first].entry((*key, cpu)).or_default() += 1;
                }
            }
            self.interval_log.for_each(|iv| {
                if iv.end_ns <= lo || iv.start_ns >= hi {
                    return;
                }
                for (i, ns) in timeline.split(iv.start_ns, iv.end_ns) {
                    if (first..last).contains(&i) {
                        // Folded waits: their time, spread over their span.
                        let ns = match iv.folded {
                            None => ns,
                            Some(_) => {
                                let s = &timeline.slots()[i];
                                iv.offcpu_between(s.start_ns, s.end_ns)
                            }
                        };
                        *off[i - first].entry((iv.key, iv.preempted)).or_default() += ns;
                    }
                }
            })?;
            for (j, (on, off)) in on.iter_mut().zip(off.iter_mut()).enumerate() {
                let p = names.profiles(on, off);
                // This slot's counts are done with.
                *on = FastMap::default();
                *off = FastMap::default();
                each(first + j, p)?;
            }
        }
        Ok(())
    }

    /// Every on-CPU sample: time and stack.
    pub fn samples(&self) -> &[(u64, StackKey)] {
        &self.sample_log
    }

    /// The CPU of each sample of [`Self::samples`] (same index).
    pub fn sample_cpus(&self) -> &[u16] {
        &self.sample_cpus
    }

    /// Every off-CPU interval.
    pub fn intervals(&self) -> &IntervalStore {
        &self.interval_log
    }

    /// Thread names by tid.
    pub fn thread_names(&self) -> HashMap<u32, String> {
        self.threads
            .iter()
            .map(|(tid, t)| (*tid, t.comm.clone()))
            .collect()
    }

    /// Time span of the events seen, CLOCK_MONOTONIC ns.
    pub fn span(&self) -> std::io::Result<Option<(u64, u64)>> {
        let mut span = self
            .sample_log
            .iter()
            .map(|(t, _)| (*t, *t))
            .reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
        self.interval_log.for_each(|i| {
            let (a, b) = span.unwrap_or((i.start_ns, i.end_ns));
            span = Some((a.min(i.start_ns), b.max(i.end_ns)));
        })?;
        Ok(span)
    }
}

/// Names a waker from the task that was current at the wakeup and where
/// the wakeup ran (`profiler_ebpf::waker`): in an interrupt the current
/// task is only whoever was interrupted, and is not named.
fn describe_waker(task: Option<&(String, u32)>, context: i32) -> Option<String> {
    use profiler_ebpf::waker;
    match context {
        waker::NOT_TAKEN => task.map(|(comm, tid)| format!("{comm}/{tid}")),
        waker::TIMER => Some("timer".into()),
        waker::HARDIRQ => Some("interrupt".into()),
        waker::SOFTIRQ => Some("softirq".into()),
        waker::KERNEL_THREAD => task.map(|(comm, tid)| format!("{comm}/{tid} (kernel thread)")),
        nr if nr >= 0 => {
            let (comm, tid) = task?;
            Some(match crate::kernel::syscalls::name(nr) {
                Some(sc) => format!("{comm}/{tid} ({sc})"),
                None => format!("{comm}/{tid} (syscall {nr})"),
            })
        }
        _ => task.map(|(comm, tid)| format!("{comm}/{tid}")),
    }
}

/// Turns stack ids into frames, root first, caching each stack.
/// A user or kernel part of a stack: its names, root first, and where they
/// came from.
type Part = (std::rc::Rc<[String]>, Arc<[Loc]>);

/// A whole stack: what makes it (tgid, user and kernel stack ids, thread
/// name, preempted), and its folded line with where its frames came from.
type LineKey = (u32, i32, i32, [u8; COMM_LEN], bool);
type Line = (Arc<str>, RowLocs);

pub struct StackNamer<'a> {
    stacks: &'a StackTable,
    sym: &'a mut Symbolizer,
    cache: FastMap<(u32, i32, bool), Part>,
    /// Whole folded stacks, and where their frames came from, by what they
    /// are made of.
    lines: FastMap<LineKey, Line>,
}

impl<'a> StackNamer<'a> {
    pub fn new(stacks: &'a StackTable, sym: &'a mut Symbolizer) -> Self {
        Self {
            stacks,
            sym,
            cache: FastMap::default(),
            lines: FastMap::default(),
        }
    }

    /// Folded on-CPU (samples) and off-CPU (ns) profiles, and their rows
    /// by thread and CPU, from counts by stack (and CPU).
    fn profiles(
        &mut self,
        on: &FastMap<(StackKey, u16), u64>,
        off: &FastMap<(StackKey, bool), u64>,
    ) -> Profiles {
        let mut oncpu = Folded::new();
        let mut rows = Vec::with_capacity(on.len() + off.len());
        let mut depths = Vec::new();
        for ((key, cpu), &count) in on {
            if let Some(user) = self.stacks.get(&key.user_stack_id) {
                depths.extend(std::iter::repeat_n(user.len(), count as usize));
            }
            let (stack, locs) = self.line(key, false);
            oncpu.add_line(&*stack, count);
            rows.push(Row {
                stack,
                tid: Some(key.tid),
                cpu: Some(*cpu),
                samples: count,
                offcpu_ns: 0,
                locs: Some(locs),
            });
        }
        let mut offcpu = Folded::new();
        for ((key, preempted), &ns) in off {
            let (stack, locs) = self.line(key, *preempted);
            offcpu.add_line(&*stack, ns);
            rows.push(Row {
                stack,
                tid: Some(key.tid),
                cpu: None,
                samples: 0,
                offcpu_ns: ns,
                locs: Some(locs),
            });
        }
        // The same order whatever the maps' (pprof files compare equal).
        rows.sort_unstable_by(|a, b| {
            (&a.stack, a.tid, a.cpu, a.samples).cmp(&(&b.stack, b.tid, b.cpu, b.samples))
        });
        depths.sort_unstable();
        Profiles {
            oncpu,
            offcpu,
            rows,
            median_user_depth: depths.get(depths.len() / 2).copied(),
        }
    }

    /// The folded stack of `key`: thread, user part, kernel part (root
    /// first), and the preemption marker; and where its frames came from.
    /// Joined once per distinct stack.
    fn line(&mut self, key: &StackKey, preempted: bool) -> Line {
        let id = (
            key.tgid,
            key.user_stack_id,
            key.kernel_stack_id,
            key.comm,
            preempted,
        );
        if let Some(l) = self.lines.get(&id) {
            return l.clone();
        }
        let (user, user_locs) = self.shared_part(key.tgid, key.user_stack_id, false);
        let (kernel, kernel_locs) = self.shared_part(key.tgid, key.kernel_stack_id, true);
        let comm = comm_str(&key.comm);
        let frames = std::iter::once(comm.as_str())
            .chain(user.iter().map(String::as_str))
            .chain(kernel.iter().map(String::as_str))
            .chain(preempted.then_some("[preempted: waiting for a CPU]"));
        let line: Arc<str> = flamegraphs::fold(frames).into();
        let locs = RowLocs {
            user: user_locs,
            kernel: kernel_locs,
            preempted,
        };
        self.lines.insert(id, (line.clone(), locs.clone()));
        (line, locs)
    }

    /// The user or kernel part of a stack, root first.
    pub fn part(&mut self, tgid: u32, id: i32, kernel: bool) -> Vec<String> {
        self.shared_part(tgid, id, kernel).0.to_vec()
    }

    /// [`Self::part`] and where its names came from, shared with the cache.
    fn shared_part(&mut self, tgid: u32, id: i32, kernel: bool) -> Part {
        let cache_key = (if kernel { 0 } else { tgid }, id, kernel);
        if let Some(f) = self.cache.get(&cache_key) {
            return f.clone();
        }
        let side = if kernel { "kernel" } else { "user" };
        let (frames, locs) = if let Some(nr) = kernel.then(|| profiler_ebpf::syscall_wait_nr(id)).flatten() {
            (vec![syscall_wait_frame(nr)], vec![Loc::marker()])
        } else if id < 0 {
            // -EFAULT etc. means "no stack of this kind" (a sample in user
            // mode has no kernel stack): nothing to show.
            if stack_lost(id) {
                (vec![format!("[{side} stack lost]")], vec![Loc::marker()])
            } else {
                (Vec::new(), Vec::new())
            }
        } else if let Some(addrs) = self.stacks.get(&id) {
            let mut leaf_first = Vec::new();
            let mut locs = Vec::new();
            for (i, &addr) in addrs.iter().enumerate() {
                if !kernel && symbolizer::unwind::marker::is_marker(addr) {
                    // Why the unwound stack ends here.
                    let name = symbolizer::unwind::marker::name(addr);
                    leaf_first.push(match (addr, i.checked_sub(1).map(|j| addrs[j])) {
                        (symbolizer::unwind::marker::NO_UNWIND_INFO, Some(prev)) => {
                            format!("{name} {}", self.sym.module_offset(tgid, prev, i > 1))
                        }
                        _ => name.to_string(),
                    });
                    locs.push(Loc::marker());
                    continue;
                }
                let names = if kernel {
                    self.sym.kernel_frame(addr, i > 0)
                } else {
                    self.sym.user_frame(tgid, addr, i > 0)
                };
                let (module, address) =
                    match (!kernel).then(|| self.sym.module_of(tgid, addr, i > 0)).flatten() {
                        Some((m, a)) => (Some(m), a),
                        None => (None, addr),
                    };
                locs.push(Loc {
                    address,
                    module,
                    names: names.len().min(u16::MAX as usize) as u16,
                    symbolized: !names.iter().any(|n| n.starts_with("[unknown]")),
                });
                leaf_first.extend(
                    names
                        .iter()
                        .map(|n| if kernel { format!("{n}_[k]") } else { n.clone() }),
                );
            }
            leaf_first.reverse();
            locs.reverse();
            (leaf_first, locs)
        } else {
            (vec![format!("[{side} stack missing]")], vec![Loc::marker()])
        };
        let parts = (std::rc::Rc::from(frames), Arc::from(locs));
        self.cache.insert(cache_key, parts.clone());
        parts
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use profiler_ebpf::EventKind;

    #[test]
    fn wakers_in_interrupt_context_are_not_blamed_on_the_interrupted_task() {
        use profiler_ebpf::waker;
        let task = ("hot".to_string(), 7);
        assert_eq!(
            describe_waker(Some(&task), waker::TIMER).as_deref(),
            Some("timer")
        );
        assert_eq!(
            describe_waker(Some(&task), waker::HARDIRQ).as_deref(),
            Some("interrupt")
        );
        assert_eq!(
            describe_waker(Some(&task), waker::SOFTIRQ).as_deref(),
            Some("softirq")
        );
        assert_eq!(
            describe_waker(Some(&task), libc::SYS_futex as i32).as_deref(),
            Some("hot/7 (futex)")
        );
        assert_eq!(
            describe_waker(Some(&task), 100_000).as_deref(),
            Some("hot/7 (syscall 100000)")
        );
        assert_eq!(describe_waker(Some(&task), waker::TASK).as_deref(), Some("hot/7"));
        assert_eq!(
            describe_waker(Some(&task), waker::KERNEL_THREAD).as_deref(),
            Some("hot/7 (kernel thread)")
        );
        assert_eq!(describe_waker(None, libc::SYS_futex as i32), None);
        assert!(!waker_is_task(waker::TIMER) && !waker_is_task(waker::SOFTIRQ));
        assert!(waker_is_task(libc::SYS_write as i32) && waker_is_task(waker::TASK));
    }

    fn comm(s: &str) -> [u8; COMM_LEN] {
        let mut c = [0; COMM_LEN];
        c[..s.len()].copy_from_slice(s.as_bytes());
        c
    }

    /// An on-CPU sample of thread 2 ("hot") at `ts` with a missing
    /// kernel stack and user stack `user`.
    pub(crate) fn sample_at(ts: u64, user: i32) -> Event {
        Event::Sample(CpuSample {
            kind: EventKind::CpuSample as u32,
            cpu: 0,
            ts_ns: ts,
            tgid: 1,
            tid: 2,
            user_stack_id: user,
            kernel_stack_id: -14,
            comm: comm("hot"),
        })
    }

    fn off(tid: u32, start: u64, end: u64, state: u32) -> OffCpuInterval {
        OffCpuInterval {
            kind: EventKind::OffCpu as u32,
            cpu: 0,
            start_ns: start,
            end_ns: end,
            tgid: 1,
            tid,
            user_stack_id: -14,
            kernel_stack_id: 7,
            state,
            waker_tid: 9,
            waker_tgid: 1,
            waker_context: -1,
            comm: comm("sleeper"),
            waker_comm: comm("waker"),
            woken_ns: 0,
            ran_tid: 0,
            ran_tgid: 0,
            ran_flags: 0,
            _pad: 0,
            ran_comm: [0; COMM_LEN],
        }
    }

    #[test]
    fn counts_and_names_with_missing_and_lost_stacks() {
        let mut agg = Aggregator::new();
        for _ in 0..3 {
            agg.ingest(&sample_at(1, -17));
        }
        agg.ingest(&Event::OffCpu(off(3, 100, 2_100, 1)));
        agg.ingest(&Event::OffCpu(off(3, 5_000, 6_000, 0)));
        assert_eq!(agg.stack_ids().unwrap(), HashSet::from([7]));
        let mut sym = Symbolizer::new();
        // Stack 7 was never read back from the kernel.
        let p = agg.resolve(&StackTable::new(), &mut sym).unwrap();
        assert_eq!(p.oncpu.to_text(), "hot;[user stack lost] 3\n");
        assert_eq!(p.offcpu.total(), 3_000);
        assert_eq!(p.offcpu.total_where(|f| f.starts_with("[preempted")), 1_000);
        assert!(p.offcpu.total_where(|f| f == "[kernel stack missing]") == 3_000);
        let longest = agg.longest_intervals();
        assert_eq!(longest[0].duration_ns, 2_000);
        assert_eq!(longest[0].waker.as_deref(), Some("waker/9"));
        assert_eq!(agg.threads()[0].comm, "hot");
    }

    #[test]
    fn slots_get_their_samples_and_split_intervals() {
        use crate::slots::Timeline;
        let mut agg = Aggregator::new();
        for ts in [5, 15, 16, 17, 99] {
            agg.ingest(&sample_at(ts, -14));
        }
        // 8..25 spans slot 0 (2 ns), slot 1 (10 ns) and slot 2 (5 ns).
        agg.ingest(&Event::OffCpu(off(3, 8, 25, 1)));
        let t = Timeline::clock(std::time::Duration::from_nanos(10), 0, None, 0, 30);
        let mut sym = Symbolizer::new();
        let per = agg.resolve_slots(&t, &StackTable::new(), &mut sym).unwrap();
        let on: Vec<u64> = per.iter().map(|p| p.oncpu.total()).collect();
        let off: Vec<u64> = per.iter().map(|p| p.offcpu.total()).collect();
        assert_eq!(on, [1, 3, 0]); // ts 99 is outside every slot
        assert_eq!(off, [2, 10, 5]);
        assert_eq!(agg.span().unwrap(), Some((5, 99)));
    }

    /// Waits folded in the kernel: their time, not their span, in the
    /// session's profile and the thread's totals; in the slots, their time
    /// spread evenly over their span.
    #[test]
    fn folded_waits_count_their_time_spread_over_their_span() {
        use crate::slots::Timeline;
        let mut agg = Aggregator::new();
        let fold = OffCpuFold {
            kind: EventKind::OffCpuFold as u32,
            cpu: 0,
            first_start_ns: 0,
            last_end_ns: 40,
            tgid: 1,
            tid: 3,
            offcpu_ns: 20,
            runnable_ns: 2,
            intervals: 6,
            kernel_stack_id: profiler_ebpf::KERNEL_STACK_SYSCALL_WAIT - 202,
            user_stack_id: -14,
            state: 1,
            ip: 1,
            sp: 2,
            bp: 3,
            comm: comm("idle"),
        };
        agg.ingest(&Event::OffCpuFold(fold));
        assert_eq!(
            (agg.offcpu_intervals, agg.offcpu_folded, agg.offcpu_folds),
            (6, 6, 1)
        );
        assert_eq!((agg.offcpu_ns, agg.threads()[0].offcpu_ns), (20, 20));
        let mut sym = Symbolizer::new();
        let p = agg.resolve(&StackTable::new(), &mut sym).unwrap();
        assert_eq!(p.offcpu.total(), 20);
        // Slots of 10 ns: 0..10, 10..20, 20..30, 30..40, and 40..50 past it.
        let t = Timeline::clock(std::time::Duration::from_nanos(10), 0, None, 0, 50);
        let per = agg.resolve_slots(&t, &StackTable::new(), &mut sym).unwrap();
        let off: Vec<u64> = per.iter().map(|p| p.offcpu.total()).collect();
        assert_eq!(off, [5, 5, 5, 5, 0]);
        // Not the detectors': they read intervals one by one.
        assert!(agg.intervals().of_threads(&[3]).unwrap().is_empty());
        // A record with no time (a part of a fold with none) counts nothing.
        agg.fold(&OffCpuFold { offcpu_ns: 0, ..fold });
        assert_eq!(agg.offcpu_folds, 1);
    }

    #[test]
    fn slots_counted_in_several_passes_get_what_one_pass_gives() {
        use crate::slots::Timeline;
        let n = SLOTS_PER_PASS as u64 * 2 + 10;
        let mut agg = Aggregator::new();
        for ts in [
            0,
            5,
            10 * (SLOTS_PER_PASS as u64 - 1) + 3,
            10 * SLOTS_PER_PASS as u64,
            10 * n - 1,
        ] {
            agg.ingest(&sample_at(ts, -14));
        }
        // Across the first pass's last slot into the second pass.
        let across = 10 * (SLOTS_PER_PASS as u64 - 2) + 4;
        agg.ingest(&Event::OffCpu(off(3, across, across + 30, 1)));
        let t = Timeline::clock(std::time::Duration::from_nanos(10), 0, None, 0, 10 * n);
        let mut sym = Symbolizer::new();
        let per = agg.resolve_slots(&t, &StackTable::new(), &mut sym).unwrap();
        assert_eq!(per.len() as u64, n);
        let on: Vec<(usize, u64)> = per
            .iter()
            .enumerate()
            .filter(|(_, p)| p.oncpu.total() > 0)
            .map(|(i, p)| (i, p.oncpu.total()))
            .collect();
        let s = SLOTS_PER_PASS;
        assert_eq!(on, [(0, 2), (s - 1, 1), (s, 1), (n as usize - 1, 1)]);
        let off: Vec<(usize, u64)> = per
            .iter()
            .enumerate()
            .filter(|(_, p)| p.offcpu.total() > 0)
            .map(|(i, p)| (i, p.offcpu.total()))
            .collect();
        assert_eq!(off, [(s - 2, 6), (s - 1, 10), (s, 10), (s + 1, 4)]);
    }
}
