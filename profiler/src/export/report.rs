//! The files a session leaves behind, and `summary.json`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use flamegraphs::{
    pprof::{self, ProfileMeta, SampleType},
    svg::{self, SvgOptions},
};
use serde::Serialize;

use crate::{
    kernel::probes::{Counters, ProbeStatus, ProgramCost},
    output::write_atomic,
    pipeline::aggregate::{LongInterval, Profiles, Row, ThreadTotals},
};

/// Everything `summary.json` records about a session.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub slotprof_version: &'static str,
    /// `uname -r`.
    pub kernel: String,
    pub command: &'static str,
    pub target: TargetSummary,
    /// Seconds from probes attached to probes detached.
    pub duration_s: f64,
    /// "duration", "interrupted" (SIGINT/SIGTERM) or "target exited".
    pub ended_by: &'static str,
    pub freq_hz: u64,
    pub min_offcpu_ms: f64,
    pub probes: Vec<ProbeStatus>,
    /// The probes' own cost, when `--probe-stats` was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_cost: Option<ProbeCost>,
    pub counts: EventCounts,
    pub lost: Lost,
    pub frame_pointers: FramePointers,
    /// How user stacks were taken and unwound, per module.
    pub unwinding: Unwinding,
    /// Threads of the target, busiest first.
    pub threads: Vec<ThreadTotals>,
    pub longest_offcpu: Vec<LongInterval>,
    /// Findings by kind (the findings themselves are in findings.json).
    pub findings: std::collections::BTreeMap<&'static str, u64>,
    /// madvise calls per thread: what the purge detector saw.
    pub madvise_by_thread: Vec<MadviseTotals>,
    /// TLB flushes and shootdown IPIs caused by the target's threads.
    pub tlb: Tlb,
    /// How the cache-line detector saw memory, and on what topology.
    pub cache_lines: CacheLines,
    /// The guest-side phase probe's findings (`--phase-probe`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_probe: Option<PhaseProbe>,
    /// false while the outputs are being written (summary.json is
    /// written first), and when one of them could not be.
    pub complete: bool,
    pub outputs: Vec<String>,
    /// Outputs that could not be written (a full disk), with why.
    pub missing: Vec<MissingOutput>,
    /// Things the operator should know, in plain words.
    pub warnings: Vec<String>,
    /// Each push endpoint's counts (`--push-pyroscope`, `--push-otlp`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub push: Vec<serde_json::Value>,
}

/// An output that could not be written.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MissingOutput {
    pub path: String,
    pub error: String,
}

/// The kernel's accounting of the probes' run time.
#[derive(Debug, Serialize)]
pub struct ProbeCost {
    pub programs: Vec<ProgramCost>,
    /// All programs' run time as a share of the machine's CPU time over the
    /// session, in percent.
    pub cpu_percent: f64,
}

impl ProbeCost {
    pub fn new(programs: Vec<ProgramCost>, elapsed: std::time::Duration) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let total: u64 = programs.iter().map(|p| p.total_ns).sum();
        let cpu_percent = 100.0 * total as f64 / (elapsed.as_nanos() as f64 * cpus).max(1.0);
        Self {
            programs,
            cpu_percent: (cpu_percent * 10_000.0).round() / 10_000.0,
        }
    }
}

/// madvise totals of one thread.
#[derive(Debug, Serialize)]
pub struct MadviseTotals {
    pub tid: u32,
    pub thread: String,
    pub calls: u64,
    /// Calls with MADV_DONTNEED or MADV_FREE (the purges).
    pub purge_calls: u64,
    pub bytes: u64,
    pub ms: f64,
    pub purge_ms: f64,
    pub tlb_flushes: u64,
    pub shootdown_ipis: u64,
}

