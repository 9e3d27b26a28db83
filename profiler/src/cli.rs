//! Command-line interface.

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};

/// slotprof: where a validator's leader time went, slot by slot.
#[derive(Debug, Parser)]
#[command(name = "slotprof", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Profile a running process: on-CPU and off-CPU flamegraphs, pprof, summary.
    Attach(AttachArgs),
    /// Start a command and profile it from its first instruction.
    Record(RecordArgs),
    /// Differential flamegraph of two slots, leader windows or sessions.
    Diff(DiffArgs),
    /// Which stall class costs the slots: bad-slot rates with and without
    /// each finding kind, phase and window position, with 95% intervals.
    Explain(ExplainArgs),
    /// Always on: profile a validator continuously, export each slot,
    /// serve Prometheus metrics (see profiler/packaging/slotprof.toml).
    Run(RunArgs),
    /// On a hypervisor host: what the host's memory management (compaction,
    /// migration) does to its VMs' memory, per second, with the fix.
    Host(HostArgs),
    /// Print shell completions (bash, zsh, fish, elvish, powershell) to
    /// stdout, e.g. `slotprof completions bash > /etc/bash_completion.d/slotprof`.
    Completions { shell: clap_complete::Shell },
    /// Write man pages (slotprof.1 and one per subcommand) into DIR, e.g.
    /// `slotprof man /usr/local/share/man/man1`.
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The configuration file (a documented sample:
    /// profiler/packaging/slotprof.toml; `slotprof run --print-config`).
    #[arg(short, long, default_value = "/etc/slotprof/slotprof.toml")]
    pub config: PathBuf,
    /// Profile this process (instead of target.pid / target.comm).
    #[arg(short, long, conflicts_with = "comm")]
    pub pid: Option<u32>,
    /// Profile the oldest process with this name, following restarts.
    #[arg(long)]
    pub comm: Option<String>,
    /// Export here instead of export.dir.
    #[arg(long, value_name = "DIR")]
    pub export_dir: Option<PathBuf>,
    /// Stop after this long (default: until SIGTERM or SIGINT).
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Print the sample configuration (every key, documented) and exit.
    #[arg(long)]
    pub print_config: bool,
}

#[derive(Debug, Args)]
pub struct ExplainArgs {
    /// One directory per node: a `slotprof run` export (hours/*/slots.jsonl)
    /// or an attach/record output with slots (slots/*/slot.json).
    #[arg(required = true, value_name = "DIR")]
    pub dirs: Vec<PathBuf>,
    /// A slot is bad when it lasted longer than this (e.g. 450ms).
    #[arg(long, value_parser = parse_duration, conflicts_with = "outcomes", value_name = "DURATION")]
    pub longer_than: Option<Duration>,
    /// A slot is bad by your own judgement: JSON lines `{"slot": N, "bad":
    /// true}` or `{"slot": N, "value": X}` with --threshold (e.g. a block's
    /// compute units, bad below 7000000).
    #[arg(long, value_name = "FILE")]
    pub outcomes: Option<PathBuf>,
    /// With --outcomes values: bad below this.
    #[arg(long, requires = "outcomes")]
    pub threshold: Option<f64>,
    /// A slot is bad when its block was skipped or small, by the outcomes
    /// `slotprof run` recorded from the node's RPC (hours/*/outcomes.jsonl,
    /// `export.block_outcomes`).
    #[arg(long, conflicts_with_all = ["outcomes", "longer_than"])]
    pub blocks: bool,
    /// With --blocks: a block under this many compute units is bad (the
    /// reference incident's small block).
    #[arg(long, requires = "blocks", default_value_t = 7_000_000, value_name = "UNITS")]
    pub cu_below: u64,
    /// With --blocks: judge by transactions instead: a block with fewer is
    /// bad.
    #[arg(long, requires = "blocks", value_name = "TRANSACTIONS")]
    pub tx_below: Option<u64>,
    /// Also write explain.json and explain.html (each node's timeline and
    /// the ratios as a forest plot) here.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct HostArgs {
    /// How long to watch (e.g. 90s, 10m; bursts repeat every ~80 s in the
    /// reference incident, so watch a few minutes). Default: until Ctrl-C.
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Directory for the outputs (created if missing).
    #[arg(short, long, default_value = "slotprof-host")]
    pub out: PathBuf,
    /// Watch only this VM process (repeatable). Default: every process
    /// holding a KVM VM, found again every 5 s.
    #[arg(long = "vm-pid", value_name = "PID")]
    pub vm_pids: Vec<u32>,
    /// Have the kernel time slotprof's own probes (summary.json).
    #[arg(long)]
    pub probe_stats: bool,
    /// Also write a recording of the classified events into DIR, for
    /// replay without root (`pipeline::replay::host`).
    #[arg(long, value_name = "DIR", hide = true)]
    pub save_replay: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// Before: a slot, window or session directory, or a .folded file.
    pub before: PathBuf,
    /// After: the same kinds.
    pub after: PathBuf,
    /// Compare off-CPU time instead of on-CPU samples.
    #[arg(long)]
    pub offcpu: bool,
    /// Scale `before` to `after`'s total (for profiles of different lengths).
    #[arg(long)]
    pub normalize: bool,
    /// Where to write the SVG.
    #[arg(short, long, default_value = "diff.svg")]
    pub out: PathBuf,
}

