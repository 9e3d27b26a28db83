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
//! (`mod.rs`: the configuration, reloads, following targets by name) and
//! the per-slot, per-window and hourly export (`export::always_on`).

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
    kernel::probes::{ProbeConfig, Probes, StackCache},
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

async fn start_metrics(
    config: &Config,
    snapshot: &Arc<Mutex<Snapshot>>,
) -> anyhow::Result<crate::background::Background> {
    serve_metrics(bind_metrics(config).await?, config, snapshot)
}

async fn bind_metrics(config: &Config) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(config.metrics_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} for /metrics (metrics.listen): is another slotprof running? choose \
                 another port",
                config.metrics_listen
            )
        })
}

fn serve_metrics(
    listener: tokio::net::TcpListener,
    config: &Config,
    snapshot: &Arc<Mutex<Snapshot>>,
) -> anyhow::Result<crate::background::Background> {
    eprintln!("slotprof: metrics on http://{}/metrics", listener.local_addr()?);
    Ok(metrics::serve_in_background(
        listener,
        snapshot.clone(),
        config.export_dir.clone(),
    )?)
}

/// The process to profile: by pid, or the oldest process with this name
/// (its main thread's comm, or its executable's file name).
fn find_target(spec: &TargetSpec) -> Result<Target, String> {
    match spec {
        TargetSpec::Pid(p) => Target::from_pid(*p).map_err(|e| format!("{e:#}")),
        TargetSpec::Comm(c) => {
            let mut found: Vec<(u64, u32)> = Vec::new();
            for e in std::fs::read_dir("/proc").map_err(|e| e.to_string())?.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
                let exe_name = exe.as_ref().and_then(|e| e.file_name()).and_then(|n| n.to_str());
                if !names_match(c, comm.trim_end(), exe_name) || pid == std::process::id() {
                    continue;
                }
                let start = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| {
                        s.rsplit_once(") ")
                            .and_then(|(_, r)| r.split_whitespace().nth(19)?.parse().ok())
                    })
                    .unwrap_or(u64::MAX);
                found.push((start, pid));
            }
            let (_, pid) = found
                .into_iter()
                .min()
                .ok_or_else(|| format!("no process named {c:?} is running (target.comm)"))?;
            Target::from_pid(pid).map_err(|e| format!("{e:#}"))
        }
    }
}

/// Whether a process is the one `target.comm` names: its comm (which the
/// kernel cuts to 15 bytes: `solana-test-validator` runs as
/// `solana-test-val`, so a longer name matches on its first 15), or its
/// executable's file name.
fn names_match(wanted: &str, comm: &str, exe_name: Option<&str>) -> bool {
    const COMM_MAX: usize = 15;
    let comm_matches = comm == wanted
        || (wanted.len() > COMM_MAX
            && comm.len() == COMM_MAX
            && wanted.as_bytes().starts_with(comm.as_bytes()));
    comm_matches || exe_name == Some(wanted)
}

/// Slots that ended (with the grace) after `after_ns` and before `now`.
fn finished_slots(
    spec: &SlotSourceSpec,
    log: &SharedSlotLog,
    (origin, base): (u64, u64),
    after_ns: u64,
    now: u64,
) -> Vec<Slot> {
    let cutoff = now.saturating_sub(GRACE_NS);
    let timeline = match spec {
        // An origin given is the user's numbering; the default one goes on
        // from the export's.
        SlotSourceSpec::Clock {
            slot,
            origin_ns: Some(o),
            leader,
        } => Timeline::clock(*slot, *o, *leader, after_ns, cutoff),
        SlotSourceSpec::Clock {
            slot,
            origin_ns: None,
            leader,
        } => Timeline::clock_from(*slot, (origin, base), *leader, after_ns, cutoff),
        SlotSourceSpec::Rpc(_) => log.lock().unwrap().timeline(now),
        SlotSourceSpec::Uprobe { numbers, .. } => log.lock().unwrap().uprobe_timeline(*numbers, now),
    };
    timeline
        .slots()
        .iter()
        .filter(|s| s.start_ns >= after_ns && s.end_ns <= cutoff && s.end_ns < now)
        .cloned()
        .collect()
}