/// Per-thread madvise totals, most time first.
pub fn madvise_by_thread(
    calls: &[profiler_ebpf::MadviseCall],
    names: &std::collections::HashMap<u32, String>,
) -> Vec<MadviseTotals> {
    let mut by: std::collections::BTreeMap<u32, MadviseTotals> = std::collections::BTreeMap::new();
    for c in calls {
        let t = by.entry(c.tid).or_insert_with(|| MadviseTotals {
            tid: c.tid,
            thread: names
                .get(&c.tid)
                .cloned()
                .unwrap_or_else(|| crate::kernel::events::comm_str(&c.comm)),
            calls: 0,
            purge_calls: 0,
            bytes: 0,
            ms: 0.0,
            purge_ms: 0.0,
            tlb_flushes: 0,
            shootdown_ipis: 0,
        });
        let ms = c.end_ns.saturating_sub(c.start_ns) as f64 / 1e6;
        t.calls += 1;
        t.bytes += c.len;
        t.ms += ms;
        if crate::detectors::sync_allocator_purge::is_purge(c.behavior) {
            t.purge_calls += 1;
            t.purge_ms += ms;
        }
        t.tlb_flushes += c.tlb_local as u64;
        t.shootdown_ipis += c.tlb_ipis as u64;
    }
    let mut v: Vec<_> = by.into_values().collect();
    v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    v
}

/// What the phase probe found, and how the session's slots and findings
/// fall into its slow phase.
#[derive(Debug, Serialize)]
pub struct PhaseProbe {
    pub every_ms: f64,
    pub burst_ms: f64,
    pub windows: usize,
    pub cpus: Vec<crate::phase::analysis::CpuPhases>,
    pub slow_slots: usize,
    pub slots: usize,
    pub findings_in_slow_phase: usize,
    pub findings: usize,
}

/// The cache-line detector's view.
#[derive(Debug, Serialize)]
pub struct CacheLines {
    #[serde(flatten)]
    pub path: crate::topology::CacheLinePath,
    /// "sysfs" or the --topology file.
    pub topology: String,
    /// User-mode samples with registers, and the memory accesses decoded
    /// from them.
    pub samples_with_registers: usize,
    pub decoded_accesses: usize,
    /// Per sample: what decoding made of it.
    pub decoding: crate::detectors::memory_access::DecodeStats,
}

/// TLB work caused by the target.
#[derive(Debug, Default, Serialize)]
pub struct Tlb {
    pub flushes: u64,
    pub shootdown_ipis: u64,
}

#[derive(Debug, Serialize)]
pub struct TargetSummary {
    pub pid: u32,
    pub comm: String,
    pub exe: Option<PathBuf>,
    /// The target exited before the session ended.
    pub exited: bool,
    /// Seconds into the session when it was seen gone.
    pub exited_after_s: Option<f64>,
    /// A kernel thread: no user stacks, nothing for most detectors.
    pub kernel_thread: bool,
    /// Programs it exec()ed during the session (`comm` and `exe` above
    /// are the last one's); the profile holds all of them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub execs: Vec<ExecSummary>,
}

/// An exec of the target seen during the session.
#[derive(Clone, Debug, Serialize)]
pub struct ExecSummary {
    /// Seconds into the session when it was seen (checked every second).
    pub seen_after_s: f64,
    pub from_comm: String,
    pub from_exe: Option<PathBuf>,
    pub comm: String,
    pub exe: Option<PathBuf>,
}

