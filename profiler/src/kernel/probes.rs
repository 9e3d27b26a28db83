//! Loading, configuring and attaching the eBPF programs, and reading the
//! kernel maps they fill.
//!
//! Everything attached here is owned by [`Probes`]: dropping it detaches
//! every link and unloads every program, on any exit path.

use std::{collections::HashMap, time::Duration};

use anyhow::{bail, Context};
use aya::{
    maps::{Array, HashMap as BpfHashMap, PerCpuArray, RingBuf, StackTraceMap},
    Ebpf, EbpfLoader, Pod,
};
use profiler_ebpf::{
    counter,
    names::{global, map, program},
    split_stack_id, FoldState, FutexTotals, OffCpuStart, TracepointOffsets, STACK_EPOCH_MASK,
    STACK_MAP_ENTRIES,
};
use serde::Serialize;

pub use crate::kernel::stack_cache::StackCache;
use crate::kernel::{
    hooks::{
        attach_all, attach_btf_tracepoint, attach_cache_uprobes, attach_cpu_clock, attach_tracepoint,
        attach_uprobe, kernel_btf,
    },
    ring_reader::RingReader,
    tracefs,
};

/// Stacks by id, read from the kernel's stack map before it goes away.
pub type StackTable = HashMap<i32, Vec<u64>>;

/// The eBPF object built by build.rs from profiler-ebpf.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler-ebpf"));

/// What to trace.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    /// Process to trace.
    pub tgid: u32,
    /// Off-CPU intervals shorter than this are not reported.
    pub min_offcpu: Duration,
    /// A thread back at the same system call exit (same registers) within
    /// this long of its last stack copy there reuses that copy's stack
    /// (`stack_for::REPEAT`); zero copies every time.
    pub stack_repeat: Duration,
    /// cpu-clock sampling frequency per CPU.
    pub freq_hz: u64,
    /// Short off-CPU intervals of threads no detector reads one by one
    /// are folded in the kernel when shorter than this
    /// (`profiler_ebpf::OffCpuFold`); zero folds none (`--offcpu exact`).
    pub fold_under: Duration,
    /// The threads known to fold nothing (see
    /// [`Probes::add_exact_threads`]), given before the first program is
    /// attached: none of their waits folds meanwhile.
    pub exact_tids: std::collections::BTreeSet<u32>,
    /// Have the kernel time every program run (BPF_ENABLE_STATS, for as
    /// long as the probes are loaded; it adds two clock reads per run).
    pub probe_stats: bool,
    /// A uprobe marking slot starts: (binary, file offset, what to call it).
    pub slot_uprobe: Option<(std::path::PathBuf, u64, String)>,
    /// Attach the detectors' probes (madvise, futex, TLB, IPIs, page faults).
    pub detector_probes: bool,
    /// A uprobe marking main-loop iterations (`--loop-symbol`).
    pub loop_uprobe: Option<(std::path::PathBuf, u64, String)>,
    /// The program cache's functions: a uprobe and a uretprobe on each.
    pub cache_uprobes: Vec<crate::kernel::cache_functions::CacheUprobe>,
}

/// What one program cost, by the kernel's own accounting.
#[derive(Clone, Debug, Serialize)]
pub struct ProgramCost {
    pub program: String,
    pub runs: u64,
    pub total_ns: u64,
    pub avg_ns: f64,
}

