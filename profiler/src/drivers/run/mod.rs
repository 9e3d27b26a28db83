//! Always-on mode: `slotprof run --config slotprof.toml`.
//!
//! The probes stay attached; events are decoded into a pending buffer and,
//! as each slot ends (plus a short grace for the ring buffer), the events up
//! to its end go through a fresh aggregator, the detectors and the export
//! (see [`export`]). Off-CPU intervals that straddle a slot's end are split
//! there; a thread still off-CPU at the end counts up to it, and the rest of
//! its interval counts in the next slots. Memory stays flat: nothing older
//! than the slot being processed is kept but counters, a bounded list of
//! recent findings and slot summaries, and the current hour's profile.
//!
//! SIGTERM/SIGINT: the slots that ended are processed and written, the
//! hour and the index flushed, the probes detached. SIGHUP: the
//! configuration is read again; a bad one is refused with the reason and
//! the running one kept.
//!
//! Not here: attaching (`attach`), the analysis of a batch of slots
//! (`pipeline`), the detectors (`detectors`); this folder is the driver
//! (`mod.rs`: the configuration, reloads, signals, push; [`follow`]: one
//! target followed while it lives; [`chunk`]: a run of finished slots
//! through the aggregator, the detectors and the export; [`serve`]: the
//! /metrics server and finding the target by name); the export itself is
//! `export::always_on`.

mod chunk;
mod follow;
mod serve;

use chunk::*;
use follow::*;
use serve::*;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use flamegraphs::pprof::{ProfileMeta, SampleType};
use symbolizer::Symbolizer;
use tokio::signal::unix::SignalKind;

use crate::{
    config::{Config, TargetSpec},
    export::metrics::{self, Snapshot},
    export::{always_on, push::Pusher, SlotExport, SlotResult},
    kernel::events::Event,
    kernel::probes::{Probes, StackCache},
    kernel::stream,
    kernel::target::Target,
    pipeline::aggregate::Aggregator,
    pipeline::slot_window::{place_in_slots, Pending},
    slot_sources::SharedSlotLog,
    slot_sources::SlotSourceSpec,
    slots::{monotonic_ns, Slot, Timeline},
};

/// How long after a slot's end its events are taken as complete.
const GRACE_NS: u64 = 30_000_000;

/// With folded off-CPU waits, slots wait this long past the fold span
/// for a thread's fold to come (it goes out at the thread's next switch).
const FOLD_GRACE_NS: u64 = 20_000_000;

/// Symbol tables unused this long are released (see
/// `Symbolizer::release_idle`): on the real node the validator's
/// decompressed debug sections and the kernel's symbols were ~18 MiB of
/// heap and its mapped file ~14 MiB of RSS, held for lookups that, once
/// warm, come minutes apart.
const SYMBOLS_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
/// How often the ring is drained and finished slots looked for.
const TICK: Duration = Duration::from_millis(50);

/// `slotprof run`'s command line: the configuration file and overrides.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub config: PathBuf,
    pub pid: Option<u32>,
    pub comm: Option<String>,
    pub export_dir: Option<PathBuf>,
    /// Stop after this long (tests, trials); default: until SIGTERM.
    pub duration: Option<Duration>,
}

fn load(o: &RunOptions) -> anyhow::Result<Config> {
    let mut c = Config::load(&o.config)?;
    if let Some(p) = o.pid {
        c.target = TargetSpec::Pid(p);
    }
    if let Some(comm) = &o.comm {
        c.target = TargetSpec::Comm(comm.clone());
    }
    if let Some(d) = &o.export_dir {
        c.export_dir = d.clone();
    }
    Ok(c)
}

/// Why one attachment ended.
enum End {
    Stop,
    /// SIGHUP: read the configuration again.
    Hup,
    /// A new configuration that needs the probes attached again.
    Reload(Box<Prepared>),
    TargetExited,
}

/// Whether `new` changes what the probes or the slot source do (else it
/// is applied in place, without a gap in the profile).
fn needs_reattach(old: &Config, new: &Config) -> bool {
    old.target != new.target
        || old.spec.frequency_hz != new.spec.frequency_hz
        || old.spec.min_offcpu != new.spec.min_offcpu
        || old.spec.stack_repeat != new.spec.stack_repeat
        || old.spec.offcpu != new.spec.offcpu
        || old.spec.slot_source != new.spec.slot_source
        || old.spec.loop_symbol != new.spec.loop_symbol
        || old.spec.program_cache != new.spec.program_cache
        || old.spec.phase_probe != new.spec.phase_probe
        || old.metrics_listen != new.metrics_listen
}

