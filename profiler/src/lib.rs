//! slotprof's userspace: loads the probes, turns their events into
//! profiles and findings, and writes files that open in the tools operators
//! already use.
//!
//! The data flows one way, and the folders follow it:
//! - [`kernel`]: probes loaded and attached, the ring buffer drained and
//!   decoded, stacks unwound, the target read;
//! - [`pipeline`]: a window of events (a session, or a batch of finished
//!   slots) aggregated, cut into slots, its stacks named, and the
//!   detectors run over it; [`pipeline::replay`] runs the same on a
//!   recording, without a kernel;
//! - [`detectors`]: pure functions from events to findings, one per kind;
//! - [`export`]: what leaves: session files, the always-on export,
//!   metrics, all taking slots through one trait;
//! - [`drivers`]: the modes (`attach`/`record`, `run`, `host`), each a loop
//!   that pumps events in and results out, and the two that read what they
//!   wrote (`explain`, `diff`).
//!
//! Beside them, the vocabulary every folder shares: [`records`] (the
//! decoded record types), [`slots`] (slots and the timeline), [`topology`],
//! [`phase`], [`slot_sources`]; settings ([`cli`], [`config`],
//! [`duration`], and [`spec`]: what every mode measures, one type both
//! lower into); and the plumbing ([`sys`]: every libc call, [`output`]:
//! atomic files, [`background`], [`sd_notify`]).

pub mod background;
pub mod cli;
pub mod config;
pub mod detectors;
pub mod drivers;
pub mod duration;
pub mod export;
pub mod kernel;
pub mod output;
pub mod phase;
pub mod pipeline;
pub mod records;
pub mod sd_notify;
pub mod slot_sources;
pub mod slots;
pub mod spec;
pub mod sys;
pub mod topology;

/// slotprof's version, as written into every summary.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