/// Options shared by every profiling command.
#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// cpu-clock samples per second, per CPU.
    #[arg(short = 'F', long = "freq", default_value_t = 99, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub freq: u64,
    /// Off-CPU intervals shorter than this are not recorded (e.g. 1ms, 500us).
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    pub min_offcpu: Duration,
    /// A thread back at the same system call exit, with the same
    /// registers, within this long of its last stack copy there reuses that
    /// copy's stack instead of copying it again (an idle worker returning
    /// to its wait hundreds of times a second). 0 copies every time.
    #[arg(long, default_value = crate::spec::DEFAULT_STACK_REPEAT, value_parser = parse_duration, value_name = "DURATION")]
    pub stack_repeat: Duration,
    /// Off-CPU intervals: `folded` sums in the kernel the short waits an
    /// idle thread repeats at the same place (exact time, one record per
    /// 100 ms; threads the detectors read keep every interval); `exact`
    /// sends every interval with its own stack (what folded is measured
    /// against; it costs more).
    #[arg(long, value_enum, default_value = "folded")]
    pub offcpu: crate::spec::OffCpuMode,
    /// Directory for the outputs (created if missing).
    #[arg(short, long, default_value = "slotprof-out")]
    pub out: PathBuf,
    /// Cut the profile into slots (adds slots/, windows/ and index.html):
    /// rpc=URL, uprobe=BINARY:FUNCTION[,...] or clock=LENGTH[,...].
    ///
    /// `rpc=http://127.0.0.1:8899`: the validator's RPC (slot starts from
    /// its websocket, getSlot polling as the fallback; the leader schedule
    /// for its identity).
    ///
    /// `uprobe=/usr/bin/agave-validator:PohRecorder::set_bank[,slot=arg0][,rpc=URL]`:
    /// a slot starts at each call of the function (the most precise
    /// boundaries); numbers and leader schedule from the RPC when given.
    ///
    /// `clock=400ms[,origin=NS][,leader=K/M]`: fixed-length slots, for any
    /// program (origin in CLOCK_MONOTONIC ns, default the session start;
    /// leader=K/M marks the first K of every M slots as this node's).
    #[arg(long, value_name = "SOURCE")]
    pub slot_source: Option<crate::slot_sources::SlotSourceSpec>,
    /// Leave out the detectors' probes (madvise, futex, TLB flushes, IPIs,
    /// page faults): on-CPU and off-CPU profiles only.
    #[arg(long)]
    pub no_detector_probes: bool,
    /// Have the kernel time slotprof's own probes and put their cost in
    /// summary.json (adds two clock reads per probe run).
    #[arg(long)]
    pub probe_stats: bool,
    /// Also write every raw event record to FILE (for `cargo bench -p
    /// profiler --bench aggregate -- FILE`, the aggregator's throughput).
    #[arg(long, value_name = "FILE", hide = true)]
    pub save_events: Option<PathBuf>,
    /// Also write a recording of what the detectors were given into DIR,
    /// for replay without root (`pipeline::replay`; `cargo xtask
    /// record-fixtures` makes the committed ones).
    #[arg(long, value_name = "DIR", hide = true)]
    pub save_replay: Option<PathBuf>,
    // Last: each sets its own help heading.
    #[command(flatten)]
    pub detectors: DetectorArgs,
    #[command(flatten)]
    pub phase: PhaseArgs,
    #[command(flatten)]
    pub push: PushArgs,
}