/// Returns freed heap memory to the system. Writing an hour's or a
/// window's flamegraphs takes tens of MiB for a moment, and glibc keeps
/// what is freed: without this the daemon's resident memory stays at that
/// peak (measured: 46 -> 63 MiB at the first hour change, then flat).
/// Every 10 s; it costs well under a millisecond.
pub(crate) fn give_back_freed_memory() {
    crate::sys::malloc_trim();
}

/// The guest-side phase probe over the last minute.
struct Phase {
    probe: crate::phase::probe::RunningProbe,
    every: Duration,
    cpus: Vec<u32>,
    windows: std::collections::VecDeque<crate::phase::probe::Window>,
    strongest: Option<crate::phase::analysis::CpuPhases>,
    analysed: Option<Instant>,
}

impl Phase {
    /// Starts the phase probe on the configured CPUs (all online ones by
    /// default).
    fn start(c: &crate::phase::probe::PhaseProbeConfig) -> Phase {
        let cpus = c.cpus();
        Phase {
            probe: crate::phase::probe::start(c),
            every: c.every,
            cpus,
            windows: Default::default(),
            strongest: None,
            analysed: None,
        }
    }

    fn of(&mut self, ts: u64) -> Option<&'static str> {
        let new = self.probe.take();
        self.windows.extend(new);
        let horizon = monotonic_ns().saturating_sub(60_000_000_000);
        while self.windows.front().is_some_and(|w| w.ts_ns < horizon) {
            self.windows.pop_front();
        }
        if self
            .analysed
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(10))
        {
            self.analysed = Some(Instant::now());
            let w: Vec<_> = self.windows.iter().cloned().collect();
            self.strongest = self
                .cpus
                .iter()
                .filter_map(|&cpu| crate::phase::analysis::analyze_cpu(cpu, &w, self.every))
                .max_by(|a, b| a.slowdown.total_cmp(&b.slowdown));
        }
        let p = self.strongest.as_ref().filter(|p| p.slowdown >= 0.05)?;
        crate::phase::analysis::slow_at(p, ts).map(|slow| if slow { "slow" } else { "fast" })
    }
}

/// Profiles one process until it exits, a signal, or the deadline.
async fn follow(
    o: &RunOptions,
    config: &Config,
    target: Target,
    (exporter, pusher): (&mut always_on::Exporter, &mut Option<Pusher>),
    snapshot: &Arc<Mutex<Snapshot>>,
    signals: &mut Signals,
    lost_before: &mut HashMap<String, u64>,
) -> anyhow::Result<End> {
    let mut f = Follow::start(config, &target, snapshot, exporter.next_slot_number())?;
    if let Some(p) = pusher.as_mut() {
        p.follow(&target.name(), f.slot_log.clone());
    }
    // Attached until the probes are gone, however this function returns.
    let attached = AttachedMark(snapshot.clone());
    crate::sd_notify::notify(&format!(
        "READY=1\nSTATUS=profiling {} (pid {}); export in {}",
        target.comm,
        target.pid,
        config.export_dir.display()
    ));
    let topology = crate::topology::Topology::of(config.spec.detectors.topology.as_deref())?;
    let blocks = block_fetcher(config);
    let mut chunk = Chunk {
        config: config.clone(),
        target: &target,
        topology: &topology,
        exporter,
        pusher: pusher.as_mut(),
        snapshot,
        blocks: blocks.as_ref(),
    };
    let mut tick = tokio::time::interval(TICK);
    let end = loop {
        tokio::select! {
            batch = f.ring.recv() => match batch {
                Some(batch) => {
                    let began = std::time::Instant::now();
                    stream::feed(
                        &batch,
                        &mut f.stacks.user,
                        &mut RunSink { pending: &mut f.pending, slot_log: &f.slot_log },
                    );
                    f.losses.busy(began.elapsed(), f.ring.queued_bytes());
                }
                None => anyhow::bail!("the ring buffer's reader thread ended"),
            },
            e = signals.next() => match e {
                End::Hup => match reload(o, &chunk.config).await {
                    Ok(new) if needs_reattach(&chunk.config, &new.config) => break End::Reload(Box::new(new)),
                    Ok(new) if new.config.push != chunk.config.push => break End::Reload(Box::new(new)),
                    Ok(new) => {
                        let new = new.config;
                        chunk.exporter.reconfigure(&new.export_policy());
                        chunk.config = new;
                        eprintln!("slotprof: configuration reloaded from {} (applied in place)", o.config.display());
                        crate::sd_notify::notify("READY=1");
                    }
                    Err(e) => refused(&e),
                },
                e => break e,
            },
            _ = tick.tick() => {
                signals.watchdog.ping();
                if !f.tick(&mut chunk, lost_before)? {
                    break End::TargetExited;
                }
            }
        }
    };
    f.finish(&mut chunk, lost_before)?;
    // Detached now, in /metrics too; the last blocks' outcomes are waited
    // for after that (their slots confirm seconds after they end).
    drop(attached);
    if let Some(b) = blocks {
        // A target that exited took its RPC with it, most likely: its last
        // slots are counted as not asked. Stopping waits for them.
        let within = match end {
            End::TargetExited => Duration::ZERO,
            _ => Duration::from_secs(6),
        };
        eprintln!("slotprof: {}", b.finish(within).await);
    }
    Ok(end)
}