#[derive(Debug, Default, Serialize)]
pub struct EventCounts {
    pub oncpu_samples: u64,
    /// Off-CPU intervals (the folded ones included) and their time.
    pub offcpu_intervals: u64,
    pub offcpu_ns: u64,
    /// Of `offcpu_intervals`, short waits the kernel folded (`--offcpu
    /// folded`), and the records they came in.
    pub offcpu_folded: u64,
    pub offcpu_folds: u64,
    pub oncpu_stacks: usize,
    pub offcpu_stacks: usize,
    /// Bytes of off-CPU intervals kept in slotprof's unnamed temporary
    /// file rather than in memory (the newest 65,536 stay in memory).
    pub offcpu_interval_file_bytes: u64,
    /// slotprof's own peak resident memory over the session (VmHWM).
    pub peak_rss_bytes: u64,
    /// Samples the kernel counted for the target (userspace received
    /// `oncpu_samples` of them; the difference is in `lost`).
    pub kernel_samples: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct Lost {
    pub ring_buffer_full: u64,
    /// Copied out of the ring but dropped: slotprof's own queue was at its
    /// bound (its processing stopped for seconds).
    pub backlog_full: u64,
    pub stacks: u64,
    pub offcpu_map_full: u64,
    pub syscall_map_full: u64,
    pub malformed_records: u64,
    pub total: u64,
}

impl Lost {
    pub fn new(c: &Counters, malformed: u64, backlog_full: u64) -> Self {
        Self {
            ring_buffer_full: c.ring_full,
            backlog_full,
            stacks: c.stack_lost,
            offcpu_map_full: c.offcpu_start_lost,
            syscall_map_full: c.syscall_start_lost,
            malformed_records: malformed,
            total: c.lost() + malformed + backlog_full,
        }
    }
}

/// How user stacks were unwound: per module (CFI or frame pointers), how
/// stacks ended, and where the kernel copied them.
#[derive(Debug, Default, Serialize)]
pub struct Unwinding {
    /// "cfi" (.eh_frame / .debug_frame, frame pointers where no CFI covers
    /// a PC) per module, or which frame-pointer fallback and why.
    pub modules: Vec<ModuleUnwinding>,
    /// User stacks unwound, and how they ended.
    pub stacks: u64,
    /// Reached the thread's first frame.
    pub complete: u64,
    /// Longer than 128 frames: ended in `[truncated]`.
    pub truncated: u64,
    /// The 32 KiB copy ended first: `[stack copy ended]`.
    pub stack_copy_ended: u64,
    /// Stopped in code with neither CFI nor frame pointers: `[no unwind info] module+0xoff`.
    pub no_unwind_info: u64,
    /// Stopped on an inconsistent frame: `[unwind error]`.
    pub unwind_errors: u64,
    /// Frames in code no file backs (JIT, anonymous): unwound with frame pointers.
    pub anonymous_frames: u64,
    /// Stacks that began like one walked before and held the same words
    /// where that walk read: its frames, not walked again (exact).
    pub remembered: u64,
    /// Bytes of unwind sections held (.eh_frame, .eh_frame_hdr, .debug_frame).
    pub table_bytes: usize,
    /// Which way the stacks of reported records were taken.
    pub sources: crate::kernel::user_stacks::StackSources,
    /// The kernel's counts of copies made.
    pub kernel_copies_at_syscall_exit: u64,
    pub kernel_copies_at_switch_out: u64,
    pub kernel_copies_for_samples: u64,
    pub kernel_copies_failed: u64,
    /// Deferred copies dropped: the thread came back to user space another way.
    pub kernel_context_changed: u64,
    /// Copies not made: the ring buffer was over half full (a reader
    /// that could not keep up); those stacks say `[user stack not taken]`.
    pub kernel_copies_skipped_ring_busy: u64,
    /// Copies not made by a cpu-clock sample that interrupted another copy
    /// of the same thread on its CPU: the sample has that copy's stack.
    pub kernel_copies_nested: u64,
    /// System call exits not copied: the thread was back at its last exit
    /// copy's registers within `--stack-repeat` (the copy's stack is used).
    pub kernel_exit_repeats: u64,
    /// Short off-CPU waits the kernel folded, and the records they went
    /// out in (`--offcpu folded`).
    pub kernel_offcpu_folded: u64,
    pub kernel_offcpu_folds: u64,
}

#[derive(Debug, Serialize)]
pub struct ModuleUnwinding {
    pub module: String,
    pub unwinding: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
    pub frames: u64,
    pub no_unwind_info: u64,
    pub table_bytes: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Unwinding {
    pub fn new(user: &crate::kernel::user_stacks::UserStacks, c: &crate::kernel::probes::Counters) -> Self {
        let t = &user.unwinder.totals;
        Self {
            modules: user
                .unwinder
                .module_stats()
                .map(|(m, s)| ModuleUnwinding {
                    module: m.to_string(),
                    unwinding: s.unwinding.clone(),
                    build_id: s.build_id.clone(),
                    frames: s.frames,
                    no_unwind_info: s.no_unwind_info,
                    table_bytes: s.table_bytes,
                    note: s.note.clone(),
                })
                .collect(),
            stacks: t.stacks,
            complete: t.complete,
            truncated: t.truncated,
            stack_copy_ended: t.stack_copy_end,
            no_unwind_info: t.no_unwind_info,
            unwind_errors: t.errors,
            anonymous_frames: t.anonymous_frames,
            remembered: t.remembered,
            table_bytes: user.unwinder.table_bytes(),
            sources: user.sources.clone(),
            kernel_copies_at_syscall_exit: c.user_stacks_at_exit,
            kernel_copies_at_switch_out: c.user_stacks_at_switch_out,
            kernel_copies_for_samples: c.user_stacks_sampled,
            kernel_copies_failed: c.user_stack_copy_failed,
            kernel_context_changed: c.user_stack_context_changed,
            kernel_copies_skipped_ring_busy: c.user_stack_ring_busy,
            kernel_copies_nested: c.user_stack_nested,
            kernel_exit_repeats: c.user_stack_repeats,
            kernel_offcpu_folded: c.offcpu_folded,
            kernel_offcpu_folds: c.offcpu_folds,
        }
    }

    /// Whether the module named `label` is unwound with its CFI.
    pub fn has_cfi(&self, label: &str) -> bool {
        self.modules
            .iter()
            .any(|m| m.module == label && m.unwinding == "cfi")
    }
}

#[derive(Debug, Default, Serialize)]
pub struct FramePointers {
    pub binary: Option<PathBuf>,
    /// Functions whose prologue was checked, and the share that sets up a
    /// frame pointer; absent when the binary could not be read.
    pub functions_scanned: Option<usize>,
    pub share_with_frame_pointer: Option<f64>,
    /// Median user-stack depth seen in on-CPU samples.
    pub median_user_depth: Option<usize>,
    /// Our verdict: false means user stacks are probably cut short.
    pub present: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advice: Option<String>,
}

impl FramePointers {
    /// Combines the prologue scan with what the stacks looked like. Stacks
    /// are unwound with CFI where the binary has it: only a binary with
    /// neither gets the advice.
    pub fn judge(
        binary: Option<PathBuf>,
        scan: Option<symbolizer::frame_pointers::FramePointerScan>,
        median_user_depth: Option<usize>,
        has_cfi: bool,
    ) -> Self {
        let present = match (scan, median_user_depth) {
            (Some(s), _) => s.has_frame_pointers(),
            (None, Some(d)) => d > 2,
            (None, None) => true,
        };
        let advice = (!present && !has_cfi).then(|| {
            "the target has neither unwind information (.eh_frame) nor frame pointers, so its \
             user stacks stop at its first frame: rebuild it with RUSTFLAGS=\"-C \
             force-frame-pointers=yes\" (Rust) or -fno-omit-frame-pointer (C/C++), or keep its \
             .eh_frame (do not build with -fno-asynchronous-unwind-tables)"
                .to_string()
        });
        Self {
            binary,
            functions_scanned: scan.map(|s| s.functions),
            share_with_frame_pointer: scan.map(|s| (s.share() * 1000.0).round() / 1000.0),
            median_user_depth,
            present,
            advice,
        }
    }
}

/// A slot's labels on the samples of its pprof profiles (and of its
/// window's): `go tool pprof -tagfocus slot=N` selects them, a backend
/// filters by them.
#[derive(Clone, Debug)]
pub struct SlotLabels {
    pub slot: u64,
    pub leader: bool,
    /// "slow" or "fast", when the phase probe runs.
    pub phase: Option<&'static str>,
}

impl SlotLabels {
    pub fn of(slot: &crate::slots::Slot, phase: Option<&'static str>) -> Self {
        Self {
            slot: slot.number,
            leader: slot.leader,
            phase,
        }
    }

