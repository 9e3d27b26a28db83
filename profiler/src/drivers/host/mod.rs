//! `slotprof host`: run on the hypervisor host, find what the host's memory
//! management does to its VMs — the reference incident's biggest loss
//! (kcompactd migrating a validator VM's locked memory, each migration
//! invalidating the VM's KVM mappings).
//!
//! System-wide probes on kvm:kvm_unmap_hva_range, compaction and page
//! migration. This driver turns each probe record into a
//! `HostSample` (its fields by this kernel's layouts, the kernel stack of
//! the task that caused it named and classified, the range attributed to
//! the VM process whose memory it hit, [`vms`]); the kernel-free rest is
//! the detector's (`detectors::kvm_mmu_invalidation`: per-second counts,
//! the duty cycle of the bursts, a `KvmMmuInvalidation` finding per
//! affected VM with the two sysctls that govern it), which `replay` runs
//! on a recording of the samples. Written by [`outputs`]: the per-second
//! CSV/JSON series, a plot ([`plot`]) and the summary.
//!
//! Not here: anything of a guest's own (its slots, stacks and detectors:
//! `session`, `run`); a guest sees the host only as slow phases (`phase`).

mod outputs;
pub mod plot;
pub mod vms;

pub use outputs::{series_csv, HostLost, HostOutcome, HostSummary};
use outputs::{vm_list, vm_list_one, write_outputs, Ended};

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::IsTerminal,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context;
use profiler_ebpf::{host_tp, HostEvent, HOST_RAW_WORDS};
use serde::Serialize;
use symbolizer::Symbolizer;
use tokio::signal::unix::SignalKind;

use self::vms::Vmms;
use crate::{
    detectors::kvm_mmu_invalidation::{
        analysis::{duty_cycle, DutyCycle, Series, Sysctls, VmInfo},
        detect,
        source::{self, Source},
        HostFinding, HostSample, HostWhat, InvalidationCounts, InvalidationTotals,
    },
    export::report::ProbeCost,
    kernel::events::{self, comm_str},
    kernel::probes::{ProbeStatus, Probes},
    kernel::tracefs,
    output::write_atomic,
    slots::monotonic_ns,
};

/// How a host session runs.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// Stop after this long; `None` runs until Ctrl-C or SIGTERM.
    pub duration: Option<Duration>,
    pub out: PathBuf,
    /// Watch only these VM processes (default: every process holding a
    /// KVM VM).
    pub vm_pids: Vec<u32>,
    pub probe_stats: bool,
    /// Keep the classified samples for replay (`--save-replay`).
    pub save_replay: Option<PathBuf>,
}

/// Where the fields this mode reads sit in each tracepoint's record on this
/// kernel (offsets into the record; the raw words start at offset 8).
#[derive(Clone, Copy, Debug, Default)]
pub struct Layouts {
    unmap_start: Option<tracefs::Field>,
    unmap_end: Option<tracefs::Field>,
    isolate_scanned: Option<tracefs::Field>,
    isolate_taken: Option<tracefs::Field>,
    migrate_succeeded: Option<tracefs::Field>,
    migrate_failed: Option<tracefs::Field>,
    migrate_reason: Option<tracefs::Field>,
}

impl Layouts {
    pub fn read(tracefs: &Path) -> Self {
        let field = |cat: &str, name: &str, f: &str, size: u32| {
            tracefs::Format::read(tracefs, cat, name)
                .and_then(|fmt| fmt.field(f, size))
                .ok()
        };
        Self {
            unmap_start: field("kvm", "kvm_unmap_hva_range", "start", 8),
            unmap_end: field("kvm", "kvm_unmap_hva_range", "end", 8),
            isolate_scanned: field(
                "compaction",
                "mm_compaction_isolate_migratepages",
                "nr_scanned",
                8,
            ),
            isolate_taken: field("compaction", "mm_compaction_isolate_migratepages", "nr_taken", 8),
            migrate_succeeded: field("migrate", "mm_migrate_pages", "succeeded", 8),
            migrate_failed: field("migrate", "mm_migrate_pages", "failed", 8),
            migrate_reason: field("migrate", "mm_migrate_pages", "reason", 4),
        }
    }
}

/// Reads a field out of an event's raw record words (little-endian bytes
/// from record offset 8); `None` when the field lies past what was copied.
fn field(raw: &[u64; HOST_RAW_WORDS], f: Option<tracefs::Field>) -> Option<u64> {
    let f = f?;
    let start = (f.offset as usize).checked_sub(8)?;
    let end = start + f.size as usize;
    if end > HOST_RAW_WORDS * 8 || f.size > 8 {
        return None;
    }
    let mut bytes = [0u8; HOST_RAW_WORDS * 8];
    for (chunk, w) in bytes.chunks_exact_mut(8).zip(raw) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    let mut v = [0u8; 8];
    v[..f.size as usize].copy_from_slice(&bytes[start..end]);
    Some(u64::from_le_bytes(v))
}