/// Whether one probe attached, for the summary.
#[derive(Clone, Debug, Serialize)]
pub struct ProbeStatus {
    pub program: &'static str,
    /// What it is attached to: `sched:sched_switch`, `cpu-clock@99Hz`, ...
    pub event: String,
    pub attached: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The kernel-side counters, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Counters {
    pub samples: u64,
    pub offcpu_intervals: u64,
    /// Records the ring buffer had no room for.
    pub ring_full: u64,
    /// Stacks the stack map could not store (full, or a hash collision).
    pub stack_lost: u64,
    /// Off-CPU starts the per-thread map could not store.
    pub offcpu_start_lost: u64,
    /// madvise/futex starts the per-thread maps could not store.
    pub syscall_start_lost: u64,
    /// TLB flushes the target's threads did for themselves.
    pub tlb_local: u64,
    /// Shootdown IPIs the target's threads sent to other CPUs.
    pub tlb_ipis: u64,
    /// Host-side memory events sent (`slotprof host`).
    pub host_events: u64,
    /// User stack copies, by where they were taken.
    pub user_stacks_at_exit: u64,
    pub user_stacks_at_switch_out: u64,
    pub user_stacks_sampled: u64,
    pub user_stack_copy_failed: u64,
    pub user_stack_context_changed: u64,
    pub user_stack_ring_busy: u64,
    /// Sample copies not made: a copy of the same thread was being made
    /// on that CPU (the sample takes it).
    pub user_stack_nested: u64,
    /// System call exits sent as a repeat of the thread's last copy.
    pub user_stack_repeats: u64,
    /// Short off-CPU intervals folded in the kernel, and the records
    /// they went out in.
    pub offcpu_folded: u64,
    pub offcpu_folds: u64,
}

impl Counters {
    /// Events that did not reach userspace whole.
    pub fn lost(&self) -> u64 {
        self.ring_full + self.stack_lost + self.offcpu_start_lost + self.syscall_start_lost
    }
}

#[repr(transparent)]
#[derive(Clone, Copy)]
struct Offsets(TracepointOffsets);
// SAFETY: repr(C) struct of u32s, no padding, any bit pattern valid.
unsafe impl Pod for Offsets {}

#[repr(transparent)]
#[derive(Clone, Copy)]
struct FutexTotalsPod(FutexTotals);
// SAFETY: repr(C) plain data, every bit pattern valid.
unsafe impl Pod for FutexTotalsPod {}

#[repr(transparent)]
#[derive(Clone, Copy)]
struct Start(OffCpuStart);
// SAFETY: repr(C) plain data, every bit pattern valid.
unsafe impl Pod for Start {}

/// The interrupt nesting probes, exits before entries.
pub const IRQ_NESTING_PROBES: [(&str, &str, &str); 6] = [
    (program::HARDIRQ_EXIT, "irq", "irq_handler_exit"),
    (program::SOFTIRQ_EXIT, "irq", "softirq_exit"),
    (program::HRTIMER_EXIT, "timer", "hrtimer_expire_exit"),
    (program::HARDIRQ_ENTRY, "irq", "irq_handler_entry"),
    (program::SOFTIRQ_ENTRY, "irq", "softirq_entry"),
    (program::HRTIMER_ENTRY, "timer", "hrtimer_expire_entry"),
];

/// The loaded and attached probes.
pub struct Probes {
    ebpf: Ebpf,
    pub status: Vec<ProbeStatus>,
    /// Held while run-time stats are on; closing it turns them off.
    _stats: Option<std::os::fd::OwnedFd>,
    /// The stack epoch the programs write into (see profiler_ebpf::STACK_EPOCH_MASK).
    stack_epoch: u32,
}

impl Probes {
    /// Loads the object with `config` and attaches every probe it can. A
    /// probe that fails to attach is recorded in `status`; failing to attach
    /// any probe at all is an error. The event ring's reader is started
    /// before the first probe is attached (see [`open_with_reader`]).
    pub fn load(config: &ProbeConfig) -> anyhow::Result<(Self, RingReader)> {
        let (mut ebpf, reader) = open_with_reader(open(
            config.tgid,
            (config.min_offcpu, config.stack_repeat, config.fold_under),
            true,
        )?)?;
        add_exact(&mut ebpf, &config.exact_tids);

        let btf = kernel_btf();
        let mut status = vec![
            attach_cpu_clock(&mut ebpf, config.freq_hz),
            attach_btf_tracepoint(&mut ebpf, &btf, program::SWITCH, "sched", "sched_switch"),
        ];
        // Interrupt nesting per CPU, for the wakeup probe to tell a wakeup
        // by a timer, a device or a softirq from a task's. Exits first, so
        // no entry is counted without its exit.
        for (program, category, name) in IRQ_NESTING_PROBES {
            status.push(attach_btf_tracepoint(&mut ebpf, &btf, program, category, name));
        }
        // sched_waking runs in the waker's context (sched_wakeup may run on
        // the target CPU from an IPI, where `current` is unrelated).
        status.push(attach_btf_tracepoint(
            &mut ebpf,
            &btf,
            program::WAKING,
            "sched",
            "sched_waking",
        ));
        // Every system call's exit, in one program: deferred user stacks
        // of off-CPU intervals are copied there, and it ends the futex and
        // madvise calls the detectors see (see syscalls.rs for why one).
        let sys_exit = attach_btf_tracepoint(&mut ebpf, &btf, program::SYS_EXIT, "raw_syscalls", "sys_exit");
        let exit_attached = sys_exit.attached;
        status.push(sys_exit);
        if config.detector_probes {
            // Detector probes: madvise, futex, TLB flushes and shootdown IPIs.
            // A syscall's entry only if the exit probe is attached: an entry
            // whose exit is never seen would stay in the per-thread map (and
            // a futex entry there makes sched_switch take the thread's next
            // sleep for a futex wait).
            status.push(if exit_attached {
                attach_btf_tracepoint(&mut ebpf, &btf, program::SYS_ENTER, "raw_syscalls", "sys_enter")
            } else {
                ProbeStatus {
                    program: program::SYS_ENTER,
                    event: "raw_syscalls:sys_enter".into(),
                    attached: false,
                    error: Some("not attached: the exit probe (raw_syscalls:sys_exit) did not attach".into()),
                }
            });
            for (program, category, name) in [
                (program::TLB_FLUSH, "tlb", "tlb_flush"),
                (program::PAGE_FAULT, "exceptions", "page_fault_user"),
            ] {
                status.push(attach_tracepoint(&mut ebpf, program, &[(category, name)]));
            }
            status.extend(attach_all(
                &mut ebpf,
                program::IPI_SEND,
                &[("ipi", "ipi_send_cpumask"), ("ipi", "ipi_send_cpu")],
            ));
            // Memory stalls: each begin says which; one end for all.
            for (program, category, name) in [
                (
                    program::DIRECT_RECLAIM_BEGIN,
                    "vmscan",
                    "mm_vmscan_direct_reclaim_begin",
                ),
                (
                    program::CGROUP_RECLAIM_BEGIN,
                    "vmscan",
                    "mm_vmscan_memcg_reclaim_begin",
                ),
                (
                    program::DIRECT_COMPACTION_BEGIN,
                    "compaction",
                    "mm_compaction_begin",
                ),
            ] {
                status.push(attach_tracepoint(&mut ebpf, program, &[(category, name)]));
            }
            status.extend(attach_all(
                &mut ebpf,
                program::MEM_STALL_END,
                &[
                    ("vmscan", "mm_vmscan_direct_reclaim_end"),
                    ("vmscan", "mm_vmscan_memcg_reclaim_end"),
                    ("compaction", "mm_compaction_end"),
                ],
            ));
        }
        for (program, uprobe) in [
            (program::SLOT, &config.slot_uprobe),
            (program::LOOP, &config.loop_uprobe),
        ] {
            if let Some((binary, offset, label)) = uprobe {
                let st = attach_uprobe(&mut ebpf, program, binary, *offset, config.tgid, label);
                if !st.attached {
                    bail!(
                        "the uprobe on {label} did not attach: {}",
                        st.error.as_deref().unwrap_or("unknown error")
                    );
                }
                status.push(st);
            }
        }
        if !config.cache_uprobes.is_empty() {
            status.extend(attach_cache_uprobes(
                &mut ebpf,
                &config.cache_uprobes,
                config.tgid,
            ));
        }
        Ok((Self::attached(ebpf, status, config.probe_stats)?, reader))
    }

