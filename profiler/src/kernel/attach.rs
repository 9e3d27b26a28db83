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
}

/// Attaches to `target`: `config` with its uprobes filled in from
/// `slot_source` and `loop_symbol` ((the setting that named it, a function
/// of `exe` or of the target's executable)).
pub fn attach(
    target: &Target,
    slot_source: Option<&SlotSourceSpec>,
    loop_symbol: Option<(&str, &str)>,
    exe: Option<&Path>,
    config: ProbeConfig,
) -> anyhow::Result<Attached> {
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
    let mut probes = Probes::load(&ProbeConfig {
        tgid: target.pid,
        slot_uprobe,
        loop_uprobe,
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
    let ring = RingReader::start(probes.take_events()?)?;
    Ok(Attached {
        probes,
        ring,
        slot_log,
        source_task,
        not_attached,
    })
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