/// `enum migrate_reason`: MR_COMPACTION.
const MR_COMPACTION: u64 = 0;

/// Turns probe records into [`HostSample`]s: their fields by this kernel's
/// layouts, their kernel stacks named and classified (once per stack and
/// task name), their ranges attributed to the VM processes.
struct Classifier {
    layouts: Layouts,
    /// (kernel stack id, comm) -> (source, index into the stacks).
    sources: HashMap<(i32, [u8; 16]), (Source, u32)>,
}

impl Classifier {
    fn sample(
        &mut self,
        e: &HostEvent,
        vms: &Vmms,
        probes: &Probes,
        sym: &mut Symbolizer,
        stacks: &mut Vec<Vec<String>>,
    ) -> HostSample {
        let (source, stack) = *self
            .sources
            .entry((e.kernel_stack_id, e.comm))
            .or_insert_with(|| {
                let frames: Vec<String> = probes
                    .stack(e.kernel_stack_id)
                    .unwrap_or_default()
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &addr)| sym.kernel_frame(addr, i > 0).to_vec())
                    .collect();
                let source = source::classify(&frames, &comm_str(&e.comm));
                // Root first, as in every other stack slotprof writes.
                stacks.push(frames.into_iter().rev().collect());
                (source, stacks.len() as u32 - 1)
            });
        let l = self.layouts;
        let what = match e.tracepoint {
            host_tp::KVM_UNMAP => match (field(&e.raw, l.unmap_start), field(&e.raw, l.unmap_end)) {
                (Some(start), Some(end)) => HostWhat::Unmap {
                    pages: end.saturating_sub(start).div_ceil(4096).max(1),
                    attribution: vms.attribute(start, end),
                },
                _ => HostWhat::Malformed,
            },
            host_tp::COMPACT_ISOLATE => HostWhat::Isolate {
                scanned: field(&e.raw, l.isolate_scanned).unwrap_or(0),
                taken: field(&e.raw, l.isolate_taken).unwrap_or(0),
            },
            host_tp::COMPACT_BEGIN => HostWhat::CompactBegin,
            host_tp::MIGRATE => HostWhat::Migrate {
                succeeded: field(&e.raw, l.migrate_succeeded).unwrap_or(0),
                failed: field(&e.raw, l.migrate_failed).unwrap_or(0),
                for_compaction: field(&e.raw, l.migrate_reason).map(|r| r as u32 as u64)
                    == Some(MR_COMPACTION),
            },
            _ => HostWhat::Other,
        };
        HostSample {
            ts_ns: e.ts_ns,
            tgid: e.tgid,
            comm: comm_str(&e.comm),
            source,
            stack,
            what,
        }
    }
}

/// The two sysctls now.
pub fn read_sysctls() -> Sysctls {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/vm/{name}"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    Sysctls {
        compact_unevictable_allowed: read("compact_unevictable_allowed"),
        compaction_proactiveness: read("compaction_proactiveness"),
    }
}