/// Pushing the slots' profiles to a profiling backend when the session
/// ends (needs --slot-source); `slotprof run` reads `[push]` in its
/// configuration instead.
#[derive(Debug, Args)]
pub struct PushArgs {
    /// Push to Grafana Pyroscope (or Alloy's pyroscope.receive_http):
    /// its base URL, e.g. http://127.0.0.1:4040 (POST /ingest, pprof).
    #[arg(long, value_name = "URL", help_heading = "Push")]
    pub push_pyroscope: Option<String>,
    /// Push OTLP profiles over HTTP, e.g. http://127.0.0.1:4318 (a URL
    /// without a path gets /v1development/profiles).
    #[arg(long, value_name = "URL", help_heading = "Push")]
    pub push_otlp: Option<String>,
    /// The application (service) name (default: the target's process name).
    #[arg(long, value_name = "NAME", help_heading = "Push")]
    pub push_application: Option<String>,
    /// A series label / resource attribute KEY=VALUE (repeatable).
    #[arg(long = "push-label", value_name = "KEY=VALUE", help_heading = "Push")]
    pub push_labels: Vec<String>,
    /// An HTTP header sent with every push, NAME=VALUE (repeatable; e.g.
    /// X-Scope-OrgID=TENANT for a multi-tenant Pyroscope).
    #[arg(long = "push-header", value_name = "NAME=VALUE", help_heading = "Push")]
    pub push_headers: Vec<String>,
    /// Each pushed profile spans this much slot time.
    #[arg(long, default_value = "10s", value_parser = parse_duration, value_name = "DURATION", help_heading = "Push")]
    pub push_every: Duration,
    /// Wait this long for a receiver when the session ends (and for each request).
    #[arg(long, default_value = "30s", value_parser = parse_duration, value_name = "DURATION", help_heading = "Push")]
    pub push_timeout: Duration,
}