    /// Loads the object and attaches the host-side memory probes
    /// (`slotprof host`, system-wide): KVM invalidations, compaction and
    /// page migration.
    pub fn load_host(probe_stats: bool) -> anyhow::Result<(Self, RingReader)> {
        let (mut ebpf, reader) =
            open_with_reader(open(0, (Duration::ZERO, Duration::ZERO, Duration::ZERO), false)?)?;
        let status = HOST_PROBES
            .iter()
            .map(|(program, category, name)| attach_tracepoint(&mut ebpf, program, &[(category, name)]))
            .collect();
        Ok((Self::attached(ebpf, status, probe_stats)?, reader))
    }

    fn attached(ebpf: Ebpf, mut status: Vec<ProbeStatus>, probe_stats: bool) -> anyhow::Result<Self> {
        if status.iter().all(|s| !s.attached) {
            let why: Vec<String> = status
                .drain(..)
                .map(|s| format!("{}: {}", s.event, s.error.unwrap_or_default()))
                .collect();
            bail!("no probe could be attached ({})", why.join("; "));
        }
        let stats = if probe_stats {
            Some(
                aya::sys::enable_stats(aya::sys::Stats::RunTime)
                    .context("cannot enable BPF run-time stats")?,
            )
        } else {
            None
        };
        Ok(Self {
            ebpf,
            status,
            _stats: stats,
            stack_epoch: 0,
        })
    }

