//! Which kernel path moved a VM's memory, from the kernel stack of the task
//! that did it (and its name when there is no stack).

use serde::{Deserialize, Serialize};

/// Why the host touched a VM's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Source {
    /// kcompactd compacting on its own (vm.compaction_proactiveness).
    ProactiveCompaction,
    /// kcompactd woken because an allocation found no free high-order pages.
    KcompactdWoken,
    /// kcompactd, on a path slotprof does not recognise.
    Kcompactd,
    /// A write to /proc/sys/vm/compact_memory or a node's `compact` file.
    ManualCompaction,
    /// An allocating task compacting for itself.
    DirectCompaction,
    /// khugepaged collapsing pages into huge pages.
    Khugepaged,
    /// Automatic NUMA balancing moving pages to the node that uses them.
    NumaBalancing,
    /// A large contiguous allocation (CMA, runtime huge pages).
    ContigAlloc,
    /// Memory reclaim.
    Reclaim,
    /// Kernel same-page merging.
    Ksm,
    /// The process unmapping or discarding its own memory.
    OwnUnmap,
    Other,
}

impl Source {
    /// The label in the series, the CSV header and findings.json.
    pub fn label(self) -> &'static str {
        match self {
            Source::ProactiveCompaction => "kcompactd-proactive",
            Source::KcompactdWoken => "kcompactd-woken",
            Source::Kcompactd => "kcompactd",
            Source::ManualCompaction => "manual-compaction",
            Source::DirectCompaction => "direct-compaction",
            Source::Khugepaged => "khugepaged",
            Source::NumaBalancing => "numa-balancing",
            Source::ContigAlloc => "contiguous-allocation",
            Source::Reclaim => "reclaim",
            Source::Ksm => "ksm",
            Source::OwnUnmap => "own-unmap",
            Source::Other => "other",
        }
    }

    /// What it is, in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            Source::ProactiveCompaction => "proactive compaction by kcompactd (vm.compaction_proactiveness)",
            Source::KcompactdWoken => "kcompactd, woken by allocations short of high-order pages",
            Source::Kcompactd => "kcompactd",
            Source::ManualCompaction => "compaction asked for by hand (/proc/sys/vm/compact_memory)",
            Source::DirectCompaction => "direct compaction by an allocating task",
            Source::Khugepaged => "khugepaged collapsing huge pages",
            Source::NumaBalancing => "automatic NUMA balancing",
            Source::ContigAlloc => "a contiguous allocation (CMA, huge pages)",
            Source::Reclaim => "memory reclaim",
            Source::Ksm => "kernel same-page merging",
            Source::OwnUnmap => "the VM process unmapping its own memory",
            Source::Other => "another kernel path",
        }
    }
}

/// Classifies by the kernel stack (function names, any order) and the
/// task's name. Function names are matched exactly or by prefix, since
/// kernels add suffixes (`alloc_contig_range_noprof`, `.isra.0`).
pub fn classify(frames: &[String], comm: &str) -> Source {
    let has = |name: &str| {
        frames.iter().any(|f| {
            f == name
                || f.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(['_', '.']))
        })
    };
    let kcompactd = comm.starts_with("kcompactd") || has("kcompactd");
    if has("kcompactd_do_work") {
        Source::KcompactdWoken
    } else if has("sysctl_compaction_handler") || has("compact_nodes") || has("compact_store") {
        Source::ManualCompaction
    } else if kcompactd && (has("proactive_compact_node") || has("compact_node")) {
        // Since 6.11 kcompactd's proactive pass calls compact_node(); before,
        // proactive_compact_node(). Either may be inlined into kcompactd.
        Source::ProactiveCompaction
    } else if has("try_to_compact_pages") || has("__alloc_pages_direct_compact") || has("compact_zone_order")
    {
        Source::DirectCompaction
    } else if has("alloc_contig_range") || has("alloc_contig_pages") {
        Source::ContigAlloc
    } else if has("khugepaged") || comm == "khugepaged" {
        Source::Khugepaged
    } else if has("migrate_misplaced_folio") || has("migrate_misplaced_page") || has("do_numa_page") {
        Source::NumaBalancing
    } else if frames
        .iter()
        .any(|f| f.starts_with("ksm_") || f == "ksm_scan_thread")
        || comm == "ksmd"
    {
        Source::Ksm
    } else if has("shrink_folio_list") || has("shrink_page_list") || has("shrink_node") {
        Source::Reclaim
    } else if has("do_vmi_munmap")
        || has("__vm_munmap")
        || has("do_madvise")
        || has("zap_page_range_single")
        || has("unmap_vmas")
        || has("exit_mmap")
    {
        Source::OwnUnmap
    } else if kcompactd {
        // No stack (or an unknown path) but kcompactd ran it: before 6.11 a
        // woken kcompactd and a proactive one differ only by the stack.
        Source::Kcompactd
    } else {
        Source::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn compaction_paths_on_this_kernel_and_older_ones() {
        let tail = [
            "kvm_mmu_notifier_invalidate_range_start",
            "try_to_migrate_one",
            "migrate_pages",
            "compact_zone",
        ];
        let with = |extra: &[&str]| s(&[&tail[..], extra].concat());
        assert_eq!(
            classify(&with(&["compact_node", "kcompactd", "kthread"]), "kcompactd0"),
            Source::ProactiveCompaction
        );
        assert_eq!(
            classify(&with(&["proactive_compact_node", "kcompactd"]), "kcompactd0"),
            Source::ProactiveCompaction
        );
        assert_eq!(
            classify(&with(&["kcompactd_do_work", "kcompactd"]), "kcompactd0"),
            Source::KcompactdWoken
        );
        assert_eq!(
            classify(
                &with(&[
                    "compact_node",
                    "sysctl_compaction_handler",
                    "proc_sys_call_handler",
                    "vfs_write"
                ]),
                "sh"
            ),
            Source::ManualCompaction
        );
        assert_eq!(
            classify(&with(&["compact_node", "compact_store"]), "bash"),
            Source::ManualCompaction
        );
        assert_eq!(
            classify(
                &with(&[
                    "compact_zone_order",
                    "try_to_compact_pages",
                    "__alloc_pages_direct_compact"
                ]),
                "java"
            ),
            Source::DirectCompaction
        );
        assert_eq!(
            classify(&with(&["alloc_contig_range_noprof"]), "sh"),
            Source::ContigAlloc
        );
        assert_eq!(classify(&[], "kcompactd1"), Source::Kcompactd);
        assert_eq!(classify(&[], "qemu-system-x86"), Source::Other);
    }

    #[test]
    fn other_movers() {
        assert_eq!(
            classify(&s(&["collapse_huge_page", "khugepaged"]), "khugepaged"),
            Source::Khugepaged
        );
        assert_eq!(
            classify(&s(&["migrate_misplaced_folio", "do_numa_page"]), "vcpu0"),
            Source::NumaBalancing
        );
        assert_eq!(
            classify(&s(&["try_to_unmap", "shrink_folio_list", "kswapd"]), "kswapd0"),
            Source::Reclaim
        );
        assert_eq!(
            classify(
                &s(&["zap_page_range_single", "madvise_vma_behavior", "do_madvise"]),
                "fc_vmm"
            ),
            Source::OwnUnmap
        );
        assert_eq!(
            classify(&s(&["ksm_do_scan", "ksm_scan_thread"]), "ksmd"),
            Source::Ksm
        );
        // A prefix match needs a separator: compact_node_x is not compact_node.
        assert_eq!(classify(&s(&["compact_nodex"]), "kcompactd0"), Source::Kcompactd);
    }
}
