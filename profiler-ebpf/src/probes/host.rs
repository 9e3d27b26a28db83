//! `slotprof host`: the host's memory management acting on VMs' memory.
//!
//! System-wide (the task running is kcompactd, a process in direct
//! compaction or a writer of compact_memory, never the VM itself). Each
//! program sends the tracepoint's record words, the task and its kernel
//! stack; userspace decodes the fields with this kernel's layout. The stack
//! is walked at most once per [`HOST_STACK_REUSE_NS`] per thread and
//! tracepoint: invalidations come 100k a second while compaction runs.

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::{map, tracepoint},
    maps::LruHashMap,
    programs::TracePointContext,
};
use profiler_ebpf::{
    counter, host_tp, EventKind, HostEvent, HostStackCache, HOST_RAW_WORDS, HOST_STACK_REUSE_NS,
    OFFCPU_MAP_ENTRIES,
};

use super::{count, count_lost_stacks, stack_id, EVENTS};

/// Last stack walked per (tid << 8 | tracepoint).
#[map]
static HOST_STACKS: LruHashMap<u64, HostStackCache> = LruHashMap::with_max_entries(OFFCPU_MAP_ENTRIES, 0);

#[tracepoint]
pub fn slotprof_kvm_unmap(ctx: TracePointContext) -> u32 {
    send(&ctx, host_tp::KVM_UNMAP)
}

#[tracepoint]
pub fn slotprof_compact_isolate(ctx: TracePointContext) -> u32 {
    send(&ctx, host_tp::COMPACT_ISOLATE)
}

#[tracepoint]
pub fn slotprof_compact_begin(ctx: TracePointContext) -> u32 {
    send(&ctx, host_tp::COMPACT_BEGIN)
}

#[tracepoint]
pub fn slotprof_compact_end(ctx: TracePointContext) -> u32 {
    send(&ctx, host_tp::COMPACT_END)
}

#[tracepoint]
pub fn slotprof_migrate(ctx: TracePointContext) -> u32 {
    send(&ctx, host_tp::MIGRATE)
}

#[inline(always)]
fn send(ctx: &TracePointContext, tracepoint: u32) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let now = unsafe { bpf_ktime_get_ns() };
    let key = (tid as u64) << 8 | tracepoint as u64;
    // SAFETY: a copy of the value is taken at once; a concurrent update
    // of the same key can only make the reuse decision stale.
    let cached = unsafe { HOST_STACKS.get(&key) }.copied();
    let kernel_stack_id = match cached {
        Some(c) if now.wrapping_sub(c.ts_ns) < HOST_STACK_REUSE_NS && c.stack_id >= 0 => c.stack_id,
        _ => {
            let id = stack_id(ctx, 0);
            count_lost_stacks(&[id]);
            let entry = HostStackCache {
                ts_ns: now,
                stack_id: id,
                _pad: 0,
            };
            let _ = HOST_STACKS.insert(&key, &entry, 0);
            id
        }
    };
    let mut raw = [0u64; HOST_RAW_WORDS];
    // Constant offsets, one word at a time (the verifier wants them so).
    for (i, word) in raw.iter_mut().enumerate() {
        *word = unsafe { ctx.read_at::<u64>(8 + i * 8) }.unwrap_or(0);
    }
    let Some(mut entry) = EVENTS.reserve::<HostEvent>(0) else {
        count(counter::RING_FULL);
        return 0;
    };
    entry.write(HostEvent {
        kind: EventKind::Host as u32,
        cpu: unsafe { bpf_get_smp_processor_id() },
        ts_ns: now,
        tgid: (pid_tgid >> 32) as u32,
        tid,
        tracepoint,
        kernel_stack_id,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
        raw,
    });
    entry.submit(0);
    count(counter::HOST_EVENTS);
    0
}
