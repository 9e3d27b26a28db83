//! Loading, configuring and attaching the eBPF programs, and reading the
//! kernel maps they fill.
//!
//! Everything attached here is owned by [`Probes`]: dropping it detaches
//! every link and unloads every program, on any exit path.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use anyhow::{bail, Context};
use aya::{
    maps::{Array, HashMap as BpfHashMap, PerCpuArray, RingBuf, StackTraceMap},
    programs::{
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
        BtfTracePoint, PerfEvent, TracePoint, UProbe,
    },
    util::online_cpus,
    Ebpf, EbpfLoader, Pod,
};
use profiler_ebpf::{
    counter,
    names::{global, map, program},
    split_stack_id, FutexTotals, OffCpuStart, TracepointOffsets, STACK_EPOCH_MASK, STACK_MAP_ENTRIES,
};
use serde::Serialize;

use crate::kernel::{ring_reader::RingReader, tracefs};

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
        let (mut ebpf, reader) =
            open_with_reader(open(config.tgid, config.min_offcpu, config.stack_repeat, true)?)?;

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
        let (mut ebpf, reader) = open_with_reader(open(0, Duration::ZERO, Duration::ZERO, false)?)?;
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

    /// Threads that are off-CPU right now, with where they went off.
    pub fn in_flight_offcpu(&self) -> Vec<(u32, OffCpuStart)> {
        let Some(map) = self.ebpf.map(map::OFFCPU_START) else {
            return Vec::new();
        };
        let Ok(starts) = BpfHashMap::<_, u32, Start>::try_from(map) else {
            return Vec::new();
        };
        starts
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, s)| s.0.start_ns != 0) // entries of threads on a CPU
            .map(|(tid, s)| (tid, s.0))
            .collect()
    }
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
fn open(
    tgid: u32,
    min_offcpu: Duration,
    stack_repeat: Duration,
    rotating_stacks: bool,
) -> anyhow::Result<Ebpf> {
    let tracefs = tracefs::ensure_mounted()?;
    let offsets = Offsets(tracepoint_offsets(&tracefs)?);
    let min_ns = min_offcpu.as_nanos() as u64;
    let repeat_ns = stack_repeat.as_nanos() as u64;
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

fn attach_cpu_clock(ebpf: &mut Ebpf, freq_hz: u64) -> ProbeStatus {
    let name = program::CPU;
    let event = format!("cpu-clock@{freq_hz}Hz");
    let result = (|| -> anyhow::Result<()> {
        let prog: &mut PerfEvent = ebpf.program_mut(name).context("program missing")?.try_into()?;
        prog.load()?;
        let cpus = online_cpus().map_err(|(_, e)| e)?;
        for cpu in cpus {
            prog.attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Frequency(freq_hz),
                false,
            )
            .with_context(|| format!("perf_event_open(cpu-clock) on CPU {cpu}"))?;
        }
        Ok(())
    })();
    status(name, event, result)
}

/// Attaches `program` to every one of `tracepoints`, one status each.
fn attach_all(ebpf: &mut Ebpf, program: &'static str, tracepoints: &[(&str, &str)]) -> Vec<ProbeStatus> {
    let loaded = (|| -> anyhow::Result<()> {
        let prog: &mut TracePoint = ebpf.program_mut(program).context("program missing")?.try_into()?;
        prog.load()?;
        Ok(())
    })();
    tracepoints
        .iter()
        .map(|(category, name)| {
            let event = format!("{category}:{name}");
            let result = match &loaded {
                Err(e) => Err(anyhow::anyhow!("{e:#}")),
                Ok(()) => (|| -> anyhow::Result<()> {
                    let prog: &mut TracePoint =
                        ebpf.program_mut(program).context("program missing")?.try_into()?;
                    prog.attach(category, name)?;
                    Ok(())
                })(),
            };
            status(program, event, result)
        })
        .collect()
}