    pub fn labels(&self) -> Vec<(&'static str, pprof::LabelValue)> {
        use pprof::LabelValue::{Num, Str};
        let mut l = vec![
            // A unit, so that slot 0 is kept: Go's decoder drops a
            // numeric label of 0 without one; "count" scales to nothing,
            // so `-tagfocus slot=N` matches.
            ("slot", Num(self.slot as i64, Some("count"))),
            ("leader", Str(self.leader.to_string())),
        ];
        if let Some(phase) = self.phase {
            l.push(("phase", Str(phase.to_string())));
        }
        l
    }
}

/// A leader window's slots so far: each slot's profiles with its labels.
pub type WindowSlots = Vec<(Profiles, SlotLabels)>;

/// What a profile's pprof is made of: the profile itself, its samples
/// labelled with their thread (and CPU) only (a session, an hour), or with
/// its slot's labels too (a slot), or a leader window's slots, each sample
/// with its own slot's. `None`: no pprof file (its writer makes it: a
/// session's, labelled slot by slot).
#[derive(Clone, Copy)]
pub enum Parts<'a> {
    Whole,
    Slot(&'a SlotLabels),
    Window(&'a WindowSlots),
    None,
}

/// The pprof sample types of every profile: `samples/count`,
/// `cpu/nanoseconds` (samples x the sampling period) and
/// `offcpu/nanoseconds`.
pub fn pprof_types() -> [SampleType; 3] {
    [
        SampleType::new("samples", "count"),
        SampleType::new("cpu", "nanoseconds"),
        SampleType::new("offcpu", "nanoseconds"),
    ]
}

/// Adds `rows` to a profile: a sample per row, labelled with its thread
/// (`thread_name`, `thread_id`), its CPU (on-CPU samples) and `labels`
/// (a slot's).
pub fn add_rows<'r>(
    b: &mut pprof::Builder,
    rows: impl IntoIterator<Item = &'r Row>,
    period_ns: i64,
    labels: &[(&'static str, pprof::LabelValue)],
) {
    use pprof::LabelValue::Num;
    let mut all = Vec::with_capacity(labels.len() + 2);
    for r in rows {
        all.clear();
        // Numbers with a unit: Go's decoder drops a numeric label of 0
        // without one (CPU 0); "count" scales to nothing, so `-tagfocus
        // cpu=0` matches.
        if let Some(tid) = r.tid {
            all.push(("thread_id", Num(tid as i64, Some("count"))));
        }
        if let Some(cpu) = r.cpu {
            all.push(("cpu", Num(cpu as i64, Some("count"))));
        }
        all.extend(labels.iter().cloned());
        let samples = r.samples.min(i64::MAX as u64) as i64;
        let value = vec![
            samples,
            samples.saturating_mul(period_ns),
            r.offcpu_ns.min(i64::MAX as u64) as i64,
        ];
        let location_id = located(b, r).unwrap_or_else(|| b.folded_locations(&r.stack));
        b.thread_sample(&r.stack, location_id, value, &all);
    }
}

/// The locations of a row's stack, leaf first, with addresses: a user
/// frame's in its file mapping (with its build ID), its inlined calls as
/// lines of one location, and no name where none was found (left for
/// `go tool pprof -symbolize` or a backend's symbolizer); kernel frames and
/// markers by name. None where the row has no addresses (or they do not
/// add up to its names: then its names alone).
fn located(b: &mut pprof::Builder, r: &Row) -> Option<Vec<u64>> {
    let locs = r.locs.as_ref()?;
    let names: Vec<&str> = r.stack.split(';').skip(1).collect();
    if locs.iter().map(|l| l.names as usize).sum::<usize>() != names.len() {
        return None;
    }
    let mut ids = Vec::with_capacity(names.len());
    let mut at = 0;
    // A run's functions, innermost (its last name) first.
    let lines = |run: &[&str]| -> Vec<pprof::FrameLine> {
        run.iter()
            .rev()
            .map(|n| pprof::FrameLine {
                function: n.to_string(),
                ..Default::default()
            })
            .collect()
    };
    for l in locs.iter() {
        let run = &names[at..at + l.names as usize];
        at += l.names as usize;
        let id = match &l.module {
            Some(m) => {
                let mapping = b.mapping(&pprof::MappingInfo {
                    start: m.start,
                    limit: m.end,
                    offset: m.file_offset,
                    file: m.path.to_string(),
                    build_id: m.build_id.to_string(),
                });
                b.address_location(mapping, l.address, || {
                    if l.symbolized {
                        lines(run)
                    } else {
                        Vec::new()
                    }
                })
            }
            None if run.len() == 1 => b.named_location(run[0]),
            None => b.location(&pprof::Frame {
                address: 0,
                mapping: None,
                lines: lines(run),
            }),
        };
        ids.push(id);
    }
    ids.reverse();
    if ids.is_empty() {
        ids = b.folded_locations("");
    }
    Some(ids)
}

/// The pprof profile of `p` (or of its `parts`), unwritten: each sample
/// labelled with its thread, CPU and its part's labels.
pub fn pprof_profile(p: &Profiles, parts: Parts<'_>, meta: &ProfileMeta) -> pprof::Builder {
    let mut b = pprof::Builder::new(&pprof_types());
    let period = meta.period.max(0);
    match parts {
        // Summed by stack alone (an hour's): its folded stacks, by thread
        // name only.
        Parts::Whole if p.rows.is_empty() => pprof::add_part(
            &mut b,
            &pprof::Part {
                columns: vec![(&p.oncpu, 1), (&p.oncpu, period), (&p.offcpu, 1)],
                labels: Vec::new(),
            },
        ),
        Parts::Whole => add_rows(&mut b, &p.rows, period, &[]),
        Parts::Slot(l) => add_rows(&mut b, &p.rows, period, &l.labels()),
        Parts::Window(slots) => {
            for (p, l) in slots {
                add_rows(&mut b, &p.rows, period, &l.labels());
            }
        }
        Parts::None => {}
    }
    b
}

/// Writes the flamegraphs, the folded stacks and the pprof profile into
/// `dir`, and returns the paths written.
pub fn write_profiles(
    dir: &Path,
    p: &Profiles,
    parts: Parts<'_>,
    meta: &ProfileMeta,
    subtitle: &str,
) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create output directory {}", dir.display()))?;
    write_profiles_with(dir, p, parts, meta, subtitle, Draw::Now, write_atomic)
}

/// Whether the flamegraph SVGs are drawn with the rest, or left for
/// whoever opens them: `slotprof run` draws those of slots without
/// findings only when its server is asked for them (from the `.folded`
/// beside them), not for every slot of a node that leads often.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Draw {
    Now,
    OnRequest,
}

/// The flamegraph of a profile's on-CPU samples or its off-CPU time.
pub fn flame_options(offcpu: bool, subtitle: Option<&str>) -> SvgOptions {
    let (title, count_name, palette) = if offcpu {
        ("Off-CPU", "ns", "io")
    } else {
        ("On-CPU", "samples", "rust")
    };
    SvgOptions {
        title: title.into(),
        subtitle: subtitle.map(str::to_string),
        count_name: count_name.into(),
        palette: palette.into(),
    }
}

/// [`write_profiles`] into `dir`, each file through `write` (a new,
/// private directory published whole by one rename needs no atomic file
/// writes inside it); the first failure is the error.
pub fn write_profiles_with(
    dir: &Path,
    p: &Profiles,
    parts: Parts<'_>,
    meta: &ProfileMeta,
    subtitle: &str,
    draw: Draw,
    write: fn(&Path, &[u8]) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (path, result) in write_profiles_each(dir, p, parts, meta, subtitle, draw, write) {
        result?;
        written.push(path);
    }
    Ok(written)
}

/// Every profile file of `p` into `dir`, each tried whatever became of
/// the others (a full disk fails the big ones and may spare the small):
/// each path with how its write ended.
pub fn write_profiles_each(
    dir: &Path,
    p: &Profiles,
    parts: Parts<'_>,
    meta: &ProfileMeta,
    subtitle: &str,
    draw: Draw,
    write: fn(&Path, &[u8]) -> anyhow::Result<()>,
) -> Vec<(PathBuf, anyhow::Result<()>)> {
    let mut done = Vec::new();
    let mut put = |name: &str, bytes: anyhow::Result<Vec<u8>>| {
        let path = dir.join(name);
        let result = bytes.and_then(|b| write(&path, &b));
        done.push((path, result));
    };
    put("oncpu.folded", Ok(p.oncpu.to_text().into_bytes()));
    if draw == Draw::Now {
        put(
            "oncpu.svg",
            svg::render(&p.oncpu, &flame_options(false, Some(subtitle))),
        );
    }
    put("offcpu.folded", Ok(p.offcpu.to_text().into_bytes()));
    if draw == Draw::Now {
        put(
            "offcpu.svg",
            svg::render(&p.offcpu, &flame_options(true, Some(subtitle))),
        );
    }
    if !matches!(parts, Parts::None) {
        put(
            "profile.pb.gz",
            pprof_profile(p, parts, meta).gzip(meta).map_err(Into::into),
        );
    }
    done
}

/// `uname -r`.
pub use crate::sys::kernel_release;

/// This process's peak resident memory (VmHWM), 0 if unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