/// The block-outcome fetcher, when the slot source has the node's RPC and
/// the configuration wants outcomes.
fn block_fetcher(config: &Config) -> Option<crate::slot_sources::blocks::Fetcher> {
    let ep = config.spec.slot_source.as_ref()?.rpc()?;
    config
        .block_outcomes
        .then(|| crate::slot_sources::blocks::Fetcher::start(ep.clone(), config.export_dir.clone()))
}

/// One target followed by `slotprof run`: its probes and event stream,
/// the events waiting for their slot to end, and how far slots are done.
struct Follow {
    slot_source: SlotSourceSpec,
    probes: Probes,
    ring: crate::kernel::ring_reader::RingReader,
    slot_log: SharedSlotLog,
    source_task: Option<crate::background::Background>,
    /// When following began (CLOCK_MONOTONIC ns): a clock source's origin,
    /// and the number its first slot takes there (issue 42, case 11: the
    /// numbers already in the export are never taken again, across
    /// restarts of slotprof and of the target).
    origin: (u64, u64),
    sym: Symbolizer,
    maps_errors: crate::kernel::target::MapsErrors,
    phase: Option<Phase>,
    psi: Option<crate::kernel::psi::PsiSampler>,
    pending: Pending,
    stacks: StackCache,
    /// Slots are processed up to here.
    processed_until: u64,
    ticks: u64,
    losses: LossReport,
}