/// A reloaded configuration made ready to take over: everything that can
/// fail (the new /metrics port, a pid that must exist, uprobe functions
/// that must resolve) is done before the running configuration is given up.
struct Prepared {
    config: Config,
    listener: Option<tokio::net::TcpListener>,
}

async fn prepare(o: &RunOptions, running: &Config) -> anyhow::Result<Prepared> {
    let mut config = load(o)?;
    if let Some(w) = keep_export_dir(&mut config, running) {
        eprintln!("slotprof: warning: {w}");
    }
    if config.target != running.target {
        if let TargetSpec::Pid(p) = config.target {
            Target::from_pid(p).with_context(|| format!("target.pid = {p}"))?;
        }
    }
    if config.spec.slot_source != running.spec.slot_source {
        if let Some(SlotSourceSpec::Uprobe { binary, function, .. }) = &config.spec.slot_source {
            crate::kernel::attach::uprobe_target(binary, function).context("slots.source")?;
        }
    }
    let loop_changed = config.spec.loop_symbol != running.spec.loop_symbol || config.target != running.target;
    if let (true, Some(f), Ok(target)) = (
        loop_changed,
        &config.spec.loop_symbol,
        find_target(&config.target),
    ) {
        if let Some(exe) = &target.exe {
            crate::kernel::attach::uprobe_target(exe, f).context("detectors.loop_symbol")?;
        }
    }
    let listener = if config.metrics_listen != running.metrics_listen {
        Some(bind_metrics(&config).await?)
    } else {
        None
    };
    Ok(Prepared { config, listener })
}

/// export.dir applies at a restart only (the export's files, ledger and
/// numbering are the running directory's): a reload keeps the running one
/// and says so (the status line had named the new directory, where
/// nothing was written). The warning, when the file changed it.
fn keep_export_dir(new: &mut Config, running: &Config) -> Option<String> {
    if new.export_dir == running.export_dir {
        return None;
    }
    let asked = std::mem::replace(&mut new.export_dir, running.export_dir.clone());
    Some(format!(
        "export.dir = {} applies when slotprof restarts; until then the export stays in {}",
        asked.display(),
        running.export_dir.display()
    ))
}

/// [`prepare`] for a SIGHUP, with systemd told that a reload began.
async fn reload(o: &RunOptions, running: &Config) -> anyhow::Result<Prepared> {
    crate::sd_notify::notify(&format!(
        "RELOADING=1\nMONOTONIC_USEC={}",
        crate::sd_notify::monotonic_usec()
    ));
    prepare(o, running).await
}

fn refused(e: &anyhow::Error) {
    eprintln!("slotprof: error: the new configuration is refused, the running one stays: {e:#}");
    crate::sd_notify::notify(
        "READY=1\nSTATUS=the new configuration was refused; the running one stays (see the log)",
    );
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    deadline: Option<tokio::time::Instant>,
    /// systemd's watchdog, pinged by the loops that wait on these.
    watchdog: crate::sd_notify::Watchdog,
}

