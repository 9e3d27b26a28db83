//! Pure analysis of the host's per-second series: the duty cycle of
//! invalidation bursts, and what the finding says. No kernel here; unit
//! tests feed constructed series.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::source::Source;

/// What one second of the host held.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Second {
    /// Pages of VM memory whose KVM mappings were invalidated.
    pub invalidated_pages: u64,
    /// kvm_unmap_hva_range events (one per range).
    pub invalidations: u64,
    /// Pages compaction's migrate scanner looked at, and isolated.
    pub compaction_scanned: u64,
    pub compaction_isolated: u64,
    /// Pages migrated (any reason), and migrations that failed.
    pub migrated: u64,
    pub migrate_failed: u64,
    /// Compaction runs begun (per zone).
    pub compaction_runs: u64,
    /// Invalidated pages by source label.
    pub invalidated_by_source: BTreeMap<String, u64>,
    /// Pages compaction scanned and isolated, by source label.
    pub scanned_by_source: BTreeMap<String, u64>,
    pub isolated_by_source: BTreeMap<String, u64>,
    /// Invalidated pages by VM process (0: no VM process holds the range).
    pub invalidated_by_vm: BTreeMap<u32, u64>,
}

/// The host's series, one entry per second since the session started.
#[derive(Clone, Debug, Default)]
pub struct Series {
    pub seconds: Vec<Second>,
}

impl Series {
    /// The entry for second `i`, growing the series to reach it.
    pub fn at(&mut self, i: usize) -> &mut Second {
        if self.seconds.len() <= i {
            self.seconds.resize_with(i + 1, Second::default);
        }
        &mut self.seconds[i]
    }
}

/// A stretch of seconds with invalidations well above the baseline.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Burst {
    /// First second (since the session started).
    pub start_s: usize,
    pub length_s: usize,
    pub pages: u64,
}

/// How the bursts repeat.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DutyCycle {
    /// A second is in a burst above this many pages.
    pub threshold_pages_per_s: f64,
    pub bursts: Vec<Burst>,
    /// Median burst length and median gap between bursts.
    pub burst_s: Option<f64>,
    pub idle_s: Option<f64>,
    /// Median start-to-start distance of the bursts (two bursts or more).
    pub period_s: Option<f64>,
    /// The strongest repeat of the burst/idle pattern by autocorrelation,
    /// when it is clear (correlation over 0.3).
    pub autocorrelation_period_s: Option<f64>,
    /// Share of the session's seconds inside bursts.
    pub duty: f64,
}

/// Seconds below this many pages are never a burst (noise such as a VMM
/// remapping a buffer).
pub const MIN_BURST_PAGES_PER_S: f64 = 64.0;

/// Idle stretches this short inside a burst do not split it (compaction
/// pauses between zones and passes).
const MERGE_GAP_S: usize = 2;

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Finds the bursts in a per-second series of pages, as a person reading
/// the plot would: a second is busy when it is well above the baseline
/// (p10 plus a tenth of the way to p99, and at least
/// [`MIN_BURST_PAGES_PER_S`]); busy runs closer than [`MERGE_GAP_S`] are one
/// burst; the period is the median distance between burst starts, checked
/// against the autocorrelation of the busy/idle pattern.
pub fn duty_cycle(pages: &[u64]) -> DutyCycle {
    if pages.is_empty() {
        return DutyCycle::default();
    }
    let mut sorted: Vec<f64> = pages.iter().map(|&p| p as f64).collect();
    sorted.sort_by(f64::total_cmp);
    let pct = |p: f64| sorted[((sorted.len() - 1) as f64 * p).round() as usize];
    let (p10, p99) = (pct(0.10), pct(0.99));
    let threshold = (p10 + 0.1 * (p99 - p10)).max(MIN_BURST_PAGES_PER_S);
    let busy: Vec<bool> = pages.iter().map(|&p| p as f64 > threshold).collect();

    let mut bursts: Vec<Burst> = Vec::new();
    for (i, &b) in busy.iter().enumerate() {
        if !b {
            continue;
        }
        match bursts.last_mut() {
            Some(last) if i - (last.start_s + last.length_s) <= MERGE_GAP_S => {
                last.length_s = i + 1 - last.start_s;
            }
            _ => bursts.push(Burst {
                start_s: i,
                length_s: 1,
                pages: 0,
            }),
        }
    }
    for b in &mut bursts {
        b.pages = pages[b.start_s..b.start_s + b.length_s].iter().sum();
    }
    let burst_s = median(bursts.iter().map(|b| b.length_s as f64).collect());
    let idle_s = median(
        bursts
            .windows(2)
            .map(|w| (w[1].start_s - (w[0].start_s + w[0].length_s)) as f64)
            .collect(),
    );
    let period_s = median(
        bursts
            .windows(2)
            .map(|w| (w[1].start_s - w[0].start_s) as f64)
            .collect(),
    );
    let in_bursts: Vec<f64> = {
        let mut v = vec![0.0; pages.len()];
        for b in &bursts {
            v[b.start_s..b.start_s + b.length_s].fill(1.0);
        }
        v
    };
    let autocorrelation_period_s = crate::phase::analysis::period_by_autocorrelation(&in_bursts)
        .filter(|&(_, r)| r > 0.3)
        .map(|(lag, _)| lag as f64);
    DutyCycle {
        threshold_pages_per_s: threshold,
        duty: in_bursts.iter().sum::<f64>() / pages.len() as f64,
        bursts,
        burst_s,
        idle_s,
        period_s,
        autocorrelation_period_s,
    }
}