    /// Run counts and times of each program (zero unless `probe_stats`).
    pub fn costs(&self) -> Vec<ProgramCost> {
        self.ebpf
            .programs()
            .filter_map(|(name, prog)| {
                let info = prog.info().ok()?;
                let runs = info.run_count();
                let total_ns = info.run_time().as_nanos() as u64;
                Some(ProgramCost {
                    program: name.to_string(),
                    runs,
                    total_ns,
                    avg_ns: if runs == 0 {
                        0.0
                    } else {
                        total_ns as f64 / runs as f64
                    },
                })
            })
            .collect()
    }

    /// The ring buffer every record arrives through (can be taken once).
    /// The kernel-side counters now.
    pub fn counters(&self) -> anyhow::Result<Counters> {
        let map = self.ebpf.map(map::COUNTERS).context("COUNTERS map missing")?;
        let array: PerCpuArray<_, u64> = PerCpuArray::try_from(map)?;
        let read = |i: u32| -> anyhow::Result<u64> { Ok(array.get(&i, 0)?.iter().sum()) };
        Ok(Counters {
            samples: read(counter::SAMPLES)?,
            offcpu_intervals: read(counter::OFFCPU_INTERVALS)?,
            ring_full: read(counter::RING_FULL)?,
            stack_lost: read(counter::STACK_LOST)?,
            offcpu_start_lost: read(counter::OFFCPU_START_LOST)?,
            syscall_start_lost: read(counter::SYSCALL_START_LOST)?,
            tlb_local: read(counter::TLB_LOCAL)?,
            tlb_ipis: read(counter::TLB_IPIS)?,
            host_events: read(counter::HOST_EVENTS)?,
            user_stacks_at_exit: read(counter::USER_STACKS_AT_EXIT)?,
            user_stacks_at_switch_out: read(counter::USER_STACKS_AT_SWITCH_OUT)?,
            user_stacks_sampled: read(counter::USER_STACKS_SAMPLED)?,
            user_stack_copy_failed: read(counter::USER_STACK_COPY_FAILED)?,
            user_stack_context_changed: read(counter::USER_STACK_CONTEXT_CHANGED)?,
            user_stack_ring_busy: read(counter::USER_STACK_RING_BUSY)?,
            user_stack_nested: read(counter::USER_STACK_NESTED)?,
            user_stack_repeats: read(counter::USER_STACK_REPEATS)?,
            offcpu_folded: read(counter::OFFCPU_FOLDED)?,
            offcpu_folds: read(counter::OFFCPU_FOLDS)?,
        })
    }