impl PushArgs {
    pub fn config(&self) -> anyhow::Result<crate::spec::PushConfig> {
        use crate::spec::{parse_url, PushConfig};
        let pairs = |flag: &str, values: &[String], example: &str| {
            values
                .iter()
                .map(|l| {
                    l.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .ok_or_else(|| anyhow::anyhow!("{flag} {l:?}: give KEY=VALUE, e.g. {example}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()
        };
        let labels = pairs("--push-label", &self.push_labels, "cluster=mainnet")?;
        let headers = pairs("--push-header", &self.push_headers, "X-Scope-OrgID=validators")?;
        let c = PushConfig {
            pyroscope: self
                .push_pyroscope
                .as_deref()
                .map(|u| parse_url("--push-pyroscope", u))
                .transpose()?,
            otlp: self
                .push_otlp
                .as_deref()
                .map(|u| parse_url("--push-otlp", u))
                .transpose()?,
            application: self.push_application.clone(),
            every: self.push_every,
            timeout: self.push_timeout,
            labels,
            headers,
            ..Default::default()
        };
        c.check()
            .map_err(|e| anyhow::anyhow!("{}", e.to_string().replace("push.", "--push-")))?;
        Ok(c)
    }
}

#[derive(Debug, Args)]
pub struct AttachArgs {
    /// Process to profile (all its threads).
    #[arg(short, long)]
    pub pid: u32,
    /// How long to profile (e.g. 30s, 5m); Ctrl-C stops early and still writes.
    #[arg(short, long, default_value = "30s", value_parser = parse_duration)]
    pub duration: Duration,
    #[command(flatten)]
    pub profile: ProfileArgs,
}

#[derive(Debug, Args)]
pub struct RecordArgs {
    /// Stop after this long even if the command still runs (default: when it exits).
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    #[command(flatten)]
    pub profile: ProfileArgs,
    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::duration::parse(s)
}

/// Detector options.
#[derive(Debug, Args)]
#[command(next_help_heading = "Detectors")]
pub struct DetectorArgs {
    /// The main-loop thread, by name or tid (MainLoopGap). Default: the
    /// thread that calls --loop-symbol.
    #[arg(long, value_name = "NAME|TID")]
    pub loop_thread: Option<crate::detectors::LoopThread>,
    /// The function the main loop calls once per iteration, in the target's
    /// executable (matched by demangled name): a uprobe marks iterations, so
    /// on-CPU stalls between them are found too.
    #[arg(long, value_name = "FUNCTION")]
    pub loop_symbol: Option<String>,
    /// A main-loop iteration longer than this is a gap.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub gap_threshold: Duration,
    /// A thread whose every stall matters (repeatable): its madvise purges,
    /// lock waits, waits for a CPU and page waits; the loop thread always
    /// does. Default for purges: the process's main thread.
    #[arg(long, value_name = "NAME")]
    pub hot_thread: Vec<String>,
    /// madvise time per hot thread per slot that makes a SyncAllocatorPurge.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    pub purge_threshold: Duration,
    /// CPU topology override for the cache-line detector: one line per CCX
    /// (last-level cache domain), each a CPU list such as `0-7`; default:
    /// sysfs.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,
    /// Share of the involved threads' samples on one cache line that makes
    /// a CacheLinePingPong.
    #[arg(long, default_value_t = 0.05)]
    pub pingpong_threshold: f64,
    /// Futex wait per lock per slot that makes a LockContention. At 2 ms a
    /// healthy Agave node (4.4, idle) made one in most slots: real but
    /// harmless waits of 3-5 ms on rayon's sleep mutex, jemalloc's arena
    /// mutex and Bank RwLocks; 10 ms is 2.5% of a 400 ms slot.
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    pub lock_threshold: Duration,
    /// Time a hot thread spent runnable but without a CPU, per slot, that
    /// makes a CpuContention (waits of at least --min-offcpu are seen).
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub cpu_wait_threshold: Duration,
    /// Time a thread spent reclaiming or compacting memory, or a hot thread
    /// waiting for a page, per slot, that makes a MemoryPressure.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub memory_stall_threshold: Duration,
    /// Time a thread spent loading, verifying, JIT-compiling or evicting
    /// programs in the runtime's program cache, per slot, that makes a
    /// ProgramCache.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub program_cache_threshold: Duration,
    /// Probe the program cache's functions in the target's executable
    /// (uprobes, found by name per Agave release): auto when it has them,
    /// on (fail without them), off.
    #[arg(long, value_enum, default_value = "auto")]
    pub program_cache: crate::kernel::cache_functions::Mode,
}

impl ProfileArgs {
    /// What to measure, checked: the settings `run`'s configuration file
    /// lowers into the same type.
    pub fn spec(&self) -> anyhow::Result<crate::spec::ProfileSpec> {
        Ok(crate::spec::ProfileSpec {
            frequency_hz: self.freq,
            min_offcpu: self.min_offcpu,
            stack_repeat: self.stack_repeat,
            offcpu: self.offcpu,
            slot_source: self.slot_source.clone(),
            loop_symbol: self.detectors.loop_symbol.clone(),
            program_cache: self.detectors.program_cache,
            detectors: self.detectors.config(self.freq),
            phase_probe: self.phase.config()?,
        })
    }
}

impl DetectorArgs {
    /// The detectors' settings, for sampling at `freq_hz`.
    pub fn config(&self, freq_hz: u64) -> crate::detectors::DetectorConfig {
        crate::detectors::DetectorConfig {
            loop_thread: self.loop_thread.clone(),
            gap_threshold_ns: self.gap_threshold.as_nanos() as u64,
            hot_threads: self.hot_thread.clone(),
            purge_threshold_ns: self.purge_threshold.as_nanos() as u64,
            lock_threshold_ns: self.lock_threshold.as_nanos() as u64,
            cpu_wait_threshold_ns: self.cpu_wait_threshold.as_nanos() as u64,
            memory_stall_threshold_ns: self.memory_stall_threshold.as_nanos() as u64,
            program_cache_threshold_ns: self.program_cache_threshold.as_nanos() as u64,
            sample_period_ns: 1_000_000_000 / freq_hz.max(1),
            topology: self.topology.clone(),
            pingpong_threshold: self.pingpong_threshold,
        }
    }
}

/// The guest-side phase probe.
#[derive(Debug, Args)]
#[command(next_help_heading = "Phase probe (in a VM)")]
pub struct PhaseArgs {
    /// Run the calibrated probe: a sha256 chain for --phase-burst every
    /// --phase-every on each of --phase-cpus, to find a slow phase the host
    /// imposes (e.g. kcompactd migrating the VM's memory). Costs
    /// burst/every of each probed CPU (1% by default).
    #[arg(long)]
    pub phase_probe: bool,
    /// CPUs to probe (a list such as `0-3,8`); default every online CPU.
    #[arg(long, value_name = "LIST")]
    pub phase_cpus: Option<String>,
    /// How often each probe burst runs.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub phase_every: Duration,
    /// How long each probe burst hashes.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    pub phase_burst: Duration,
}

impl PhaseArgs {
    /// The probe's settings, if it is on.
    pub fn config(&self) -> anyhow::Result<Option<crate::phase::probe::PhaseProbeConfig>> {
        if !self.phase_probe {
            return Ok(None);
        }
        let cpus = match &self.phase_cpus {
            Some(list) => Some(crate::topology::parse_cpu_list(list).map_err(|e| {
                anyhow::anyhow!("--phase-cpus {list:?}: {e} (give a CPU list such as 0-3,8)")
            })?),
            None => None,
        };
        crate::phase::probe::PhaseProbeConfig::new(self.phase_every, self.phase_burst, cpus)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("--phase-every/--phase-burst/--phase-cpus: {e}"))
    }
}

/// Shell completions for `shell`, as `slotprof completions` prints them.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn std::io::Write) {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut cmd, "slotprof", out);
}

/// Writes `slotprof.1` and `slotprof-SUBCOMMAND.1` for every subcommand
/// into `dir` (created); the files written.
pub fn man_pages(dir: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let cmd = <Cli as clap::CommandFactory>::command();
    let mut written = Vec::new();
    let mut page = |name: String, cmd: clap::Command| -> anyhow::Result<()> {
        let mut text = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut text)?;
        let path = dir.join(format!("{name}.1"));
        crate::output::write_atomic(&path, &text)?;
        written.push(path);
        Ok(())
    };
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("slotprof-{}", sub.get_name());
        page(
            name.clone(),
            sub.clone().display_name(name.clone()).bin_name(name),
        )?;
    }
    page("slotprof".to_string(), cmd)?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_and_man_pages_cover_every_subcommand() {
        let mut bash = Vec::new();
        completions(clap_complete::Shell::Bash, &mut bash);
        let bash = String::from_utf8(bash).unwrap();
        for sub in ["attach", "record", "run", "explain", "diff", "host"] {
            assert!(bash.contains(sub), "bash completions lack {sub}");
        }
        assert!(bash.contains("--slot-source"));
        let dir = tempfile::tempdir().unwrap();
        let pages = man_pages(dir.path()).unwrap();
        let names: Vec<String> = pages
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for want in [
            "slotprof.1",
            "slotprof-record.1",
            "slotprof-run.1",
            "slotprof-explain.1",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
        }
        let record = std::fs::read_to_string(dir.path().join("slotprof-record.1")).unwrap();
        assert!(
            record.contains("slot\\-source"),
            "{}",
            &record[..record.len().min(600)]
        );
    }
}