/// The host settings that decide whether compaction moves a VM's memory.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Sysctls {
    /// vm.compact_unevictable_allowed: 1 lets compaction migrate mlocked pages.
    pub compact_unevictable_allowed: Option<u32>,
    /// vm.compaction_proactiveness: 0 turns kcompactd's proactive compaction off.
    pub compaction_proactiveness: Option<u32>,
}

/// What slotprof knows of a VM process.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VmInfo {
    pub pid: u32,
    pub comm: String,
    /// VmLck and VmSize from /proc/PID/status (kB), when readable.
    pub locked_kib: Option<u64>,
    pub size_kib: Option<u64>,
}

/// One source's part of a VM's invalidations.
#[derive(Clone, Debug, Serialize)]
pub struct SourceShare {
    pub source: String,
    /// Which task it was (kcompactd0, the compact_memory writer, ...).
    pub tasks: Vec<String>,
    pub pages: u64,
    pub share: f64,
    /// A kernel stack of this source, root first.
    pub stack: Vec<String>,
}

/// Whether the sources point at compaction (what the two sysctls govern).
pub fn is_compaction(source: Source) -> bool {
    matches!(
        source,
        Source::ProactiveCompaction
            | Source::KcompactdWoken
            | Source::Kcompactd
            | Source::ManualCompaction
            | Source::DirectCompaction
    )
}