impl Follow {
    /// Attaches to `target`, starts its slot source and the phase probe.
    fn start(
        config: &Config,
        target: &Target,
        snapshot: &Arc<Mutex<Snapshot>>,
        next_number: u64,
    ) -> anyhow::Result<Follow> {
        let slot_source = config.spec.slot_source.clone().unwrap_or(SlotSourceSpec::Clock {
            slot: Duration::from_millis(400),
            origin_ns: None,
            leader: None,
        });
        let crate::kernel::attach::Attached {
            probes,
            ring,
            slot_log,
            source_task,
            not_attached,
            program_cache,
            psi,
        } = crate::kernel::attach::attach(
            target,
            crate::kernel::attach::Uprobes {
                slot_source: Some(&slot_source),
                loop_symbol: config
                    .spec
                    .loop_symbol
                    .as_deref()
                    .map(|f| ("detectors.loop_symbol", f)),
                exe: None,
                program_cache: ("detectors.program_cache", config.spec.program_cache),
            },
            ProbeConfig {
                tgid: target.pid,
                min_offcpu: config.spec.min_offcpu,
                stack_repeat: config.spec.stack_repeat,
                freq_hz: config.spec.frequency_hz,
                probe_stats: false,
                slot_uprobe: None,
                loop_uprobe: None,
                cache_uprobes: Vec::new(),
                detector_probes: true,
            },
        )?;
        if let Some(line) = program_cache {
            eprintln!("slotprof: {line}");
        }
        for w in &not_attached {
            eprintln!("slotprof: warning: {w}");
        }
        // Said at the first attach, not again at each target restart.
        static KALLSYMS_SAID: std::sync::Once = std::sync::Once::new();
        KALLSYMS_SAID.call_once(|| {
            if let Some(w) = crate::kernel::privileges::kernel_symbols_warning() {
                eprintln!("slotprof: warning: {w}");
            }
        });
        let origin = (monotonic_ns(), next_number);
        eprintln!(
            "slotprof: profiling {} (pid {}) at {} Hz; per-slot export in {}",
            target.comm,
            target.pid,
            config.spec.frequency_hz,
            config.export_dir.display()
        );
        let f = Follow {
            slot_source,
            probes,
            ring,
            slot_log,
            source_task,
            origin,
            sym: crate::kernel::target::symbolizer_for(target.pid)?,
            maps_errors: crate::kernel::target::MapsErrors::default(),
            phase: config.spec.phase_probe.as_ref().map(Phase::start),
            psi,
            pending: Pending::default(),
            stacks: StackCache::default(),
            processed_until: origin.0,
            ticks: 0,
            losses: LossReport::default(),
        };
        let mut s = snapshot.lock().unwrap();
        s.slot_source = match &f.slot_source {
            SlotSourceSpec::Rpc(_) => "rpc",
            SlotSourceSpec::Uprobe { .. } => "uprobe",
            _ => "clock",
        };
        s.slot_source_healthy = f.source_healthy();
        s.target_attached = true;
        drop(s);
        Ok(f)
    }

    /// Whether the slot source is giving slots (a clock always is).
    fn source_healthy(&self) -> bool {
        self.slot_source.rpc().is_none() || self.slot_log.lock().unwrap().healthy
    }

    /// Every tick: the queue drained, finished slots processed and
    /// exported, now and then the maps, the losses and the metrics'
    /// gauges. False once the target is gone.
    fn tick(&mut self, chunk: &mut Chunk, lost_before: &mut HashMap<String, u64>) -> anyhow::Result<bool> {
        // Everything this tick does counts as busy (the maps re-read, the
        // drain and the slots' processing alike).
        let began = std::time::Instant::now();
        self.ticks += 1;
        let (ticks, pid, snapshot) = (self.ticks, chunk.target.pid, chunk.snapshot);
        // Twice a second: whether the target lives (a /proc read) and the
        // kernel's loss counters (a map read per CPU); at 20 ticks a second
        // these were ~5% of slotprof's own CPU.
        let now_and_then = ticks.is_multiple_of(10);
        let alive = !now_and_then || chunk.target.is_alive();
        if ticks.is_multiple_of(20) {
            if let Err(e) = self.sym.track_process(pid) {
                self.maps_errors.note(pid, &e);
            }
        }
        if ticks.is_multiple_of(200) {
            give_back_freed_memory();
        }
        if ticks.is_multiple_of(20) && self.sym.release_idle(SYMBOLS_IDLE) {
            snapshot.lock().unwrap().symbol_releases += 1;
        }
        // What the reader has read up to, taken before the queue is
        // drained: a slot ending after it may still have records in the
        // kernel's ring (the reader drains it every 10 ms).
        let synced = self.ring.synced_ns();
        let (pending, slot_log) = (&mut self.pending, &self.slot_log);
        stream::drain(
            &mut self.ring,
            &mut self.stacks.user,
            &mut RunSink { pending, slot_log },
        );
        self.stacks.user.expire(&mut |e| pending.push(slot_log, e));
        self.probes.set_stack_tops(&self.stacks.user.take_stack_tops());
        // A slot is cut once every record that began in it is here: one
        // still waiting for its thread's stack copy (a system call that
        // slept more than once exits late; at most 2 s) holds its slot back
        // instead of arriving after it and being dropped as late.
        let now = monotonic_ns().min(synced);
        let ready = self
            .stacks
            .user
            .oldest_held_start_ns()
            .map_or(now, |t| now.min(t + GRACE_NS));
        let done = finished_slots(
            &self.slot_source,
            &self.slot_log,
            self.origin,
            self.processed_until,
            ready,
        );
        if !done.is_empty() {
            self.process(chunk, &done)?;
            self.slot_log
                .lock()
                .unwrap()
                .forget_before(self.processed_until.saturating_sub(20_000_000_000), 64);
        }
        chunk.exporter.refresh(false);
        self.losses.busy(began.elapsed(), self.ring.queued_bytes());
        if now_and_then {
            {
                let mut s = snapshot.lock().unwrap();
                s.slot_source_healthy = self.source_healthy();
                s.export_paused = chunk.exporter.paused();
            }
            let now = update_lost(
                snapshot,
                &self.probes,
                &self.pending,
                self.ring.dropped(),
                lost_before,
                false,
            );
            if let Some(line) = now.and_then(|now| self.losses.check(&now, done.first().map(|s| s.number))) {
                eprintln!("{line}");
            }
        }
        Ok(alive)
    }

