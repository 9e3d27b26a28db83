//! KvmMmuInvalidation (`slotprof host`): the host invalidating a VM's KVM
//! mappings, by the kernel path that did it. The pure side of `host`: the
//! per-second counts of what the probes saw ([`InvalidationCounts`], fed classified
//! [`HostSample`]s), the duty cycle of the bursts ([`analysis`]), which
//! kernel path a stack is ([`source`]) and the finding per VM ([`detect`]).
//!
//! Not here: reading the probes, the kernel stacks and the VM processes'
//! memory maps (`host`, which turns each probe record into a
//! [`HostSample`]), so a recording of samples replays without a kernel.

pub mod analysis;
pub mod source;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use self::{
    analysis::{duty_cycle, DutyCycle, Series, SourceShare, Sysctls, VmInfo},
    source::Source,
};
use super::Finding;

/// A VM with fewer invalidated pages than this over the session gets no
/// finding (a VMM remapping a buffer now and then is not a problem).
pub const MIN_FINDING_PAGES: u64 = 1024;

/// Where an invalidated range landed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Attribution {
    /// In this VM process's guest memory.
    Vm(u32),
    /// In this VM process's own memory, not the guest's (its heap, stacks,
    /// code, small buffers): KVM maps no guest page there, so no vCPU pays
    /// for the invalidation.
    VmmOwn(u32),
    /// Several VM processes map these addresses.
    Ambiguous(Vec<u32>),
    /// No known VM process maps them.
    Unknown,
}

/// What one probe record said, once `host` has read its fields with this
/// kernel's layouts, classified its kernel stack and attributed its range.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostSample {
    pub ts_ns: u64,
    pub tgid: u32,
    pub comm: String,
    pub source: Source,
    /// The kernel stack: an index into [`InvalidationCounts::stacks`].
    pub stack: u32,
    pub what: HostWhat,
}

/// Which tracepoint, with the fields this mode reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum HostWhat {
    /// kvm_unmap_hva_range: `pages` invalidated, where they landed.
    Unmap { pages: u64, attribution: Attribution },
    /// mm_compaction_isolate_migratepages.
    Isolate { scanned: u64, taken: u64 },
    /// mm_compaction_begin.
    CompactBegin,
    /// mm_migrate_pages.
    Migrate {
        succeeded: u64,
        failed: u64,
        for_compaction: bool,
    },
    /// A kvm_unmap_hva_range record without its range.
    Malformed,
    /// Another tracepoint.
    Other,
}

/// Per VM and source: pages and who did it.
#[derive(Default)]
struct Part {
    pages: u64,
    tasks: BTreeSet<String>,
    stack: Vec<String>,
}

/// Everything counted so far.
pub struct InvalidationCounts {
    pub start_ns: u64,
    pub series: Series,
    /// Per-VM per-second invalidated pages come from the series; these are
    /// the totals by (vm pid, source).
    parts: BTreeMap<(u32, Source), Part>,
    /// Ranges more than one VM process maps: pages, by the set of pids.
    pub ambiguous: BTreeMap<Vec<u32>, u64>,
    pub totals: InvalidationTotals,
    pub malformed: u64,
    /// The kernel stacks samples point at, root first.
    pub stacks: Vec<Vec<String>>,
}

/// Session totals, for the summary.
#[derive(Clone, Debug, Default, Serialize)]
pub struct InvalidationTotals {
    pub events: u64,
    pub invalidations: u64,
    pub invalidated_pages: u64,
    pub invalidated_pages_by_source: BTreeMap<String, u64>,
    /// Invalidated pages in a known VM, in several, in none.
    pub attributed_pages: u64,
    pub ambiguous_pages: u64,
    pub unattributed_pages: u64,
    /// Invalidated pages in a VM process's own memory (heap, stacks, code,
    /// small buffers), not its guest RAM: no vCPU pays for them, so they
    /// make no finding.
    pub vmm_own_pages: u64,
    pub compaction_runs: u64,
    pub compaction_runs_by_source: BTreeMap<String, u64>,
    pub compaction_scanned: u64,
    pub compaction_isolated: u64,
    pub migrated: u64,
    pub migrated_for_compaction: u64,
    pub migrate_failed: u64,
    /// One kernel stack per source (root first): what each label stands for.
    pub stacks_by_source: BTreeMap<String, Vec<String>>,
}

impl InvalidationCounts {
    pub fn new(start_ns: u64) -> Self {
        Self {
            start_ns,
            series: Series::default(),
            parts: BTreeMap::new(),
            ambiguous: BTreeMap::new(),
            totals: InvalidationTotals::default(),
            malformed: 0,
            stacks: Vec::new(),
        }
    }