    /// The addresses of stack `id`, leaf first; `None` for an error id or a
    /// stack the map no longer holds.
    pub fn stack(&self, id: i32) -> Option<Vec<u64>> {
        if !(0..profiler_ebpf::USER_STACK_ID_BASE).contains(&id) {
            return None;
        }
        let (epoch, index) = split_stack_id(id);
        // A map holds the stacks of its latest epoch only: the current one
        // or the one before. An older id's stack is gone (read it before).
        let previous = self.stack_epoch.wrapping_sub(1) & STACK_EPOCH_MASK;
        if epoch != self.stack_epoch && epoch != previous {
            return None;
        }
        let map = self.ebpf.map(stack_map_name(epoch))?;
        let stacks = StackTraceMap::try_from(map).ok()?;
        let trace = stacks.get(&index, 0).ok()?;
        Some(trace.frames().iter().map(|f| f.ip).collect())
    }

    /// Tells the kernel where threads' outermost frames end, so their user
    /// stack copies stop there (`None` forgets a thread's bound).
    pub fn set_stack_tops(&mut self, tops: &[(u32, Option<u64>)]) {
        if tops.is_empty() {
            return;
        }
        let Some(map) = self.ebpf.map_mut(map::USER_STACK_TOP) else {
            return;
        };
        let Ok(mut map) = aya::maps::HashMap::<_, u32, u64>::try_from(map) else {
            return;
        };
        for &(tid, top) in tops {
            let _ = match top {
                Some(top) => map.insert(tid, top, 0),
                None => map.remove(&tid),
            };
        }
    }

    /// The epoch the programs write stacks into now.
    pub fn stack_epoch(&self) -> u32 {
        self.stack_epoch
    }

    /// Empties the map of the epoch before the current one
    /// and makes it current (for the next epoch), so neither map fills up
    /// with stacks nobody reads (a switch-out's stacks are walked before it
    /// is known whether the interval will be long enough to be reported).
    /// Ids of the emptied epoch stop resolving: read what is still needed
    /// first. Returns how many stacks were emptied.
    pub fn next_stack_epoch(&mut self) -> anyhow::Result<usize> {
        let next = (self.stack_epoch + 1) & STACK_EPOCH_MASK;
        let name = stack_map_name(next);
        let map = self.ebpf.map_mut(name).context("stack map missing")?;
        let mut stacks = StackTraceMap::try_from(map)?;
        let indices: Vec<u32> = stacks.stack_ids().filter_map(Result::ok).collect();
        for index in &indices {
            let _ = stacks.remove(index);
        }
        let map = self
            .ebpf
            .map_mut(map::STACK_EPOCH)
            .context("STACK_EPOCH map missing")?;
        let mut epoch: Array<_, u32> = Array::try_from(map)?;
        epoch.set(0, next, 0)?;
        self.stack_epoch = next;
        Ok(indices.len())
    }

    /// Futex waits under the minimum, per address: (address, waits, ns).
    pub fn short_futex_waits(&self) -> Vec<(u64, u64, u64)> {
        let Some(map) = self.ebpf.map(map::FUTEX_SHORT) else {
            return Vec::new();
        };
        let Ok(totals) = BpfHashMap::<_, u64, FutexTotalsPod>::try_from(map) else {
            return Vec::new();
        };
        totals
            .iter()
            .filter_map(Result::ok)
            .map(|(addr, t)| (addr, t.0.waits, t.0.wait_ns))
            .collect()
    }

    /// Adds `tids` to the threads whose every off-CPU interval is
    /// reported (never folded): the ones a detector reads interval by
    /// interval (the loop uprobe adds its own thread). Returns the tids
    /// the map had no room for (they fold).
    pub fn add_exact_threads(&mut self, tids: &std::collections::BTreeSet<u32>) -> Vec<u32> {
        add_exact(&mut self.ebpf, tids)
    }

    /// Every thread's folded waits not sent yet (see
    /// `profiler_ebpf::FoldState`): (tid, tgid, the fold).
    pub fn pending_folds(&self) -> Vec<(u32, u32, FoldState)> {
        self.thread_entries(|s| s.fold.intervals != 0)
            .into_iter()
            .map(|(tid, s)| (tid, s.tgid, s.fold))
            .collect()
    }

    /// Threads that are off-CPU right now, with where they went off.
    pub fn in_flight_offcpu(&self) -> Vec<(u32, OffCpuStart)> {
        // (Entries of threads on a CPU have no start.)
        self.thread_entries(|s| s.start_ns != 0)
    }