/// Attaches `program` to the first of `candidates` that exists.
fn attach_tracepoint(ebpf: &mut Ebpf, program: &'static str, candidates: &[(&str, &str)]) -> ProbeStatus {
    let mut last = None;
    let loaded = (|| -> anyhow::Result<()> {
        let prog: &mut TracePoint = ebpf.program_mut(program).context("program missing")?.try_into()?;
        prog.load()?;
        Ok(())
    })();
    if let Err(e) = loaded {
        return status(
            program,
            format!("{}:{}", candidates[0].0, candidates[0].1),
            Err(e),
        );
    }
    for (category, name) in candidates {
        let event = format!("{category}:{name}");
        let prog: &mut TracePoint = match ebpf.program_mut(program).map(TryInto::try_into) {
            Some(Ok(p)) => p,
            _ => break,
        };
        match prog.attach(category, name) {
            Ok(_) => return status(program, event, Ok(())),
            Err(e) => last = Some((event, anyhow::Error::from(e))),
        }
    }
    let (event, err) = last.unwrap_or_else(|| (String::new(), anyhow::anyhow!("no tracepoint to attach to")));
    status(program, event, Err(err))
}

/// A BTF tracepoint (`tp_btf`): the program gets the tracepoint's own
/// arguments (task pointers included), checked against the kernel's BTF.
fn attach_btf_tracepoint(
    ebpf: &mut Ebpf,
    btf: &anyhow::Result<aya::Btf>,
    program: &'static str,
    category: &str,
    name: &str,
) -> ProbeStatus {
    let result = (|| -> anyhow::Result<()> {
        let btf = btf.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let prog: &mut BtfTracePoint = ebpf.program_mut(program).context("program missing")?.try_into()?;
        prog.load(name, btf)?;
        prog.attach()?;
        Ok(())
    })();
    status(program, format!("{category}:{name}"), result)
}

/// The kernel's BTF, parsed once for every `tp_btf` program (parsing it
/// takes seconds in an emulated test VM).
fn kernel_btf() -> anyhow::Result<aya::Btf> {
    aya::Btf::from_sys_fs().context(
        "cannot read the kernel's BTF (/sys/kernel/btf/vmlinux): slotprof needs CONFIG_DEBUG_INFO_BTF=y",
    )
}

fn attach_uprobe(
    ebpf: &mut Ebpf,
    name: &'static str,
    binary: &std::path::Path,
    offset: u64,
    tgid: u32,
    label: &str,
) -> ProbeStatus {
    let result = (|| -> anyhow::Result<()> {
        let prog: &mut UProbe = ebpf.program_mut(name).context("program missing")?.try_into()?;
        prog.load()?;
        let scope = match std::num::NonZeroU32::new(tgid) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        prog.attach(UProbeAttachLocation::AbsoluteOffset(offset), binary, scope)?;
        Ok(())
    })();
    status(name, format!("uprobe:{label}"), result)
}

/// The program-cache uprobes: the entry program and the return program at
/// each function, the kind of work as the attach cookie (both programs
/// are loaded once and attached at every place). A function whose
/// uretprobe does not attach loses its uprobe too (an entry with no return
/// would time nothing).
fn attach_cache_uprobes(
    ebpf: &mut Ebpf,
    places: &[crate::kernel::cache_functions::CacheUprobe],
    tgid: u32,
) -> Vec<ProbeStatus> {
    let scope = match std::num::NonZeroU32::new(tgid) {
        Some(pid) => UProbeScope::OneProcess(pid),
        None => UProbeScope::AllProcesses,
    };
    for name in [program::CACHE_ENTER, program::CACHE_EXIT] {
        let loaded = (|| -> anyhow::Result<()> {
            let prog: &mut UProbe = ebpf.program_mut(name).context("program missing")?.try_into()?;
            prog.load()?;
            Ok(())
        })();
        if let Err(e) = loaded {
            return vec![status(name, "uprobe:program cache".into(), Err(e))];
        }
    }
    places
        .iter()
        .map(|p| {
            let result = (|| -> anyhow::Result<()> {
                let point = || UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(p.file_offset),
                    cookie: Some(u64::from(p.what)),
                };
                let exit: &mut UProbe = ebpf
                    .program_mut(program::CACHE_EXIT)
                    .context("program missing")?
                    .try_into()?;
                let link = exit.attach(point(), &p.binary, scope)?;
                let enter: &mut UProbe = ebpf
                    .program_mut(program::CACHE_ENTER)
                    .context("program missing")?
                    .try_into()?;
                if let Err(e) = enter.attach(point(), &p.binary, scope) {
                    let exit: &mut UProbe = ebpf
                        .program_mut(program::CACHE_EXIT)
                        .context("program missing")?
                        .try_into()?;
                    let _ = exit.detach(link);
                    return Err(e.into());
                }
                Ok(())
            })();
            status(
                program::CACHE_ENTER,
                format!("uprobe+uretprobe:{}@{:#x}", p.name, p.file_offset),
                result,
            )
        })
        .collect()
}