/// The advice for a VM whose invalidations come from `top` (the source
/// with the most pages).
pub fn advice(top: Source, tasks: &[String], vm: &VmInfo, sysctls: &Sysctls) -> String {
    let locked = vm.locked_kib.is_some_and(|k| k > 0);
    let fix = "set `vm.compact_unevictable_allowed=0` (compaction leaves mlocked pages alone) and \
               `vm.compaction_proactiveness=0` (kcompactd stops compacting on its own): \
               `sysctl -w vm.compact_unevictable_allowed=0 vm.compaction_proactiveness=0`, \
               and persist both in /etc/sysctl.d/";
    let mut advice = match top {
        _ if is_compaction(top) && locked && sysctls.compact_unevictable_allowed == Some(1) => {
            format!(
                "the host is compacting this VM's locked memory; {fix}. This is the fix of the \
                 reference incident (vCPUs 7-17% slower for ~50 s of every ~80 s)"
            )
        }
        _ if is_compaction(top) && !locked => format!(
            "the host is compacting this VM's memory, which is not locked; lock it (the VMM's \
             mlock option, or hugetlbfs-backed guest memory, which compaction does not move) and {fix}"
        ),
        Source::ProactiveCompaction
        | Source::KcompactdWoken
        | Source::Kcompactd
        | Source::ManualCompaction
        | Source::DirectCompaction => format!("the host is compacting this VM's memory; {fix}"),
        Source::Khugepaged => "khugepaged is collapsing this VM's pages into huge pages: back \
             guest memory with hugetlbfs, or set /sys/kernel/mm/transparent_hugepage/khugepaged/defrag to 0"
            .to_string(),
        Source::NumaBalancing => "automatic NUMA balancing is migrating this VM's memory: pin \
             the VM to one node (numactl --membind) or set kernel.numa_balancing=0"
            .to_string(),
        Source::ContigAlloc => "something allocates large contiguous ranges (CMA, runtime \
             hugetlb allocation) and moves this VM's pages out of the way: reserve huge pages at boot"
            .to_string(),
        Source::Reclaim => "the host is reclaiming this VM's memory: the host is short of \
             memory; lock the VM's memory and leave the host more free memory"
            .to_string(),
        Source::Ksm => "KSM is merging this VM's pages: turn KSM off for it \
             (echo 0 > /sys/kernel/mm/ksm/run, or the VMM's mergeable setting)"
            .to_string(),
        Source::OwnUnmap => "the VM process itself unmaps or discards this memory (balloon, \
             free page reporting, a memory hot-unplug): check the VMM's memory settings"
            .to_string(),
        Source::Other => {
            "the kernel stacks in findings.json show which path moves this VM's memory".to_string()
        }
    };
    if top == Source::ManualCompaction && !tasks.is_empty() {
        advice.push_str(&format!(
            ". The compaction was asked for by {} (a write to /proc/sys/vm/compact_memory or a \
             node's compact file): find what runs it (cron, tuned, a monitoring agent)",
            tasks.join(", ")
        ));
    }
    if top == Source::DirectCompaction && !tasks.is_empty() {
        advice.push_str(&format!(
            ". Direct compaction by {} means allocations on the host find no free high-order \
             pages: leave the host more free memory or raise vm.watermark_scale_factor",
            tasks.join(", ")
        ));
    }
    advice
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `on` busy seconds of `level` pages every `period`, with noise below
    /// the floor in between.
    fn square(n: usize, period: usize, on: usize, level: u64) -> Vec<u64> {
        (0..n)
            .map(|i| {
                if i % period < on {
                    level + (i as u64 % 7) * 100
                } else {
                    (i as u64 % 3) * 10
                }
            })
            .collect()
    }

    #[test]
    fn incident_shape_gives_burst_idle_and_period() {
        // The incident: ~50 s of every ~80 s.
        let d = duty_cycle(&square(400, 80, 50, 60_000));
        assert_eq!(d.bursts.len(), 5, "{d:?}");
        assert_eq!(d.burst_s, Some(50.0));
        assert_eq!(d.idle_s, Some(30.0));
        assert_eq!(d.period_s, Some(80.0));
        let ac = d.autocorrelation_period_s.unwrap();
        assert!((ac - 80.0).abs() <= 2.0, "{d:?}");
        assert!((d.duty - 50.0 / 80.0).abs() < 0.01);
    }

    #[test]
    fn short_pauses_inside_a_burst_do_not_split_it() {
        let mut s = square(200, 40, 20, 50_000);
        s[5] = 0;
        s[6] = 0; // a two-second pause
        let d = duty_cycle(&s);
        assert_eq!(d.bursts.len(), 5, "{d:?}");
        assert_eq!(d.bursts[0].length_s, 20);
        assert_eq!(d.bursts[0].pages, s[..20].iter().sum::<u64>());
    }

    #[test]
    fn one_burst_has_no_period_and_quiet_has_no_burst() {
        let mut s = vec![0u64; 60];
        for v in &mut s[10..14] {
            *v = 30_000;
        }
        let d = duty_cycle(&s);
        assert_eq!(d.bursts.len(), 1);
        assert_eq!(d.bursts[0].length_s, 4);
        assert_eq!(d.period_s, None);
        let quiet = duty_cycle(&[3, 0, 10, 40, 0, 0, 12, 1, 0, 0]);
        assert!(quiet.bursts.is_empty(), "{quiet:?}");
        assert_eq!(quiet.duty, 0.0);
        assert!(duty_cycle(&[]).bursts.is_empty());
    }

    #[test]
    fn a_steady_background_is_not_a_burst_but_bursts_above_it_are() {
        // A VMM remapping 500 pages/s all the time, compaction at 20k/s now and then.
        let s: Vec<u64> = (0..120).map(|i| if i % 30 < 5 { 20_500 } else { 500 }).collect();
        let d = duty_cycle(&s);
        assert_eq!(d.bursts.len(), 4, "{d:?}");
        assert!(d.threshold_pages_per_s > 500.0);
        assert_eq!(d.period_s, Some(30.0));
    }

    #[test]
    fn advice_names_the_sysctls_for_compaction_of_locked_memory() {
        let vm = VmInfo {
            pid: 7,
            comm: "firecracker".into(),
            locked_kib: Some(1 << 20),
            size_kib: Some(2 << 20),
        };
        let on = Sysctls {
            compact_unevictable_allowed: Some(1),
            compaction_proactiveness: Some(20),
        };
        let a = advice(Source::ProactiveCompaction, &["kcompactd0".into()], &vm, &on);
        assert!(a.contains("vm.compact_unevictable_allowed=0"), "{a}");
        assert!(a.contains("vm.compaction_proactiveness=0"), "{a}");
        let m = advice(Source::ManualCompaction, &["tuned (pid 9)".into()], &vm, &on);
        assert!(m.contains("tuned (pid 9)") && m.contains("compact_memory"), "{m}");
        let unlocked = VmInfo {
            locked_kib: Some(0),
            ..vm.clone()
        };
        assert!(advice(Source::ProactiveCompaction, &[], &unlocked, &on).contains("not locked"));
        assert!(advice(Source::NumaBalancing, &[], &vm, &on).contains("numa_balancing"));
    }
    #[test]
    fn the_threshold_is_p10_plus_a_tenth_to_p99_and_a_second_at_it_is_not_busy() {
        // 0, 1000, ..., 100000: p10 = 10000, p99 = 99000.
        let s: Vec<u64> = (0..=100).map(|i| i * 1000).collect();
        let d = duty_cycle(&s);
        assert_eq!(d.threshold_pages_per_s, 10_000.0 + 0.1 * 89_000.0);
        // Quiet seconds put the threshold at the floor; a second of
        // exactly the floor is not busy, one page more is.
        let mut s = vec![0u64; 30];
        s[10] = MIN_BURST_PAGES_PER_S as u64;
        assert!(duty_cycle(&s).bursts.is_empty());
        s[20] = MIN_BURST_PAGES_PER_S as u64 + 1;
        let d = duty_cycle(&s);
        assert_eq!(d.bursts.len(), 1);
        assert_eq!(d.bursts[0].start_s, 20);
    }

    #[test]
    fn advice_for_each_memory_state_and_source() {
        let vm = VmInfo {
            pid: 7,
            comm: "qemu".into(),
            locked_kib: Some(1 << 20),
            size_kib: Some(2 << 20),
        };
        let unlocked = VmInfo {
            locked_kib: Some(0),
            ..vm.clone()
        };
        let allowed = Sysctls {
            compact_unevictable_allowed: Some(1),
            compaction_proactiveness: Some(20),
        };
        let refused = Sysctls {
            compact_unevictable_allowed: Some(0),
            ..allowed.clone()
        };
        let tasks = ["someone (pid 9)".to_string()];
        // Locked memory that compaction may move: the incident's fix.
        let a = advice(Source::Kcompactd, &[], &vm, &allowed);
        assert!(
            a.contains("locked memory") && a.contains("reference incident"),
            "{a}"
        );
        assert!(!a.contains("not locked"), "{a}");
        // Locked, but compaction already leaves it alone: the general one.
        let a = advice(Source::Kcompactd, &[], &vm, &refused);
        assert!(
            !a.contains("reference incident") && !a.contains("not locked"),
            "{a}"
        );
        assert!(a.starts_with("the host is compacting this VM's memory;"), "{a}");
        // Not locked: lock it.
        let a = advice(Source::Kcompactd, &[], &unlocked, &allowed);
        assert!(a.contains("not locked"), "{a}");
        // Other sources keep their own advice, locked or not, and the
        // task lines belong to their own sources only.
        for v in [&vm, &unlocked] {
            let a = advice(Source::Khugepaged, &tasks, v, &allowed);
            assert!(a.starts_with("khugepaged"), "{a}");
            assert!(!a.contains("someone"), "{a}");
        }
        let a = advice(Source::NumaBalancing, &tasks, &vm, &allowed);
        assert!(
            !a.contains("compact_memory") && !a.contains("Direct compaction"),
            "{a}"
        );
        let a = advice(Source::DirectCompaction, &tasks, &vm, &refused);
        assert!(a.contains("Direct compaction by someone (pid 9)"), "{a}");
        assert!(!a.contains("compact_memory or"), "{a}");
        let a = advice(Source::DirectCompaction, &[], &vm, &refused);
        assert!(!a.contains("Direct compaction by"), "{a}");
        let a = advice(Source::ManualCompaction, &[], &vm, &refused);
        assert!(!a.contains("asked for by"), "{a}");
    }
}