    /// Aggregates `done` (finished, consecutive) with what only the kernel
    /// knows (threads asleep now, the stack maps, short futex waits), then
    /// hands it to the kernel-free [`Chunk::analyze_and_export`].
    fn process(&mut self, chunk: &mut Chunk, done: &[Slot]) -> anyhow::Result<()> {
        // Events between `processed_until` and the first slot (before the
        // slot source gave one) fall outside every slot: aggregated, never
        // exported.
        let c = self.processed_until;
        let b = done.last().unwrap().end_ns;
        let pid = chunk.target.pid;
        let mut agg = Aggregator::new();
        self.pending.take_until(c, b, &mut agg);
        let in_flight = self.probes.in_flight_offcpu();
        let user = &mut self.stacks.user;
        self.pending.count_open(
            &in_flight,
            pid,
            c,
            b,
            chunk.config.spec.min_offcpu.as_nanos() as u64,
            &mut agg,
            &mut |tid, start| user.of_sleeper(pid, tid, start),
        );
        let table = self.stacks.table(&self.probes, agg.stack_ids()?);
        // Stacks of events still pending and of threads asleep now are
        // copied before their map is emptied.
        let still_needed = self
            .pending
            .events
            .iter()
            .flat_map(Event::stack_ids)
            .chain(in_flight.iter().flat_map(|(_, s)| s.stack_ids()));
        let emptied = self.stacks.rotate(&mut self.probes, still_needed)?;
        {
            let mut snap = chunk.snapshot.lock().unwrap();
            snap.stacks_emptied += emptied as u64;
            let t = &self.stacks.user.unwinder.totals;
            snap.user_stacks = std::collections::BTreeMap::from([
                ("complete", t.complete),
                ("truncated", t.truncated),
                ("stack_copy_ended", t.stack_copy_end),
                ("no_unwind_info", t.no_unwind_info),
                ("unwind_error", t.errors),
            ]);
            snap.unwind_table_bytes = self.stacks.user.unwinder.table_bytes() as u64;
        }
        let short_futex = self.probes.short_futex_waits();
        let window = Window {
            slots: done,
            from: c,
            agg: &agg,
            table: &table,
            short_futex: &short_futex,
            psi: self.psi.as_ref(),
        };
        chunk.analyze_and_export(
            &window,
            &mut self.pending.cache_windows,
            &mut self.sym,
            self.phase.as_mut(),
        )?;
        // Pressure readings before the last slot done are not asked again.
        if let (Some(psi), Some(last)) = (&self.psi, done.last()) {
            psi.log.lock().unwrap().forget_before(last.end_ns);
        }
        self.processed_until = b;
        Ok(())
    }