/// Runs a host session.
pub async fn run(opts: &HostOptions) -> anyhow::Result<HostOutcome> {
    let tracefs = tracefs::ensure_mounted()?;
    let layouts = Layouts::read(&tracefs);
    let sysctls_at_start = read_sysctls();
    let mut vms = Vmms::new(opts.vm_pids.clone());
    vms.refresh();
    for pid in &opts.vm_pids {
        anyhow::ensure!(
            vms.vmms.contains_key(pid),
            "--vm-pid {pid}: cannot read /proc/{pid}/maps (is the process running, and is slotprof root?)"
        );
    }
    // The event stream every mode reads: a thread of its own copies the
    // ring's records out (compaction bursts make 100k+ records a second),
    // started before the first probe is attached.
    let (probes, mut ring) = Probes::load_host(opts.probe_stats)?;
    let warnings: Vec<String> = probes
        .status
        .iter()
        .filter(|p| !p.attached)
        .map(|p| {
            format!(
                "{} on {} did not attach ({}); that series stays empty",
                p.program,
                p.event,
                p.error.as_deref().unwrap_or("unknown error")
            )
        })
        .collect();
    for w in &warnings {
        eprintln!("slotprof: warning: {w}");
    }
    if !probes.status[0].attached {
        eprintln!(
            "slotprof: warning: without kvm:kvm_unmap_hva_range there are no KVM invalidations to \
             count (is the kvm module loaded? `modprobe kvm`)"
        );
    }
    let started = Instant::now();
    let mut state = InvalidationCounts::new(monotonic_ns());
    let mut classifier = Classifier {
        layouts,
        sources: HashMap::new(),
    };
    let mut saved = opts.save_replay.as_ref().map(|_| Vec::new());
    eprintln!(
        "slotprof: watching the host's memory management for {}; VMs: {}; Ctrl-C stops",
        opts.duration
            .map_or("as long as it runs".to_string(), |d| format!(
                "{:.0} s",
                d.as_secs_f64()
            )),
        vm_list(&vms)
    );
    let mut sym = Symbolizer::new();
    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
    let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let deadline = opts.duration.map(|d| tokio::time::Instant::now() + d);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let progress = std::io::stderr().is_terminal();
    let mut ticks = 0u64;
    let ended_by = loop {
        tokio::select! {
            Some(batch) = ring.recv() => {
                for item in batch.records() {
                    take(item, &mut state, &mut classifier, &mut saved, (&vms, &probes, &mut sym));
                }
            }
            _ = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => break "duration",
            _ = sigint.recv() => break "interrupt",
            _ = sigterm.recv() => break "SIGTERM",
            _ = tick.tick() => {
                ticks += 1;
                if ticks.is_multiple_of(5) {
                    for pid in vms.refresh() {
                        eprintln!("slotprof: new VM process: {}", vm_list_one(&vms, pid));
                    }
                }
                if progress {
                    eprint!(
                        "\rslotprof: {:.0} s, {} pages invalidated, {} compaction runs   ",
                        started.elapsed().as_secs_f64(),
                        state.totals.invalidated_pages,
                        state.totals.compaction_runs
                    );
                }
            }
        }
    };
    if progress {
        eprintln!();
    }
    // Detach first, then write: nothing of ours stays in the kernel even if
    // writing fails.
    let counters = probes.counters().unwrap_or_default();
    let costs = opts.probe_stats.then(|| probes.costs());
    let probe_status = probes.status.clone();
    // The last records: the reader's last read of the ring, then what it
    // queued.
    let ring_back = ring.finish();
    while let Some(batch) = ring.try_recv() {
        for item in batch.records() {
            take(
                item,
                &mut state,
                &mut classifier,
                &mut saved,
                (&vms, &probes, &mut sym),
            );
        }
    }
    let backlog_full = ring.dropped();
    drop(ring_back);
    drop(ring);
    drop(probes);
    let ended = Ended {
        elapsed: started.elapsed(),
        ended_by,
        sysctls_at_start,
        counters,
        probe_status,
        costs,
        backlog_full,
    };
    write_outputs(opts, state, vms, ended, warnings, saved)
}

/// One ring-buffer record into the counts (and the recording, when one is
/// kept).
fn take(
    item: &[u8],
    state: &mut InvalidationCounts,
    classifier: &mut Classifier,
    saved: &mut Option<Vec<HostSample>>,
    (vms, probes, sym): (&Vmms, &Probes, &mut Symbolizer),
) {
    match events::decode(item) {
        Some(events::Event::Host(e)) => {
            let sample = classifier.sample(&e, vms, probes, sym, &mut state.stacks);
            state.ingest(&sample);
            if let Some(saved) = saved {
                saved.push(sample);
            }
        }
        _ => state.malformed += 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_from_raw_words_by_layout() {
        let mut raw = [0u64; HOST_RAW_WORDS];
        raw[0] = 0x7f00_0000_1000; // offset 8
        raw[1] = 0x7f00_0000_3000; // offset 16
        raw[6] = 0x0000_0003_0000_0000; // a 4-byte field at offset 60
        let f = |offset, size| Some(tracefs::Field { offset, size });
        assert_eq!(field(&raw, f(8, 8)), Some(0x7f00_0000_1000));
        assert_eq!(field(&raw, f(16, 8)), Some(0x7f00_0000_3000));
        assert_eq!(field(&raw, f(60, 4)), Some(3));
        assert_eq!(field(&raw, f(72, 8)), None, "past what the probe copies");
        assert_eq!(field(&raw, f(4, 4)), None, "inside the common header");
        assert_eq!(field(&raw, None), None);
    }

    #[test]
    fn csv_has_a_column_per_source_and_vm() {
        let mut series = Series::default();
        let s = series.at(1);
        s.invalidated_pages = 10;
        s.invalidated_by_source.insert("manual-compaction".into(), 10);
        s.invalidated_by_vm.insert(42, 10);
        s.scanned_by_source.insert("manual-compaction".into(), 300);
        s.isolated_by_source.insert("manual-compaction".into(), 12);
        let csv = series_csv(&series);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].ends_with(
            ",invalidated_pages_manual-compaction,invalidated_pages_vm42,\
             compaction_scanned_manual-compaction,compaction_isolated_manual-compaction"
        ));
        assert_eq!(lines[1], "0,0,0,0,0,0,0,0,0,0,0,0");
        assert_eq!(lines[2], "1,10,0,0,0,0,0,0,10,10,300,12");
    }
}
