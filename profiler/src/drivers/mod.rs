//! The modes, each a loop that pumps events from the kernel side
//! (`kernel`) into the pipeline (`pipeline`, `detectors`) and results out
//! to the exporters (`export`): [`session`] (`attach` and `record`: one
//! window, the whole session), [`run`] (always on: finished slots in
//! batches, their exports as they end, reloads, the daemon's resilience)
//! and [`host`] (on the hypervisor: the host's memory management against
//! its VMs); and the modes that read what those wrote: [`explain`] (which
//! stall class costs the slots) and [`diff`] (two profiles against each
//! other).
//!
//! Not here: anything a mode does with events that another mode does too.

pub mod diff;
pub(crate) mod exact_threads;
pub mod explain;
pub mod host;
pub mod run;
pub mod session;

use std::path::Path;

use crate::{
    kernel::{
        attach::{attach, Attached, Uprobes},
        probes::ProbeConfig,
        target::Target,
    },
    slot_sources::SlotSourceSpec,
    spec::ProfileSpec,
};

/// What a mode adds to its [`ProfileSpec`] when it attaches.
pub(crate) struct AttachAs<'a> {
    /// How the mode's user names the main-loop function and the program
    /// cache settings (`--loop-symbol`, `detectors.loop_symbol`): errors
    /// name what to change.
    pub(crate) loop_symbol: &'static str,
    pub(crate) program_cache: &'static str,
    /// The target's executable when it is not running it yet (`record`).
    pub(crate) exe: Option<&'a Path>,
    /// Have the kernel time every program run.
    pub(crate) probe_stats: bool,
    /// Attach the detectors' probes.
    pub(crate) detector_probes: bool,
    /// The threads whose waits never fold, known before attaching.
    pub(crate) exact_tids: std::collections::BTreeSet<u32>,
}

/// Attaches the probes `spec` asks for to `target`, with `slot_source`
/// (the spec's, or the mode's default): the one attach every mode on a
/// target does.
pub(crate) fn attach_spec(
    target: &Target,
    spec: &ProfileSpec,
    slot_source: Option<&SlotSourceSpec>,
    how: AttachAs,
) -> anyhow::Result<Attached> {
    attach(
        target,
        Uprobes {
            slot_source,
            loop_symbol: spec.loop_symbol.as_deref().map(|f| (how.loop_symbol, f)),
            exe: how.exe,
            program_cache: (how.program_cache, spec.program_cache),
        },
        ProbeConfig {
            tgid: target.pid,
            min_offcpu: spec.min_offcpu,
            stack_repeat: spec.stack_repeat,
            freq_hz: spec.frequency_hz,
            fold_under: spec.offcpu.fold_under(),
            probe_stats: how.probe_stats,
            slot_uprobe: None,
            loop_uprobe: None,
            cache_uprobes: Vec::new(),
            detector_probes: how.detector_probes,
            exact_tids: how.exact_tids,
        },
    )
}