    /// What ended before now is written; the slot in progress is not (it
    /// would be a partial slot). Then the probes are detached and the
    /// export flushed.
    fn finish(mut self, chunk: &mut Chunk, lost_before: &mut HashMap<String, u64>) -> anyhow::Result<()> {
        let kernel_ring = self.ring.finish();
        let (pending, slot_log) = (&mut self.pending, &self.slot_log);
        stream::drain(
            &mut self.ring,
            &mut self.stacks.user,
            &mut RunSink { pending, slot_log },
        );
        self.stacks.user.flush(&mut |e| pending.push(slot_log, e));
        let now = monotonic_ns() + GRACE_NS;
        let done = finished_slots(
            &self.slot_source,
            &self.slot_log,
            self.origin,
            self.processed_until,
            now,
        );
        if !done.is_empty() {
            self.process(chunk, &done)?;
        }
        update_lost(
            chunk.snapshot,
            &self.probes,
            &self.pending,
            self.ring.dropped(),
            lost_before,
            true,
        );
        if let Some(mut t) = self.source_task.take() {
            t.abort();
        }
        if let Some(p) = self.phase.take() {
            p.probe.stop();
        }
        drop(self.ring);
        drop(kernel_ring);
        drop(self.probes);
        let meta = meta(chunk.target, &chunk.config);
        if let Some(p) = chunk.pusher.as_deref_mut() {
            p.finish(&meta)?;
        }
        chunk.exporter.finish(&meta)
    }
}

/// Marks the target attached in /metrics while alive; detached when
/// dropped (every way out of [`follow`]).
struct AttachedMark(Arc<Mutex<Snapshot>>);

impl Drop for AttachedMark {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.lock() {
            s.target_attached = false;
            s.slot_source_healthy = false;
        }
    }
}

fn meta(target: &Target, config: &Config) -> ProfileMeta {
    ProfileMeta {
        time_nanos: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as i64,
        duration_nanos: 0,
        period_type: Some(SampleType::new("cpu", "nanoseconds")),
        period: (1_000_000_000 / config.spec.frequency_hz.max(1)) as i64,
        comments: vec![format!(
            "{} (pid {}), always-on at {} Hz, slotprof {}",
            target.comm,
            target.pid,
            config.spec.frequency_hz,
            crate::VERSION
        )],
    }
}

