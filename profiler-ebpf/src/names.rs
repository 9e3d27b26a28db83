//! The names of the object's programs, maps and globals, as the loader
//! looks them up. The eBPF side names them by its functions and statics
//! (the attribute macros take no constants); `profiler`'s no-root test
//! `probes::tests::every_name_the_loader_uses_is_in_the_object_and_no_other`
//! opens the embedded object and checks these lists against it, both ways.

/// Programs (the functions of `probes/`).
pub mod program {
    pub const SWITCH: &str = "slotprof_switch";
    pub const WAKING: &str = "slotprof_waking";
    pub const SYS_ENTER: &str = "slotprof_sys_enter";
    pub const SYS_EXIT: &str = "slotprof_sys_exit";
    pub const HARDIRQ_ENTRY: &str = "slotprof_hardirq_entry";
    pub const HARDIRQ_EXIT: &str = "slotprof_hardirq_exit";
    pub const SOFTIRQ_ENTRY: &str = "slotprof_softirq_entry";
    pub const SOFTIRQ_EXIT: &str = "slotprof_softirq_exit";
    pub const HRTIMER_ENTRY: &str = "slotprof_hrtimer_entry";
    pub const HRTIMER_EXIT: &str = "slotprof_hrtimer_exit";
    pub const TLB_FLUSH: &str = "slotprof_tlb_flush";
    pub const PAGE_FAULT: &str = "slotprof_page_fault";
    pub const IPI_SEND: &str = "slotprof_ipi_send";
    pub const SLOT: &str = "slotprof_slot";
    pub const LOOP: &str = "slotprof_loop";
    pub const CPU: &str = "slotprof_cpu";
    pub const KVM_UNMAP: &str = "slotprof_kvm_unmap";
    pub const COMPACT_ISOLATE: &str = "slotprof_compact_isolate";
    pub const COMPACT_BEGIN: &str = "slotprof_compact_begin";
    pub const COMPACT_END: &str = "slotprof_compact_end";
    pub const MIGRATE: &str = "slotprof_migrate";
    pub const DIRECT_RECLAIM_BEGIN: &str = "slotprof_direct_reclaim_begin";
    pub const CGROUP_RECLAIM_BEGIN: &str = "slotprof_cgroup_reclaim_begin";
    pub const DIRECT_COMPACTION_BEGIN: &str = "slotprof_direct_compaction_begin";
    pub const MEM_STALL_END: &str = "slotprof_mem_stall_end";
    pub const CACHE_ENTER: &str = "slotprof_cache_enter";
    pub const CACHE_EXIT: &str = "slotprof_cache_exit";
    /// Every program of the object.
    pub const ALL: [&str; 27] = [
        SWITCH,
        WAKING,
        SYS_ENTER,
        SYS_EXIT,
        HARDIRQ_ENTRY,
        HARDIRQ_EXIT,
        SOFTIRQ_ENTRY,
        SOFTIRQ_EXIT,
        HRTIMER_ENTRY,
        HRTIMER_EXIT,
        TLB_FLUSH,
        PAGE_FAULT,
        IPI_SEND,
        SLOT,
        LOOP,
        CPU,
        KVM_UNMAP,
        COMPACT_ISOLATE,
        COMPACT_BEGIN,
        COMPACT_END,
        MIGRATE,
        DIRECT_RECLAIM_BEGIN,
        CGROUP_RECLAIM_BEGIN,
        DIRECT_COMPACTION_BEGIN,
        MEM_STALL_END,
        CACHE_ENTER,
        CACHE_EXIT,
    ];
}

/// Maps (the `#[map]` statics).
pub mod map {
    pub const EVENTS: &str = "EVENTS";
    pub const COUNTERS: &str = "COUNTERS";
    pub const STACKS: &str = "STACKS";
    pub const STACKS_ODD: &str = "STACKS_ODD";
    pub const STACK_EPOCH: &str = "STACK_EPOCH";
    pub const OFFCPU_START: &str = "OFFCPU_START";
    pub const FUTEX_SHORT: &str = "FUTEX_SHORT";
    pub const USER_STACK_TOP: &str = "USER_STACK_TOP";
    pub const USER_STACK_SCRATCH: &str = "USER_STACK_SCRATCH";
    pub const EXACT_TIDS: &str = "EXACT_TIDS";
    /// Used by the programs only.
    pub const KERNEL_ONLY: [&str; 10] = [
        "CACHE_WORK_START",
        "CPU_RUNS_MAP",
        "HOST_STACKS",
        "IRQ_NESTING",
        "KERNEL_STACK_SCRATCH",
        "MADVISE_START",
        "MEM_STALL_START",
        "PAGE_FAULTS",
        "URET_PENDING",
        "USER_STACK_BUSY",
    ];
    /// The maps userspace reads, resizes or writes.
    pub const USED: [&str; 10] = [
        EVENTS,
        COUNTERS,
        STACKS,
        STACKS_ODD,
        STACK_EPOCH,
        OFFCPU_START,
        FUTEX_SHORT,
        USER_STACK_TOP,
        USER_STACK_SCRATCH,
        EXACT_TIDS,
    ];
}

/// Read-only globals the loader sets (`.rodata`).
pub mod global {
    pub const TARGET_TGID: &str = "TARGET_TGID";
    pub const MIN_OFFCPU_NS: &str = "MIN_OFFCPU_NS";
    pub const MIN_FUTEX_NS: &str = "MIN_FUTEX_NS";
    pub const USER_STACK_REPEAT_NS: &str = "USER_STACK_REPEAT_NS";
    pub const OFFCPU_FOLD_UNDER_NS: &str = "OFFCPU_FOLD_UNDER_NS";
    pub const TP_OFFSETS: &str = "TP_OFFSETS";
    pub const ALL: [&str; 6] = [
        TARGET_TGID,
        MIN_OFFCPU_NS,
        MIN_FUTEX_NS,
        USER_STACK_REPEAT_NS,
        OFFCPU_FOLD_UNDER_NS,
        TP_OFFSETS,
    ];
}
