//! One profiling session: attach, collect until told to stop, write.
//!
//! [`live`] attaches and collects (the event loop), [`analysis`] runs the
//! detectors and the phase analysis on what was collected, [`outputs`]
//! writes the profiles, the per-slot export and the summary.

mod analysis;
mod live;
mod outputs;

use analysis::*;
use live::*;
use outputs::*;

use std::{
    collections::HashMap,
    io::{IsTerminal, Write},
    os::fd::AsFd,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::Context;
use flamegraphs::pprof::{ProfileMeta, SampleType};
use symbolizer::Symbolizer;
use tokio::signal::unix::SignalKind;

use crate::{
    detectors,
    export::report::{self, EventCounts, FramePointers, Lost, Summary, TargetSummary},
    export::{push::Pusher, slot_export, SlotExport, SlotResult},
    kernel::events,
    kernel::probes::{Probes, StackCache},
    kernel::stream,
    kernel::target::{symbolizer_for, wait_for_exec, MapsErrors, Target},
    pipeline::aggregate::{Aggregator, Profiles, Row, RowKey, StackTable},
    slot_sources::SharedSlotLog,
    slot_sources::SlotSourceSpec,
    slots::{monotonic_ns, Timeline},
};

/// How a session runs.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// What to measure (shared with `run`).
    pub spec: crate::spec::ProfileSpec,
    /// Stop after this long; `None` runs until Ctrl-C or the target exits.
    pub duration: Option<Duration>,
    pub out: PathBuf,
    /// "attach" or "record", for the summary.
    pub command: &'static str,
    /// Measure the probes' own cost (see [`ProbeConfig::probe_stats`](crate::kernel::probes::ProbeConfig::probe_stats)).
    pub probe_stats: bool,
    /// The target's executable when known before it runs (`record`).
    pub exe: Option<PathBuf>,
    /// Attach the detectors' probes (see [`ProbeConfig::detector_probes`](crate::kernel::probes::ProbeConfig::detector_probes)).
    pub detector_probes: bool,
    /// Write every raw record here too (see [`crate::kernel::events::write_raw`]).
    pub save_events: Option<PathBuf>,
    /// Write a recording for `replay` here.
    pub save_replay: Option<PathBuf>,
    /// Push the slots' profiles to a profiling backend (needs a slot source).
    pub push: crate::spec::PushConfig,
}

pub use crate::kernel::target::HeldChild;

/// What a finished session produced.
pub struct Outcome {
    pub summary: Summary,
    pub summary_path: PathBuf,
    /// Warnings already printed while the session ran (not to repeat).
    pub printed: Vec<String>,
    /// `record`: how the command ended, when it ended the session.
    pub command_status: Option<std::process::ExitStatus>,
}

enum Stop {
    Duration,
    Interrupted,
    TargetExited,
}

/// Runs a session against `target` (and, for `record`, its held child).
pub async fn run(opts: &SessionOptions, target: Target, held: Option<HeldChild>) -> anyhow::Result<Outcome> {
    let (pid, comm) = (target.pid, target.comm.clone());
    let mut live = Live::start(opts, target, held)
        .await
        .map_err(|e| gone_while_attaching(e, pid, &comm))?;
    let stop = live.pump(opts).await?;
    let command_status = live.command_status;
    let collected = live.collect(opts)?;
    let mut outcome = report(opts, collected, stop).await?;
    outcome.command_status = command_status;
    Ok(outcome)
}

/// An attach that failed because the target exited meanwhile says so
/// first (issue 42, case 10: a target gone mid-attach was reported as a
/// missing CAP_SYS_PTRACE, the error of whichever /proc read came first).
fn gone_while_attaching(e: anyhow::Error, pid: u32, comm: &str) -> anyhow::Error {
    if crate::sys::is_running(pid) {
        return e;
    }
    // (The /proc read that failed is no news: the process is gone.)
    anyhow::anyhow!(
        "pid {pid} ({comm}) exited while slotprof was attaching, before anything was profiled: \
         attach again while it runs, or profile a command from its start with `slotprof record -- COMMAND`"
    )
}

/// A session's side of the event stream: the aggregator, the slot log
/// (slot marks), the raw recording (`--save-events`) and the stack ids
/// seen since the last sweep.
struct SessionSink<'a> {
    pub(super) agg: &'a mut Aggregator,
    pub(super) slot_log: &'a SharedSlotLog,
    pub(super) saved: Option<&'a mut std::io::BufWriter<std::fs::File>>,
    pub(super) stack_ids: &'a mut Vec<i32>,
}

impl stream::Sink for SessionSink<'_> {
    fn event(&mut self, event: events::Event) {
        match event {
            events::Event::SlotMark(m) => self.slot_log.lock().unwrap().marks.push((m.ts_ns, m.arg0)),
            event => {
                self.stack_ids
                    .extend(event.stack_ids().into_iter().filter(|&id| id >= 0));
                self.agg.ingest(&event);
            }
        }
    }

    fn malformed(&mut self) {
        self.agg.note_malformed();
    }

    fn raw(&mut self, record: &[u8]) {
        if let Some(w) = self.saved.as_deref_mut() {
            if events::write_raw(w, record).is_err() {
                self.agg.note_malformed();
            }
        }
    }
}
