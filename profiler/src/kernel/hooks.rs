//! Hooking a loaded object's programs to their kernel events: tracepoints,
//! BTF tracepoints, the cpu-clock perf event, uprobes and the program
//! cache's uprobe/uretprobe pairs; one [`ProbeStatus`] each, attached or
//! with the kernel's reason.

use anyhow::Context;
use aya::{
    programs::{
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
        BtfTracePoint, PerfEvent, TracePoint, UProbe,
    },
    util::online_cpus,
    Ebpf,
};
use profiler_ebpf::names::program;

use crate::kernel::probes::ProbeStatus;

pub(super) fn attach_cpu_clock(ebpf: &mut Ebpf, freq_hz: u64) -> ProbeStatus {
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
pub(super) fn attach_all(
    ebpf: &mut Ebpf,
    program: &'static str,
    tracepoints: &[(&str, &str)],
) -> Vec<ProbeStatus> {
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
pub(super) fn attach_tracepoint(
    ebpf: &mut Ebpf,
    program: &'static str,
    candidates: &[(&str, &str)],
) -> ProbeStatus {
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
pub(super) fn attach_btf_tracepoint(
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
pub(super) fn kernel_btf() -> anyhow::Result<aya::Btf> {
    aya::Btf::from_sys_fs().context(
        "cannot read the kernel's BTF (/sys/kernel/btf/vmlinux): slotprof needs CONFIG_DEBUG_INFO_BTF=y",
    )
}

pub(super) fn attach_uprobe(
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
pub(super) fn attach_cache_uprobes(
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

pub(super) fn status(program: &'static str, event: String, result: anyhow::Result<()>) -> ProbeStatus {
    ProbeStatus {
        program,
        event,
        attached: result.is_ok(),
        error: result.err().map(|e| format!("{e:#}")),
    }
}
