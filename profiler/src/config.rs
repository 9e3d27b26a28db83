//! The configuration file of `slotprof run` (always-on mode): TOML, every
//! key documented in profiler/packaging/slotprof.toml (the sample file is
//! parsed by the tests, so it stays valid). Unknown keys and bad values are
//! errors that name the key and say what is allowed.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{bail, Context};
use serde::Deserialize;

/// The sample configuration shipped with slotprof.
pub const SAMPLE: &str = include_str!("../packaging/slotprof.toml");

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct File {
    target: TargetSection,
    sampling: SamplingSection,
    slots: SlotsSection,
    export: ExportSection,
    metrics: MetricsSection,
    detectors: DetectorsSection,
    phase_probe: PhaseSection,
    push: PushSection,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct TargetSection {
    comm: Option<String>,
    pid: Option<u32>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct SamplingSection {
    frequency_hz: u64,
    min_offcpu: String,
    stack_repeat: String,
    offcpu: crate::spec::OffCpuMode,
}

impl Default for SamplingSection {
    fn default() -> Self {
        Self {
            frequency_hz: 49,
            min_offcpu: "1ms".into(),
            stack_repeat: crate::spec::DEFAULT_STACK_REPEAT.into(),
            offcpu: crate::spec::OffCpuMode::Folded,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct SlotsSection {
    source: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ExportSection {
    dir: PathBuf,
    full: String,
    hourly_profiles: bool,
    block_outcomes: bool,
    retention_bytes: String,
    retention_age: String,
    free_space_floor: String,
}

impl Default for ExportSection {
    fn default() -> Self {
        Self {
            dir: "/var/lib/slotprof".into(),
            full: "findings-and-leader".into(),
            hourly_profiles: true,
            block_outcomes: true,
            retention_bytes: "20GiB".into(),
            retention_age: "7d".into(),
            free_space_floor: "5GiB".into(),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct MetricsSection {
    listen: String,
    allow_remote: bool,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:10440".into(),
            allow_remote: false,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct PushSection {
    pyroscope: Option<String>,
    otlp: Option<String>,
    application: Option<String>,
    every: String,
    queue: String,
    timeout: String,
    labels: std::collections::BTreeMap<String, String>,
    headers: std::collections::BTreeMap<String, String>,
}

impl Default for PushSection {
    fn default() -> Self {
        Self {
            pyroscope: None,
            otlp: None,
            application: None,
            every: "10s".into(),
            queue: "64MiB".into(),
            timeout: "30s".into(),
            labels: Default::default(),
            headers: Default::default(),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DetectorsSection {
    loop_thread: Option<String>,
    loop_symbol: Option<String>,
    gap_threshold: String,
    hot_threads: Vec<String>,
    purge_threshold: String,
    lock_threshold: String,
    cpu_wait_threshold: String,
    memory_stall_threshold: String,
    program_cache_threshold: String,
    program_cache: crate::kernel::cache_functions::Mode,
    pingpong_threshold: f64,
}

impl Default for DetectorsSection {
    fn default() -> Self {
        Self {
            loop_thread: None,
            loop_symbol: None,
            gap_threshold: "5ms".into(),
            hot_threads: Vec::new(),
            purge_threshold: "1ms".into(),
            lock_threshold: "10ms".into(),
            cpu_wait_threshold: "5ms".into(),
            memory_stall_threshold: "5ms".into(),
            program_cache_threshold: "5ms".into(),
            program_cache: crate::kernel::cache_functions::Mode::Auto,
            pingpong_threshold: 0.05,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct PhaseSection {
    enabled: bool,
    every: String,
    burst: String,
    cpus: Cpus,
}

impl Default for PhaseSection {
    fn default() -> Self {
        Self {
            enabled: true,
            every: "500ms".into(),
            burst: "1ms".into(),
            cpus: Cpus::Word("all".into()),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum Cpus {
    Word(String),
    List(Vec<u32>),
}

/// Which process `run` profiles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetSpec {
    Comm(String),
    Pid(u32),
}

pub use crate::export::always_on::FullExport;

/// A checked configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub target: TargetSpec,
    /// What to measure, lowered here as the CLI lowers its flags
    /// (`cli::ProfileArgs`) into the one type the drivers read.
    pub spec: crate::spec::ProfileSpec,
    pub export_dir: PathBuf,
    pub full_export: FullExport,
    pub hourly_profiles: bool,
    /// Fetch each leader slot's block outcome from the RPC slot source.
    pub block_outcomes: bool,
    pub retention_bytes: u64,
    pub retention_age: Duration,
    pub free_space_floor: u64,
    pub metrics_listen: SocketAddr,
    /// Pushing slots to a profiling backend (off without an endpoint).
    pub push: crate::spec::PushConfig,
}

impl Config {
    /// What the exporter is told: `[export]`'s settings.
    pub fn export_policy(&self) -> crate::export::always_on::ExportPolicy {
        crate::export::always_on::ExportPolicy {
            dir: self.export_dir.clone(),
            full: self.full_export,
            hourly: self.hourly_profiles,
            retention_bytes: self.retention_bytes,
            retention_age: self.retention_age,
            free_space_floor: self.free_space_floor,
        }
    }

    /// Reads and checks a configuration file.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        // A configuration is a few KiB: 1 MiB is a file that is not one.
        let text = crate::output::read_text_bounded(path, 1 << 20).with_context(|| {
            format!(
                "cannot read the configuration {} (write a documented sample with `slotprof run --print-config > {}` and edit it)",
                path.display(),
                path.display()
            )
        })?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    /// Parses and checks configuration text.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let f: File = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end()))?;
        let dur = |key: &str, v: &str| -> anyhow::Result<Duration> {
            crate::duration::parse(v).map_err(|e| anyhow::anyhow!("{key}: {e}"))
        };
        let target = match (f.target.comm, f.target.pid) {
            (Some(c), None) if !c.is_empty() => TargetSpec::Comm(c),
            (None, Some(p)) => TargetSpec::Pid(p),
            (Some(_), Some(_)) => bail!("target: give `comm` or `pid`, not both"),
            _ => bail!("target: give `comm = \"agave-validator\"` or `pid = N` (required)"),
        };
        if !(1..=10_000).contains(&f.sampling.frequency_hz) {
            bail!(
                "sampling.frequency_hz: {} is out of range: use 1 to 10000 (49 is the always-on default)",
                f.sampling.frequency_hz
            );
        }
        let slot_source = f
            .slots
            .source
            .as_deref()
            .map(|s| {
                s.parse()
                    .map_err(|e: String| anyhow::anyhow!("slots.source: {e}"))
            })
            .transpose()?;
        let full_export = match f.export.full.as_str() {
            "all" => FullExport::All,
            "findings-and-leader" => FullExport::FindingsAndLeader,
            "findings" => FullExport::Findings,
            other => bail!(
                "export.full: {other:?} is not allowed: use \"findings-and-leader\", \"all\" or \"findings\""
            ),
        };
        let metrics_listen: SocketAddr = f.metrics.listen.parse().map_err(|_| {
            anyhow::anyhow!(
                "metrics.listen: {:?} is not an address: use IP:PORT, e.g. \"127.0.0.1:10440\"",
                f.metrics.listen
            )
        })?;
        if !metrics_listen.ip().is_loopback() && !f.metrics.allow_remote {
            bail!(
                "metrics.listen: {metrics_listen} is not loopback; set metrics.allow_remote = true to \
                 serve profiles and metrics beyond this host"
            );
        }
        if !(0.0..=1.0).contains(&f.detectors.pingpong_threshold) {
            bail!("detectors.pingpong_threshold: use a share between 0 and 1");
        }
        let phase_probe = if f.phase_probe.enabled {
            let every = dur("phase_probe.every", &f.phase_probe.every)?;
            let burst = dur("phase_probe.burst", &f.phase_probe.burst)?;
            let cpus = match f.phase_probe.cpus {
                Cpus::Word(w) if w == "all" => None,
                Cpus::Word(w) => {
                    bail!("phase_probe.cpus: {w:?} is not allowed: use \"all\" or a list such as [0, 2]")
                }
                Cpus::List(l) => Some(l),
            };
            Some(
                crate::phase::probe::PhaseProbeConfig::new(every, burst, cpus)
                    .map_err(|e| anyhow::anyhow!("[phase_probe]: {e}"))?,
            )
        } else {
            None
        };
        let detectors = crate::detectors::DetectorConfig {
            loop_thread: f
                .detectors
                .loop_thread
                .as_deref()
                .map(|t| {
                    t.parse()
                        .map_err(|e: String| anyhow::anyhow!("detectors.loop_thread: {e}"))
                })
                .transpose()?,
            gap_threshold_ns: dur("detectors.gap_threshold", &f.detectors.gap_threshold)?.as_nanos() as u64,
            hot_threads: f.detectors.hot_threads,
            purge_threshold_ns: dur("detectors.purge_threshold", &f.detectors.purge_threshold)?.as_nanos()
                as u64,
            lock_threshold_ns: dur("detectors.lock_threshold", &f.detectors.lock_threshold)?.as_nanos()
                as u64,
            cpu_wait_threshold_ns: dur("detectors.cpu_wait_threshold", &f.detectors.cpu_wait_threshold)?
                .as_nanos() as u64,
            memory_stall_threshold_ns: dur(
                "detectors.memory_stall_threshold",
                &f.detectors.memory_stall_threshold,
            )?
            .as_nanos() as u64,
            program_cache_threshold_ns: dur(
                "detectors.program_cache_threshold",
                &f.detectors.program_cache_threshold,
            )?
            .as_nanos() as u64,
            sample_period_ns: 1_000_000_000 / f.sampling.frequency_hz.max(1),
            topology: None,
            pingpong_threshold: f.detectors.pingpong_threshold,
        };
        Ok(Self {
            target,
            spec: crate::spec::ProfileSpec {
                frequency_hz: f.sampling.frequency_hz,
                min_offcpu: dur("sampling.min_offcpu", &f.sampling.min_offcpu)?,
                stack_repeat: dur("sampling.stack_repeat", &f.sampling.stack_repeat)?,
                offcpu: f.sampling.offcpu,
                slot_source,
                loop_symbol: f.detectors.loop_symbol.clone(),
                program_cache: f.detectors.program_cache,
                detectors,
                phase_probe,
            },
            export_dir: f.export.dir,
            full_export,
            hourly_profiles: f.export.hourly_profiles,
            block_outcomes: f.export.block_outcomes,
            retention_bytes: bytes("export.retention_bytes", &f.export.retention_bytes)?,
            retention_age: dur("export.retention_age", &f.export.retention_age)?,
            free_space_floor: bytes("export.free_space_floor", &f.export.free_space_floor)?,
            metrics_listen,
            push: {
                use crate::spec::{parse_url, PushConfig};
                let p = PushConfig {
                    pyroscope: f
                        .push
                        .pyroscope
                        .as_deref()
                        .map(|u| parse_url("push.pyroscope", u))
                        .transpose()?,
                    otlp: f
                        .push
                        .otlp
                        .as_deref()
                        .map(|u| parse_url("push.otlp", u))
                        .transpose()?,
                    application: f.push.application,
                    every: dur("push.every", &f.push.every)?,
                    queue_bytes: bytes("push.queue", &f.push.queue)?,
                    timeout: dur("push.timeout", &f.push.timeout)?,
                    labels: f.push.labels.into_iter().collect(),
                    headers: f.push.headers.into_iter().collect(),
                };
                p.check()?;
                p
            },
        })
    }
}

/// Sizes as people type them: `20GiB`, `500MiB`, `1.5TB`, a bare number of bytes.
pub fn bytes(key: &str, text: &str) -> anyhow::Result<u64> {
    let (num, unit) = crate::duration::number_and_unit(text);
    let value: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("{key}: {text:?} is not a size: use e.g. 20GiB, 500MiB"))?;
    let scale: f64 = match unit {
        "" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        other => {
            bail!("{key}: unknown unit {other:?} in {text:?}: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
        }
    };
    Ok((value * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_or_a_huge_file_is_not_read_as_a_configuration() {
        let e = format!(
            "{:#}",
            Config::load(std::path::Path::new("/dev/zero")).unwrap_err()
        );
        assert!(e.contains("not a regular file"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.toml");
        std::fs::write(&big, vec![b'#'; (1 << 20) + 1]).unwrap();
        let e = format!("{:#}", Config::load(&big).unwrap_err());
        assert!(e.contains("larger than"), "{e}");
    }

    #[test]
    fn the_shipped_sample_parses_to_the_defaults() {
        let c = Config::parse(SAMPLE).unwrap();
        assert_eq!(c.target, TargetSpec::Comm("agave-validator".into()));
        assert_eq!(c.spec.frequency_hz, 49);
        assert_eq!(c.full_export, FullExport::FindingsAndLeader);
        assert_eq!(c.retention_bytes, 20 << 30);
        assert_eq!(c.retention_age, Duration::from_secs(7 * 86400));
        assert_eq!(c.free_space_floor, 5 << 30);
        assert_eq!(c.metrics_listen, "127.0.0.1:10440".parse().unwrap());
        // Push is off by default; its other settings are the defaults.
        assert_eq!(c.push, crate::spec::PushConfig::default());
        assert!(matches!(
            c.spec.slot_source,
            Some(crate::slot_sources::SlotSourceSpec::Rpc(_))
        ));
        let p = c.spec.phase_probe.unwrap();
        assert_eq!(
            (p.every, p.burst, p.cpus),
            (Duration::from_millis(500), Duration::from_millis(1), None)
        );
        // Only the target is required.
        let minimal = Config::parse("[target]\npid = 7\n").unwrap();
        assert_eq!(minimal.target, TargetSpec::Pid(7));
        assert_eq!(minimal.spec.frequency_hz, 49);
    }

    fn err(text: &str) -> String {
        format!("{:#}", Config::parse(text).unwrap_err())
    }

    #[test]
    fn bad_input_names_the_key_and_what_is_allowed() {
        let t = "[target]\ncomm = \"x\"\n";
        assert!(
            err("[target]\ncom = \"x\"\n").contains("unknown field `com`"),
            "{}",
            err("[target]\ncom = \"x\"\n")
        );
        assert!(err("").contains("target: give"));
        assert!(err("[target]\ncomm = \"a\"\npid = 3\n").contains("not both"));
        let e = err(&format!("{t}[export]\nfull = \"some\"\n"));
        assert!(
            e.contains("export.full") && e.contains("findings-and-leader"),
            "{e}"
        );
        let e = err(&format!("{t}[export]\nretention_bytes = \"20 potatoes\"\n"));
        assert!(e.contains("export.retention_bytes") && e.contains("GiB"), "{e}");
        let e = err(&format!("{t}[metrics]\nlisten = \"0.0.0.0:10440\"\n"));
        assert!(e.contains("allow_remote"), "{e}");
        assert!(Config::parse(&format!(
            "{t}[metrics]\nlisten = \"0.0.0.0:10440\"\nallow_remote = true\n"
        ))
        .is_ok());
        let e = err(&format!("{t}[sampling]\nmin_offcpu = \"1 fortnight\"\n"));
        assert!(e.contains("sampling.min_offcpu"), "{e}");
        let e = err(&format!("{t}[phase_probe]\ncpus = \"some\"\n"));
        assert!(e.contains("phase_probe.cpus"), "{e}");
        let e = err(&format!("{t}[sampling]\nfrequency_hz = \"fast\"\n"));
        assert!(e.contains("frequency_hz"), "{e}");
        let e = err(&format!("{t}[slots]\nsource = \"sundial\"\n"));
        assert!(e.contains("slots.source"), "{e}");
        let e = err(&format!("{t}[push]\notlp = \"https://collector:4318\"\n"));
        assert!(e.contains("push.otlp") && e.contains("Collector"), "{e}");
        let e = err(&format!("{t}[push]\nqueue = \"1KiB\"\n"));
        assert!(e.contains("push.queue"), "{e}");
        let e = err(&format!("{t}[push.labels]\n\"bad key\" = \"x\"\n"));
        assert!(e.contains("push.labels"), "{e}");
        let c = Config::parse(&format!(
            "{t}[push]\npyroscope = \"http://127.0.0.1:4040\"\nevery = \"5s\"\n[push.labels]\ncluster = \"mainnet\"\n"
        ))
        .unwrap();
        assert!(c.push.is_on() && c.push.otlp.is_none());
        assert_eq!(c.push.every, Duration::from_secs(5));
        assert_eq!(
            c.push.labels,
            vec![("cluster".to_string(), "mainnet".to_string())]
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(bytes("k", "20GiB").unwrap(), 20 << 30);
        assert_eq!(bytes("k", "1.5 MB").unwrap(), 1_500_000);
        assert_eq!(bytes("k", "4096").unwrap(), 4096);
        assert!(bytes("k", "lots").is_err());
    }
}