    /// The target's threads' entries (`OFFCPU_START`) that `keep` keeps.
    fn thread_entries(&self, keep: impl Fn(&OffCpuStart) -> bool) -> Vec<(u32, OffCpuStart)> {
        let Some(map) = self.ebpf.map(map::OFFCPU_START) else {
            return Vec::new();
        };
        let Ok(starts) = BpfHashMap::<_, u32, Start>::try_from(map) else {
            return Vec::new();
        };
        starts
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, s)| keep(&s.0))
            .map(|(tid, s)| (tid, s.0))
            .collect()
    }
}

/// Adds `tids` to the object's `EXACT_TIDS`; returns those it had no
/// room for.
fn add_exact(ebpf: &mut Ebpf, tids: &std::collections::BTreeSet<u32>) -> Vec<u32> {
    let Some(map) = ebpf.map_mut(map::EXACT_TIDS) else {
        return tids.iter().copied().collect();
    };
    let Ok(mut map) = BpfHashMap::<_, u32, u32>::try_from(map) else {
        return tids.iter().copied().collect();
    };
    tids.iter()
        .filter(|&&t| map.insert(t, 1, 0).is_err())
        .copied()
        .collect()
}

/// `slotprof host`'s programs and their tracepoints.
pub const HOST_PROBES: &[(&str, &str, &str)] = &[
    (program::KVM_UNMAP, "kvm", "kvm_unmap_hva_range"),
    (
        program::COMPACT_ISOLATE,
        "compaction",
        "mm_compaction_isolate_migratepages",
    ),
    (program::COMPACT_BEGIN, "compaction", "mm_compaction_begin"),
    (program::COMPACT_END, "compaction", "mm_compaction_end"),
    (program::MIGRATE, "migrate", "mm_migrate_pages"),
];

/// The stack map a stack epoch's stacks are in.
fn stack_map_name(epoch: u32) -> &'static str {
    if epoch & 1 == 0 {
        map::STACKS
    } else {
        map::STACKS_ODD
    }
}

/// Starts the event ring's reader on a loaded object, before any of its
/// programs is loaded into the kernel or attached. Each program is verified
/// as it is attached, which takes most of attaching (seconds in an emulated
/// test VM, with the sampler and sched_switch already running): with the
/// reader started after the last attach, their records filled the ring
/// meanwhile, and the stack copies of the session's first seconds were
/// skipped as "ring busy" (over half full) or lost. The programs keep
/// the ring's file descriptor in their instructions (relocated when the
/// object was loaded); the reader holds it open.
fn open_with_reader(mut ebpf: Ebpf) -> anyhow::Result<(Ebpf, RingReader)> {
    let map = ebpf.take_map(map::EVENTS).context("EVENTS map missing")?;
    let reader = RingReader::start(RingBuf::try_from(map)?)?;
    Ok((ebpf, reader))
}

/// Mounts tracefs if needed and loads the object with its settings.
/// `durations`: (the shortest off-CPU interval reported, the stack repeat
/// period, the folding bound).
fn open(tgid: u32, durations: (Duration, Duration, Duration), rotating_stacks: bool) -> anyhow::Result<Ebpf> {
    let (min_offcpu, stack_repeat, fold_under) = durations;
    let tracefs = tracefs::ensure_mounted()?;
    let offsets = Offsets(tracepoint_offsets(&tracefs)?);
    let min_ns = min_offcpu.as_nanos() as u64;
    let repeat_ns = stack_repeat.as_nanos() as u64;
    let fold_ns = fold_under.as_nanos() as u64;
    // Each stack map entry holds up to 127 frames (~1 KiB of kernel memory).
    let odd_entries = if rotating_stacks { STACK_MAP_ENTRIES } else { 1 };
    // One stack-copy scratch record per possible CPU (indexed by CPU).
    let cpus = aya::util::nr_cpus().map_err(|(path, e)| anyhow::anyhow!("cannot read {path}: {e}"))? as u32;
    EbpfLoader::new()
        .map_max_entries(map::STACKS_ODD, odd_entries)
        .map_max_entries(map::USER_STACK_SCRATCH, cpus)
        .override_global(global::TARGET_TGID, &tgid, true)
        .override_global(global::MIN_OFFCPU_NS, &min_ns, true)
        .override_global(global::MIN_FUTEX_NS, &min_ns, true)
        .override_global(global::USER_STACK_REPEAT_NS, &repeat_ns, true)
        .override_global(global::OFFCPU_FOLD_UNDER_NS, &fold_ns, true)
        .override_global(global::TP_OFFSETS, &offsets, true)
        .load(OBJECT)
        .context(
            "loading slotprof's eBPF object failed (is this kernel built with CONFIG_BPF_SYSCALL and BTF?)",
        )
}