    /// Ends the series at `seconds` (a quiet end has no events to make
    /// its seconds): before [`detect`], which reads the duty cycle off it.
    pub fn end(&mut self, seconds: f64) {
        let seconds = seconds.ceil() as usize;
        if self.series.seconds.len() < seconds {
            self.series.at(seconds - 1);
        }
    }

    pub fn ingest(&mut self, e: &HostSample) {
        self.totals.events += 1;
        let sec = (e.ts_ns.saturating_sub(self.start_ns) / 1_000_000_000) as usize;
        let source = e.source;
        let label = source.label().to_string();
        if !self.totals.stacks_by_source.contains_key(&label) {
            let stack = self.stacks.get(e.stack as usize).cloned().unwrap_or_default();
            self.totals.stacks_by_source.insert(label.clone(), stack);
        }
        match &e.what {
            HostWhat::Unmap { pages, attribution } => self.unmap(e, sec, *pages, attribution),
            HostWhat::Malformed => self.malformed += 1,
            HostWhat::Isolate { scanned, taken } => {
                self.totals.compaction_scanned += scanned;
                self.totals.compaction_isolated += taken;
                let s = self.series.at(sec);
                s.compaction_scanned += scanned;
                s.compaction_isolated += taken;
                *s.scanned_by_source.entry(label.clone()).or_default() += scanned;
                *s.isolated_by_source.entry(label).or_default() += taken;
            }
            HostWhat::CompactBegin => {
                self.totals.compaction_runs += 1;
                *self.totals.compaction_runs_by_source.entry(label).or_default() += 1;
                self.series.at(sec).compaction_runs += 1;
            }
            HostWhat::Migrate {
                succeeded,
                failed,
                for_compaction,
            } => {
                self.totals.migrated += succeeded;
                self.totals.migrate_failed += failed;
                if *for_compaction {
                    self.totals.migrated_for_compaction += succeeded;
                }
                let s = self.series.at(sec);
                s.migrated += succeeded;
                s.migrate_failed += failed;
            }
            HostWhat::Other => {}
        }
    }

    fn unmap(&mut self, e: &HostSample, sec: usize, pages: u64, attribution: &Attribution) {
        let source = e.source;
        let label = source.label().to_string();
        let t = &mut self.totals;
        t.invalidations += 1;
        t.invalidated_pages += pages;
        *t.invalidated_pages_by_source.entry(label.clone()).or_default() += pages;
        let vm = match attribution {
            Attribution::Vm(pid) => {
                t.attributed_pages += pages;
                *pid
            }
            Attribution::VmmOwn(_) => {
                t.vmm_own_pages += pages;
                let s = self.series.at(sec);
                s.invalidations += 1;
                s.invalidated_pages += pages;
                *s.invalidated_by_source.entry(label).or_default() += pages;
                return;
            }
            Attribution::Ambiguous(pids) => {
                t.ambiguous_pages += pages;
                *self.ambiguous.entry(pids.clone()).or_default() += pages;
                0
            }
            Attribution::Unknown => {
                t.unattributed_pages += pages;
                0
            }
        };
        let s = self.series.at(sec);
        s.invalidations += 1;
        s.invalidated_pages += pages;
        *s.invalidated_by_source.entry(label).or_default() += pages;
        *s.invalidated_by_vm.entry(vm).or_default() += pages;
        if source == Source::OwnUnmap {
            // The VM process freeing its own memory (heap, buffers, a
            // balloon): in the totals and the series, not in a finding
            // about what the host does to the VM.
            return;
        }
        let task = match source {
            Source::ManualCompaction | Source::DirectCompaction | Source::Other | Source::OwnUnmap => {
                format!("{} (pid {})", e.comm, e.tgid)
            }
            _ => e.comm.clone(),
        };
        let part = self.parts.entry((vm, source)).or_default();
        part.pages += pages;
        if part.tasks.len() < 8 {
            part.tasks.insert(task);
        }
        if part.stack.is_empty() {
            part.stack = self.stacks.get(e.stack as usize).cloned().unwrap_or_default();
        }
    }
}

/// A `KvmMmuInvalidation` finding: the common fields, and the host's side.
#[derive(Clone, Debug, Serialize)]
pub struct HostFinding {
    #[serde(flatten)]
    pub finding: Finding,
    pub vm: VmInfo,
    pub sources: Vec<SourceShare>,
    pub duty_cycle: DutyCycle,
    pub sysctls: Sysctls,
}

