//! What leaves slotprof: the files of a session ([`report`]: folded,
//! SVG, pprof, summary.json; [`slot_export`]: per-slot and per-window
//! directories, trace.json, index.html), the always-on export directory
//! with its hourly profiles and retention ([`always_on`]), the Prometheus
//! endpoint ([`metrics`]) with the export's files beside it ([`served`]:
//! flamegraphs `run` left undrawn are drawn there) and pushing to a profiling backend ([`push`]:
//! Pyroscope, OTLP).
//!
//! Every exporter of slots takes them the same way, through
//! [`SlotExport`]: a session's slot directories ([`slot_export::SlotWriter`]),
//! the always-on export with its windows and hours
//! ([`always_on::Exporter`]), the metrics' per-slot counts
//! ([`metrics::SlotMetrics`]) and the push to a backend ([`push::Pusher`]).
//!
//! Not here: writing a file atomically (`output`), and deciding what is in
//! a slot (`pipeline`).

pub mod always_on;
pub mod metrics;
pub mod push;
pub mod report;
pub mod served;
pub mod slot_export;
pub mod timeline_page;

use flamegraphs::pprof::ProfileMeta;

use crate::{detectors::Finding, pipeline::aggregate::Profiles, slots::Slot};

/// One finished slot, as every exporter receives it.
pub struct SlotResult<'a> {
    pub slot: &'a Slot,
    pub profiles: &'a Profiles,
    /// The findings of the slot's batch; the slot's own are those placed
    /// in it (`Finding::slot`).
    pub findings: &'a [Finding],
    /// "slow" or "fast" by the phase probe, when it runs.
    pub phase: Option<&'static str>,
    /// The kernel's memory pressure (PSI) over the slot, when read.
    pub memory_pressure: Option<crate::kernel::psi::SlotPressure>,
    pub meta: &'a ProfileMeta,
    /// The sampling period (ns): samples x period is on-CPU time.
    pub period_ns: u64,
}

/// What an exporter does with slots: each as it is finished, in slot
/// order, then the end (what is still open: a window, an hour, an index).
pub trait SlotExport {
    fn slot(&mut self, s: &SlotResult<'_>) -> anyhow::Result<()>;
    fn finish(&mut self, meta: &ProfileMeta) -> anyhow::Result<()>;
}