/// Where the fields the programs read are on this kernel: `task_struct`'s
/// from the kernel's BTF, the TLB tracepoint's from tracefs. (The system
/// call and wakeup probes are BTF tracepoints: their arguments are the
/// kernel's own, checked by the verifier.)
fn tracepoint_offsets(tracefs: &std::path::Path) -> anyhow::Result<TracepointOffsets> {
    let [task_pid, task_comm, task_flags, task_tgid] = crate::kernel::btf::task_offsets()?;
    Ok(TracepointOffsets {
        task_pid,
        task_comm,
        task_flags,
        task_tgid,
        _pad: 0,
        // A kernel without the TLB tracepoint gets its probe reported as
        // not attached, not a failure.
        tlb_reason: opt_field(tracefs, "tlb", "tlb_flush", "reason", 4, 8),
    })
}

/// A field's offset, or `default` when the tracepoint is missing (its
/// probe will then fail to attach and say so).
fn opt_field(
    tracefs: &std::path::Path,
    category: &str,
    name: &str,
    field: &str,
    size: u32,
    default: u32,
) -> u32 {
    tracefs::Format::read(tracefs, category, name)
        .and_then(|f| f.field(field, size))
        .map_or(default, |f| f.offset)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
    use profiler_ebpf::names::{global, map, program};

    /// The names the loader uses against the object it embeds, without
    /// root or a kernel: every program (a function outside `.text`), map
    /// (a symbol of the `maps` section) and global (a named symbol of
    /// `.rodata`) of the object is in `profiler_ebpf::names`, and every
    /// name there is in the object.
    #[test]
    fn every_name_the_loader_uses_is_in_the_object_and_no_other() {
        let elf = object::File::parse(super::OBJECT).expect("the embedded eBPF object parses");
        let in_section = |want: &dyn Fn(&str) -> bool, kind: Option<SymbolKind>| -> BTreeSet<String> {
            elf.symbols()
                .filter(|s| kind.is_none_or(|k| s.kind() == k))
                .filter(|s| {
                    s.section_index()
                        .and_then(|i| elf.section_by_index(i).ok())
                        .and_then(|sec| sec.name().ok().map(want))
                        .unwrap_or(false)
                })
                .filter_map(|s| s.name().ok().map(str::to_string))
                .collect()
        };
        let programs = in_section(
            &|n| n != ".text" && !n.starts_with(".rel"),
            Some(SymbolKind::Text),
        );
        let maps = in_section(&|n| n == "maps", None);
        let globals: BTreeSet<String> = in_section(&|n| n == ".rodata", None)
            .into_iter()
            .filter(|n| !n.is_empty() && !n.starts_with("anon."))
            .collect();
        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(
            programs,
            set(&program::ALL),
            "programs of the object vs names::program::ALL"
        );
        let mut all_maps = set(&map::USED);
        all_maps.extend(set(&map::KERNEL_ONLY));
        assert_eq!(maps, all_maps, "maps of the object vs names::map");
        assert_eq!(
            globals,
            set(&global::ALL),
            "read-only globals of the object vs names::global::ALL"
        );
        // And the attach tables name programs of the object.
        for (name, _, _) in super::IRQ_NESTING_PROBES.iter().chain(super::HOST_PROBES) {
            assert!(programs.contains(*name), "{name}");
        }
    }
}