/// Lost events so far: earlier attachments' plus this one's. Returns this
/// attachment's counts by cause (None when the kernel's counters cannot be
/// read: the totals keep their last known values). `last`: this
/// attachment ends; its counts (the last read) carry over to the next.
fn update_lost(
    snapshot: &Arc<Mutex<Snapshot>>,
    probes: &Probes,
    pending: &Pending,
    backlog_full: u64,
    before: &mut HashMap<String, u64>,
    last: bool,
) -> Option<[(&'static str, u64); 7]> {
    let now = probes.counters().ok().map(|c| {
        [
            ("ring_buffer_full", c.ring_full),
            ("backlog_full", backlog_full),
            ("stacks", c.stack_lost),
            ("offcpu_map_full", c.offcpu_start_lost),
            ("syscall_map_full", c.syscall_start_lost),
            ("malformed", pending.malformed),
            ("late", pending.late),
        ]
    });
    let mut s = snapshot.lock().unwrap();
    for (k, v) in now.into_iter().flatten() {
        s.lost
            .insert(k.to_string(), before.get(k).copied().unwrap_or(0) + v);
    }
    if last {
        // The totals shown so far become the next attachment's base (a
        // failed last read keeps the counts read before it).
        *before = s.lost.iter().map(|(k, v)| (k.clone(), *v)).collect();
    }
    now
}

/// Says when events are lost, by cause, at most once a minute, with the
/// longest stretch slotprof's own loop was busy and the most it had
/// queued since the last report: a loss is never silent, and the line
/// says whether slotprof (busy for seconds) or the event rate was why.
#[derive(Default)]
struct LossReport {
    said: HashMap<&'static str, u64>,
    last: Option<std::time::Instant>,
    busiest: Duration,
    most_queued: usize,
}

impl LossReport {
    fn busy(&mut self, took: Duration, queued: usize) {
        self.busiest = self.busiest.max(took);
        self.most_queued = self.most_queued.max(queued);
    }

    /// The line to print, when something was lost since the last one (a
    /// minute ago or more).
    fn check(&mut self, now: &[(&'static str, u64)], slot: Option<u64>) -> Option<String> {
        if self.last.is_some_and(|t| t.elapsed() < Duration::from_secs(60)) {
            return None;
        }
        let new: Vec<String> = now
            .iter()
            .filter(|&&(_, v)| v > 0)
            .filter_map(|&(k, v)| {
                let d = v - self.said.get(k).copied().unwrap_or(0).min(v);
                (d > 0).then(|| format!("{d} {k}"))
            })
            .collect();
        if new.is_empty() {
            return None;
        }
        let line = format!(
            "slotprof: warning: events lost{}: {}; slotprof's loop was busy up to {:.0} ms at a time and held up to {:.1} MiB \
             queued (the slotprof_lost_events_total metric counts them)",
            slot.map(|s| format!(" (near slot {s})")).unwrap_or_default(),
            new.join(", "),
            self.busiest.as_secs_f64() * 1e3,
            self.most_queued as f64 / (1 << 20) as f64
        );
        self.said = now.iter().copied().collect();
        self.last = Some(std::time::Instant::now());
        self.busiest = Duration::ZERO;
        self.most_queued = 0;
        Some(line)
    }
}

/// `run`'s side of the event stream: events wait in `pending` until their
/// slot ends; slot marks go to the slot log.
struct RunSink<'a> {
    pending: &'a mut Pending,
    slot_log: &'a SharedSlotLog,
}

impl stream::Sink for RunSink<'_> {
    fn event(&mut self, event: Event) {
        self.pending.push(self.slot_log, event);
    }

    fn malformed(&mut self) {
        self.pending.malformed += 1;
    }
}

/// What processing a run of finished slots needs.
struct Chunk<'a> {
    config: Config,
    target: &'a Target,
    topology: &'a crate::topology::Topology,
    exporter: &'a mut always_on::Exporter,
    /// Pushes each slot to a profiling backend (`[push]`).
    pusher: Option<&'a mut Pusher>,
    snapshot: &'a Arc<Mutex<Snapshot>>,
    /// Asks for each exported leader slot's block.
    blocks: Option<&'a crate::slot_sources::blocks::Fetcher>,
}

/// A batch of finished slots, aggregated, with what the kernel told of
/// them: all that [`Chunk::analyze_and_export`] reads.
struct Window<'a> {
    /// Consecutive, finished.
    slots: &'a [Slot],
    /// Where the batch's events begin (the end of the previous batch).
    from: u64,
    agg: &'a Aggregator,
    table: &'a crate::pipeline::aggregate::StackTable,
    short_futex: &'a [(u64, u64, u64)],
    /// The kernel's memory pressure readings.
    psi: Option<&'a crate::kernel::psi::PsiSampler>,
}