fn status(program: &'static str, event: String, result: anyhow::Result<()>) -> ProbeStatus {
    ProbeStatus {
        program,
        event,
        attached: result.is_ok(),
        error: result.err().map(|e| format!("{e:#}")),
    }
}

/// Stacks read from the kernel, kept while events or sleeping threads may
/// still refer to them (the kernel's copy is gone two epochs later). Used
/// with [`Probes::next_stack_epoch`] by every mode: a map that only ever
/// holds the last two epochs' stacks has few hash collisions (a collision
/// loses the stack: the kernel's stack map has one entry per bucket).
#[derive(Default)]
pub struct StackCache {
    /// User stacks unwound from copies (ids from `USER_STACK_ID_BASE` up).
    pub user: crate::kernel::user_stacks::UserStacks,
    stacks: HashMap<i32, (Vec<u64>, u64)>,
    generation: u64,
    rotated: Option<Instant>,
}

/// The stack maps take turns at most this often: a map is emptied only
/// when it has not been written for at least this long, so no record a
/// program is still writing refers to it.
const STACK_EPOCH_MIN: Duration = Duration::from_millis(200);

impl StackCache {
    /// The stacks of `ids`, from the cache or the kernel.
    pub fn table(&mut self, probes: &Probes, ids: impl IntoIterator<Item = i32>) -> StackTable {
        self.generation += 1;
        let g = self.generation;
        let mut table = StackTable::new();
        for id in ids {
            if let Some(s) = self.read(probes, id) {
                table.insert(id, s);
            }
        }
        self.stacks.retain(|_, (_, used)| g - *used < 25);
        table
    }

    fn read(&mut self, probes: &Probes, id: i32) -> Option<Vec<u64>> {
        if crate::kernel::user_stacks::is_unwound(id) {
            return self.user.get(id);
        }
        if let Some((s, used)) = self.stacks.get_mut(&id) {
            *used = self.generation;
            return Some(s.clone());
        }
        let s = probes.stack(id)?;
        self.stacks.insert(id, (s.clone(), self.generation));
        Some(s)
    }

    /// Starts a new stack epoch (which empties the older of the two maps),
    /// first copying the stacks that `still_needed` (events not processed
    /// yet, threads off-CPU now) refers to. Returns the stacks emptied.
    pub fn rotate(
        &mut self,
        probes: &mut Probes,
        still_needed: impl IntoIterator<Item = i32>,
    ) -> anyhow::Result<usize> {
        if self.rotated.is_some_and(|t| t.elapsed() < STACK_EPOCH_MIN) {
            return Ok(0);
        }
        let doomed = probes.stack_epoch().wrapping_sub(1) & STACK_EPOCH_MASK;
        for id in still_needed
            .into_iter()
            .filter(|&id| id >= 0 && !crate::kernel::user_stacks::is_unwound(id))
        {
            if let Some((_, used)) = self.stacks.get_mut(&id) {
                *used = self.generation;
            } else if split_stack_id(id).0 == doomed {
                let _ = self.read(probes, id);
            }
        }
        self.rotated = Some(Instant::now());
        probes.next_stack_epoch()
    }
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