impl Signals {
    /// Waits for a signal or the deadline: Stop or Reload.
    async fn next(&mut self) -> End {
        let deadline = self.deadline;
        tokio::select! {
            _ = self.term.recv() => End::Stop,
            _ = self.int.recv() => End::Stop,
            _ = self.hup.recv() => End::Hup,
            _ = async move {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => End::Stop,
        }
    }
}

/// How long stopping waits for the push queues to empty.
const STOP_PUSH_WAIT: Duration = Duration::from_secs(5);

/// The pusher of `config` (None when push is off), its counts in /metrics.
fn start_push(config: &Config, snapshot: &Arc<Mutex<Snapshot>>) -> Option<Pusher> {
    let p = config
        .push
        .is_on()
        .then(|| Pusher::start(&config.push, "slotprof", None));
    snapshot.lock().unwrap().push = p.as_ref().map(Pusher::stats).unwrap_or_default();
    p
}

/// After a reload: a new pusher if the push settings changed (the old one
/// gets a moment to send what it holds).
async fn repush(pusher: &mut Option<Pusher>, old: &Config, new: &Config, snapshot: &Arc<Mutex<Snapshot>>) {
    if old.push == new.push {
        return;
    }
    if let Some(p) = pusher.take() {
        p.drain(Duration::from_secs(2)).await;
    }
    *pusher = start_push(new, snapshot);
}

/// Runs until SIGTERM/SIGINT (or `--duration`).
pub async fn run(o: RunOptions) -> anyhow::Result<()> {
    let mut config = load(&o)?;
    let mut exporter = always_on::Exporter::open(&config.export_policy())?;
    let snapshot = Arc::new(Mutex::new(Snapshot::default()));
    let mut pusher = start_push(&config, &snapshot);
    let mut server = start_metrics(&config, &snapshot).await?;
    let mut signals = Signals {
        term: tokio::signal::unix::signal(SignalKind::terminate())?,
        int: tokio::signal::unix::signal(SignalKind::interrupt())?,
        hup: tokio::signal::unix::signal(SignalKind::hangup())?,
        deadline: o.duration.map(|d| tokio::time::Instant::now() + d),
        watchdog: crate::sd_notify::Watchdog::from_env(),
    };
    let mut lost_before = HashMap::new();
    let mut waiting_said = false;
    // The configuration before the last reload, until the new one has
    // followed the target: if attaching under it fails, slotprof goes back.
    let mut previous: Option<Config> = None;
    loop {
        let end = match find_target(&config.target) {
            Ok(target) => {
                waiting_said = false;
                let followed = follow(
                    &o,
                    &config,
                    target,
                    (&mut exporter, &mut pusher),
                    &snapshot,
                    &mut signals,
                    &mut lost_before,
                )
                .await;
                match (followed, previous.take()) {
                    (Ok(end), _) => end,
                    (Err(e), Some(old)) => {
                        refused(&e);
                        if old.metrics_listen != config.metrics_listen {
                            server.abort();
                            server = start_metrics(&old, &snapshot).await?;
                        }
                        exporter.reconfigure(&old.export_policy());
                        repush(&mut pusher, &config, &old, &snapshot).await;
                        config = old;
                        continue;
                    }
                    (Err(e), None) => return Err(e),
                }
            }
            Err(why) => {
                if let TargetSpec::Pid(_) = config.target {
                    if let Some(old) = previous.take() {
                        refused(&anyhow::anyhow!("{why}"));
                        config = old;
                        continue;
                    }
                    anyhow::bail!("{why}");
                }
                if !waiting_said {
                    eprintln!("slotprof: {why}; waiting for it (checked every second)");
                    crate::sd_notify::notify(&format!("READY=1\nSTATUS=waiting for the target: {why}"));
                    waiting_said = true;
                }
                signals.watchdog.ping();
                tokio::select! {
                    e = signals.next() => e,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        match end {
            End::Stop => break,
            End::TargetExited => {
                if let TargetSpec::Pid(p) = config.target {
                    eprintln!(
                        "slotprof: pid {p} exited; nothing left to profile (give `comm` to follow restarts)"
                    );
                    break;
                }
                eprintln!("slotprof: the target exited; waiting for it to start again");
            }
            End::Hup => match reload(&o, &config).await {
                Ok(new) => {
                    if let Some(listener) = new.listener {
                        server.abort();
                        server = serve_metrics(listener, &new.config, &snapshot)?;
                    }
                    exporter.reconfigure(&new.config.export_policy());
                    repush(&mut pusher, &config, &new.config, &snapshot).await;
                    previous = Some(std::mem::replace(&mut config, new.config));
                    eprintln!("slotprof: configuration reloaded from {}", o.config.display());
                    crate::sd_notify::notify("READY=1");
                }
                Err(e) => refused(&e),
            },
            End::Reload(new) => {
                let new = *new;
                if let Some(listener) = new.listener {
                    server.abort();
                    server = serve_metrics(listener, &new.config, &snapshot)?;
                }
                exporter.reconfigure(&new.config.export_policy());
                repush(&mut pusher, &config, &new.config, &snapshot).await;
                previous = Some(std::mem::replace(&mut config, new.config));
                eprintln!(
                    "slotprof: configuration reloaded from {} (probes attached again)",
                    o.config.display()
                );
            }
        }
    }
    crate::sd_notify::notify("STOPPING=1");
    if let Some(p) = pusher {
        p.drain(STOP_PUSH_WAIT).await;
    }
    server.abort();
    eprintln!(
        "slotprof: stopped; export in {} ({:.1} MiB)",
        config.export_dir.display(),
        exporter.bytes() as f64 / (1 << 20) as f64
    );
    Ok(())
}

#[cfg(test)]
mod reload_tests {
    use super::*;

    #[test]
    fn a_reload_keeps_the_running_export_dir_and_says_the_new_one_waits_for_a_restart() {
        let config =
            |dir: &str| Config::parse(&format!("[target]\npid = 1\n[export]\ndir = \"{dir}\"\n")).unwrap();
        let running = config("/var/lib/slotprof");
        let mut same = config("/var/lib/slotprof");
        assert_eq!(keep_export_dir(&mut same, &running), None);
        let mut moved = config("/srv/elsewhere");
        let w = keep_export_dir(&mut moved, &running).unwrap();
        assert_eq!(moved.export_dir, running.export_dir);
        assert!(
            w.contains("/srv/elsewhere applies when slotprof restarts")
                && w.contains("stays in /var/lib/slotprof"),
            "{w}"
        );
    }
}
