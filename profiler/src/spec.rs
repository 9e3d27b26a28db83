//! What to measure: the settings every profiling mode shares, the one type
//! that `attach`/`record`'s flags (`cli::ProfileArgs`) and `run`'s
//! configuration file (`config::Config`) both lower into, each checking
//! its own input and saying which flag or key was wrong. The drivers read
//! only this; what is a mode's own (an output directory, an export
//! policy, a duration) stays beside it in that mode's options.

use std::time::Duration;

use crate::{detectors::DetectorConfig, phase::probe::ProbeConfig, slot_sources::SlotSourceSpec};

#[derive(Clone, Debug)]
pub struct ProfileSpec {
    /// On-CPU samples per second, per CPU.
    pub frequency_hz: u64,
    /// Off-CPU intervals shorter than this are counted, not kept.
    pub min_offcpu: Duration,
    /// See [`crate::kernel::probes::ProbeConfig::stack_repeat`].
    pub stack_repeat: Duration,
    /// Where slot boundaries come from; `None`: one profile for the session.
    pub slot_source: Option<SlotSourceSpec>,
    /// The main loop's per-iteration function (`--loop-symbol`,
    /// `detectors.loop_symbol`), in the target's executable.
    pub loop_symbol: Option<String>,
    /// Whether to probe the program cache (`--program-cache`,
    /// `detectors.program_cache`).
    pub program_cache: crate::kernel::program_cache::Mode,
    pub detectors: DetectorConfig,
    /// The guest-side phase probe, when on.
    pub phase_probe: Option<ProbeConfig>,
}