impl Chunk<'_> {
    /// Names the stacks of a batch of slots, runs the detectors on it
    /// (and the cache-line one on leader windows it completes), and exports
    /// each slot; no kernel access.
    fn analyze_and_export(
        &mut self,
        w: &Window,
        cache_windows: &mut crate::pipeline::LeaderWindows,
        sym: &mut Symbolizer,
        mut phase: Option<&mut Phase>,
    ) -> anyhow::Result<()> {
        let (slots, c, agg, table) = (w.slots, w.from, w.agg, w.table);
        let timeline = Timeline::new(slots.to_vec());
        let per_slot = agg.resolve_slots(&timeline, table, sym)?;
        let buckets = crate::slots::Buckets::new(Some(&timeline), c);
        let mut findings = crate::pipeline::detect(
            agg,
            self.target.pid,
            w.short_futex,
            &self.config.spec.detectors,
            &buckets,
            table,
            sym,
        )?;
        findings.extend(cache_windows.findings(
            slots,
            agg,
            self.target.pid,
            self.topology,
            self.config.spec.detectors.pingpong_threshold,
            sym,
        ));
        place_in_slots(&mut findings, &timeline, slots);
        let meta = meta(self.target, &self.config);
        let period_ns = 1_000_000_000 / self.config.spec.frequency_hz.max(1);
        self.snapshot.lock().unwrap().samples += agg.samples;
        for (slot, p) in slots.iter().zip(&per_slot) {
            let phase = phase
                .as_deref_mut()
                .and_then(|ph| ph.of(slot.start_ns + slot.duration_ns() / 2));
            let result = SlotResult {
                slot,
                profiles: p,
                findings: &findings,
                phase,
                memory_pressure: w.psi.and_then(|psi| psi.over(slot.start_ns, slot.end_ns)),
                meta: &meta,
                period_ns,
            };
            self.exporter.slot(&result)?;
            if let Some(p) = self.pusher.as_deref_mut() {
                p.slot(&result)?;
            }
            metrics::SlotMetrics(self.snapshot).slot(&result)?;
            match self.blocks.filter(|_| slot.leader) {
                Some(b) if slot.aligned => b.ended(slot.number),
                Some(b) => b.not_asked(),
                None => {}
            }
            self.snapshot.lock().unwrap().exported(self.exporter);
        }
        Ok(())
    }
}

#[cfg(test)]
mod loss_report_tests {
    use super::*;

    #[test]
    fn a_loss_is_said_once_with_what_is_new_then_not_again_within_a_minute() {
        let mut r = LossReport::default();
        assert_eq!(r.check(&[("ring_buffer_full", 0), ("late", 0)], Some(5)), None);
        r.busy(Duration::from_millis(1500), 3 << 20);
        r.busy(Duration::from_millis(20), 1 << 20);
        let line = r.check(&[("ring_buffer_full", 7), ("late", 0)], Some(9)).unwrap();
        assert!(line.contains("near slot 9"), "{line}");
        assert!(line.contains("7 ring_buffer_full"), "{line}");
        assert!(!line.contains("late"), "{line}");
        assert!(line.contains("1500 ms") && line.contains("3.0 MiB"), "{line}");
        // More lost within the minute: not said yet.
        assert_eq!(r.check(&[("ring_buffer_full", 9), ("late", 1)], None), None);
        // A minute later, only what is new since the last line.
        r.last = Some(std::time::Instant::now() - Duration::from_secs(61));
        let line = r.check(&[("ring_buffer_full", 9), ("late", 1)], None).unwrap();
        assert!(line.contains("2 ring_buffer_full, 1 late"), "{line}");
        r.last = Some(std::time::Instant::now() - Duration::from_secs(61));
        assert_eq!(r.check(&[("ring_buffer_full", 9), ("late", 1)], None), None);
    }
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

#[cfg(test)]
mod target_name_tests {
    use super::names_match;

    #[test]
    fn a_name_longer_than_comm_matches_on_its_first_fifteen_bytes() {
        // solana-test-validator runs with comm "solana-test-val".
        assert!(names_match("solana-test-validator", "solana-test-val", None));
        assert!(names_match("agave-validator", "agave-validator", None));
        assert!(names_match(
            "solana-test-validator",
            "x",
            Some("solana-test-validator")
        ));
        // A short comm is not a prefix match, nor is a different 15 bytes.
        assert!(!names_match("solana-test-validator", "solana", None));
        assert!(!names_match("solana-test-validator", "solana-test-vax", None));
        assert!(!names_match("agave", "agave-validator", None));
    }
}
