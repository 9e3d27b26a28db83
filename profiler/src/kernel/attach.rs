//! What every mode does first on a target: the slot source started beside
//! it, its uprobes found, the probes loaded and attached, the event stream
//! opened, and what did not attach said. `session` (attach/record) and
//! `run` call [`attach`]; `host` watches the host, not a target, and has
//! its own probe set.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::{
    background::Background,
    kernel::probes::{ProbeConfig, Probes},
    kernel::ring_reader::RingReader,
    kernel::target::Target,
    slot_sources::{rpc, SharedSlotLog, SlotSourceSpec},
};

/// A target with the probes on it.
pub struct Attached {
    pub probes: Probes,
    pub ring: RingReader,
    /// What the slot source sees (and the slot uprobe's marks).
    pub slot_log: SharedSlotLog,
    /// The slot source's RPC follower, when it has one.
    pub source_task: Option<Background>,
    /// A line for each probe that did not attach (not said yet).
    pub not_attached: Vec<String>,
    /// What the program-cache probes are on, or why there are none (a
    /// line to say once; None when they were turned off).
    pub program_cache: Option<String>,
    /// The kernel's memory pressure, read beside the probes when there are
    /// slots (None without a slot source, or without PSI in the kernel).
    pub psi: Option<crate::kernel::psi::PsiSampler>,
}

/// The uprobes a target gets, by the settings that name them.
pub struct Uprobes<'a> {
    pub slot_source: Option<&'a SlotSourceSpec>,
    /// (the setting that named it, a function of `exe` or of the
    /// target's executable)
    pub loop_symbol: Option<(&'a str, &'a str)>,
    /// The target's executable when it is not running it yet (`record`);
    /// the loop symbol and the program cache are looked for in it.
    pub exe: Option<&'a Path>,
    /// (the setting, the mode): the program cache's functions, in the
    /// target's executable.
    pub program_cache: (&'a str, crate::kernel::cache_functions::Mode),
}

/// Attaches to `target`: `config` with its uprobes filled in from
/// `uprobes`.
pub fn attach(target: &Target, uprobes: Uprobes, config: ProbeConfig) -> anyhow::Result<Attached> {
    let Uprobes {
        slot_source,
        loop_symbol,
        exe,
        program_cache,
    } = uprobes;
    // The slot source runs beside the session and logs what it sees.
    let slot_log = SharedSlotLog::default();
    let source_task = match slot_source.and_then(SlotSourceSpec::rpc) {
        Some(ep) => Some(rpc::follow_in_background(ep.clone(), slot_log.clone())?),
        None => None,
    };
    let loop_uprobe = match loop_symbol {
        Some((setting, function)) => {
            let exe = exe
                .or(target.exe.as_deref())
                .with_context(|| format!("{setting}: cannot find the executable of pid {}", target.pid))?;
            Some(uprobe_target(exe, function)?)
        }
        None => None,
    };
    let slot_uprobe = match slot_source {
        Some(SlotSourceSpec::Uprobe { binary, function, .. }) => Some(uprobe_target(binary, function)?),
        _ => None,
    };
    let (cache_uprobes, program_cache) = program_cache_uprobes(exe.or(target.exe.as_deref()), program_cache)?;
    let (probes, ring) = Probes::load(&ProbeConfig {
        tgid: target.pid,
        slot_uprobe,
        loop_uprobe,
        cache_uprobes,
        ..config
    })?;
    let not_attached = probes
        .status
        .iter()
        .filter(|p| !p.attached)
        .map(|p| {
            format!(
                "{} on {} did not attach ({}); profiling without it",
                p.program,
                p.event,
                p.error.as_deref().unwrap_or("unknown error")
            )
        })
        .collect();
    Ok(Attached {
        probes,
        ring,
        slot_log,
        source_task,
        not_attached,
        program_cache,
        // Read for the slots' records only: a session without slots
        // does not pay for the reading thread.
        psi: slot_source
            .is_some()
            .then(|| crate::kernel::psi::PsiSampler::start(target.pid))
            .flatten(),
    })
}

/// The program cache's uprobes in the target's executable `exe`, and the
/// line that says what they are on (or why there are none).
fn program_cache_uprobes(
    exe: Option<&Path>,
    (setting, mode): (&str, crate::kernel::cache_functions::Mode),
) -> anyhow::Result<(Vec<crate::kernel::cache_functions::CacheUprobe>, Option<String>)> {
    use crate::kernel::cache_functions::Mode;
    if mode == Mode::Off {
        return Ok((Vec::new(), None));
    }
    let found = exe
        .context("cannot find the target's executable")
        .and_then(crate::kernel::cache_functions::find);
    match (found, mode) {
        (Ok(f), _) => {
            let mut line = format!(
                "program cache: {} functions of {} probed (uprobe and uretprobe each)",
                f.uprobes.len(),
                f.release
            );
            if !f.missing.is_empty() {
                line += &format!("; not in this binary: {}", f.missing.join(", "));
            }
            Ok((f.uprobes, Some(line)))
        }
        (Err(e), Mode::On) => Err(e.context(format!(
            "{setting} on (looked for: {})",
            crate::kernel::cache_functions::looked_for()
        ))),
        // One line: any program that is not a validator gets it.
        (Err(e), _) => Ok((
            Vec::new(),
            Some(format!(
                "program cache: not probed ({setting} auto): {e:#}; {setting} off stops looking"
            )),
        )),
    }
}

/// Where a uprobe on `function` of `binary` goes: (binary, file offset,
/// `binary:demangled name` for messages).
pub fn uprobe_target(binary: &Path, function: &str) -> anyhow::Result<(PathBuf, u64, String)> {
    let f = symbolizer::functions::find(binary, function)?;
    Ok((
        binary.to_path_buf(),
        f.file_offset,
        format!("{}:{}", binary.display(), f.name),
    ))
}