/// Builds the findings: one per VM with at least [`MIN_FINDING_PAGES`].
pub fn detect(
    state: &InvalidationCounts,
    vms: &BTreeMap<u32, VmInfo>,
    sysctls: &Sysctls,
    seconds: f64,
) -> Vec<HostFinding> {
    let mut by_vm: BTreeMap<u32, Vec<(Source, &Part)>> = BTreeMap::new();
    for ((vm, source), part) in &state.parts {
        by_vm.entry(*vm).or_default().push((*source, part));
    }
    let mut out = Vec::new();
    for (vm, mut parts) in by_vm {
        let pages: u64 = parts.iter().map(|(_, p)| p.pages).sum();
        if pages < MIN_FINDING_PAGES {
            continue;
        }
        parts.sort_by_key(|p| std::cmp::Reverse(p.1.pages));
        let per_second: Vec<u64> = state
            .series
            .seconds
            .iter()
            .map(|s| *s.invalidated_by_vm.get(&vm).unwrap_or(&0))
            .collect();
        let duty = duty_cycle(&per_second);
        let info = vms.get(&vm).cloned().unwrap_or_else(|| VmInfo {
            pid: 0,
            comm: if state.totals.ambiguous_pages > 0 {
                "a VM process slotprof cannot single out (several map these addresses)".into()
            } else {
                "no VM process found that maps these addresses (use --vm-pid)".into()
            },
            ..Default::default()
        });
        let sources: Vec<SourceShare> = parts
            .iter()
            .map(|(s, p)| SourceShare {
                source: s.label().to_string(),
                tasks: p.tasks.iter().cloned().collect(),
                pages: p.pages,
                share: p.pages as f64 / pages as f64,
                stack: p.stack.clone(),
            })
            .collect();
        let (top, top_part) = parts[0];
        let tasks: Vec<String> = top_part.tasks.iter().cloned().collect();
        let peak = per_second.iter().copied().max().unwrap_or(0);
        let first = per_second.iter().position(|&p| p > 0).unwrap_or(0);
        let last = per_second.iter().rposition(|&p| p > 0).unwrap_or(first);
        let in_bursts: u64 = duty.bursts.iter().map(|b| b.pages).sum();
        let burst_secs: usize = duty.bursts.iter().map(|b| b.length_s).sum();
        let mut m: BTreeMap<&'static str, f64> = BTreeMap::new();
        m.insert("pages", pages as f64);
        m.insert("mib", pages as f64 * 4096.0 / (1 << 20) as f64);
        m.insert("peak_pages_per_s", peak as f64);
        m.insert("mean_pages_per_s", pages as f64 / seconds.max(1.0));
        if burst_secs > 0 {
            m.insert("mean_pages_per_s_in_bursts", in_bursts as f64 / burst_secs as f64);
        }
        m.insert("bursts", duty.bursts.len() as f64);
        m.insert("duty", duty.duty);
        for (k, v) in [
            ("burst_s", duty.burst_s),
            ("idle_s", duty.idle_s),
            ("period_s", duty.period_s),
        ] {
            if let Some(v) = v {
                m.insert(k, v);
            }
        }
        m.insert("top_source_share", sources[0].share);
        let period = match (duty.period_s, duty.burst_s) {
            (Some(p), Some(b)) => format!(", in bursts of ~{b:.0} s every ~{p:.0} s"),
            (None, Some(b)) if duty.bursts.len() == 1 => format!(", in one burst of {b:.0} s"),
            _ => String::new(),
        };
        let who = if info.pid == 0 {
            info.comm.clone()
        } else {
            format!("{} (pid {})", info.comm, info.pid)
        };
        let locked = match info.locked_kib {
            Some(0) => ", memory not locked".to_string(),
            Some(k) => format!(", {:.0} MiB of it locked (VmLck)", k as f64 / 1024.0),
            None => String::new(),
        };
        let explanation = format!(
            "the host invalidated the KVM mappings of {pages} pages ({:.0} MiB) of {who}{locked}{period}, \
             peak {peak} pages/s; {:.0}% from {}{}; every invalidated page costs the vCPUs a fault to map it again",
            m["mib"],
            sources[0].share * 100.0,
            top.describe(),
            if tasks.is_empty() { String::new() } else { format!(" ({})", tasks.join(", ")) },
        );
        let advice = analysis::advice(top, &tasks, &info, sysctls);
        out.push(HostFinding {
            finding: Finding {
                kind: super::FindingKind::KvmMmuInvalidation,
                slot: None,
                pid: info.pid,
                tid: 0,
                thread: info.comm.clone(),
                start_ns: state.start_ns + first as u64 * 1_000_000_000,
                duration_ns: (last + 1 - first) as u64 * 1_000_000_000,
                magnitudes: m,
                cause: Some(top.label().to_string()),
                stack: top_part.stack.clone(),
                waker_stack: Vec::new(),
                ran_instead: Vec::new(),
                explanation,
                advice,
            },
            vm: info,
            sources,
            duty_cycle: duty,
            sysctls: sysctls.clone(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn unmap(ts_ns: u64, source: Source, pages: u64, attribution: Attribution) -> HostSample {
        HostSample {
            ts_ns,
            tgid: 7,
            comm: "kcompactd0".into(),
            source,
            stack: 0,
            what: HostWhat::Unmap { pages, attribution },
        }
    }

    fn vm(pid: u32) -> BTreeMap<u32, VmInfo> {
        BTreeMap::from([(
            pid,
            VmInfo {
                pid,
                comm: "qemu".into(),
                locked_kib: Some(1 << 20),
                size_kib: Some(2 << 20),
            },
        )])
    }

    fn counts(samples: &[HostSample], seconds: f64) -> InvalidationCounts {
        let mut c = InvalidationCounts::new(0);
        c.stacks.push(vec!["kcompactd".into(), "compact_zone".into()]);
        for s in samples {
            c.ingest(s);
        }
        c.end(seconds);
        c
    }

    #[test]
    fn a_vm_with_enough_invalidated_guest_pages_gets_one_finding_by_its_top_source() {
        let mut samples = Vec::new();
        for sec in 2..5 {
            samples.push(unmap(
                sec * S,
                Source::ProactiveCompaction,
                900,
                Attribution::Vm(42),
            ));
        }
        samples.push(unmap(3 * S, Source::ManualCompaction, 300, Attribution::Vm(42)));
        // Not the VM's guest memory, not a VM's at all: totals only.
        samples.push(unmap(
            3 * S,
            Source::ProactiveCompaction,
            5000,
            Attribution::VmmOwn(42),
        ));
        samples.push(unmap(
            3 * S,
            Source::ProactiveCompaction,
            50,
            Attribution::Unknown,
        ));
        let c = counts(&samples, 10.0);
        assert_eq!(
            c.series.seconds.len(),
            10,
            "the series ends where the session did"
        );
        assert_eq!(c.totals.vmm_own_pages, 5000);
        assert_eq!(c.totals.attributed_pages, 3000);
        assert_eq!(c.totals.unattributed_pages, 50);
        let found = detect(&c, &vm(42), &Sysctls::default(), 10.0);
        assert_eq!(found.len(), 1, "{found:?}");
        let f = &found[0];
        assert_eq!(f.finding.kind, super::super::FindingKind::KvmMmuInvalidation);
        assert_eq!((f.finding.pid, f.finding.magnitudes["pages"]), (42, 3000.0));
        assert_eq!(f.finding.cause.as_deref(), Some("kcompactd-proactive"));
        assert_eq!(f.sources[0].pages, 2700);
        assert_eq!(f.sources[1].source, "manual-compaction");
        assert_eq!(f.finding.start_ns, 2 * S);
        assert_eq!(f.finding.duration_ns, 3 * S);
        assert_eq!(f.finding.stack, ["kcompactd", "compact_zone"]);
    }

    #[test]
    fn few_pages_own_unmaps_and_other_records_make_no_finding() {
        let samples = vec![
            // Under MIN_FINDING_PAGES.
            unmap(
                S,
                Source::ProactiveCompaction,
                MIN_FINDING_PAGES - 1,
                Attribution::Vm(42),
            ),
            // The VM freeing its own memory: counted, never a finding.
            unmap(S, Source::OwnUnmap, 100_000, Attribution::Vm(43)),
            HostSample {
                what: HostWhat::Malformed,
                ..unmap(S, Source::Other, 0, Attribution::Unknown)
            },
            HostSample {
                what: HostWhat::Migrate {
                    succeeded: 10,
                    failed: 1,
                    for_compaction: true,
                },
                ..unmap(S, Source::ProactiveCompaction, 0, Attribution::Unknown)
            },
        ];
        let c = counts(&samples, 2.0);
        assert_eq!(c.malformed, 1);
        assert_eq!(c.totals.invalidated_pages, MIN_FINDING_PAGES - 1 + 100_000);
        assert_eq!(
            (c.totals.migrated_for_compaction, c.totals.migrate_failed),
            (10, 1)
        );
        let mut vms = vm(42);
        vms.extend(vm(43));
        assert!(detect(&c, &vms, &Sysctls::default(), 2.0).is_empty());
    }

    #[test]
    fn ranges_several_vms_map_are_ambiguous_and_name_no_process() {
        let c = counts(
            &[unmap(
                S,
                Source::ProactiveCompaction,
                4096,
                Attribution::Ambiguous(vec![1, 2]),
            )],
            2.0,
        );
        assert_eq!(c.ambiguous[&vec![1, 2]], 4096);
        let found = detect(&c, &BTreeMap::new(), &Sysctls::default(), 2.0);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].finding.pid, 0);
        assert!(
            found[0].vm.comm.contains("cannot single out"),
            "{}",
            found[0].vm.comm
        );
    }
}
