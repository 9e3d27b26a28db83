//! What to measure: the settings every profiling mode shares, the one type
//! that `attach`/`record`'s flags (`cli::ProfileArgs`) and `run`'s
//! configuration file (`config::Config`) both lower into, each checking
//! its own input and saying which flag or key was wrong; and likewise
//! where the slots are pushed ([`PushConfig`], `export::push`). The drivers read
//! only this; what is a mode's own (an output directory, an export
//! policy, a duration) stays beside it in that mode's options.

use std::time::Duration;

use anyhow::bail;

use crate::{detectors::DetectorConfig, phase::probe::PhaseProbeConfig, slot_sources::SlotSourceSpec};

/// The default of `--stack-repeat` and `sampling.stack_repeat`.
pub const DEFAULT_STACK_REPEAT: &str = "250ms";

/// How off-CPU intervals reach userspace (`--offcpu`, `sampling.offcpu`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum OffCpuMode {
    /// Short waits an idle thread repeats at the same place (the same
    /// wait call, from the stack of its last copy) are folded in the
    /// kernel, their time summed exactly; threads a detector reads
    /// (`--hot-thread`, the loop thread, the main thread) keep every
    /// interval.
    #[default]
    Folded,
    /// Every interval over `--min-offcpu`, one record and one stack each.
    Exact,
}

impl OffCpuMode {
    /// The kernel's folding bound: intervals shorter than this may fold.
    pub fn fold_under(self) -> Duration {
        match self {
            OffCpuMode::Folded => Duration::from_nanos(profiler_ebpf::DEFAULT_FOLD_UNDER_NS),
            OffCpuMode::Exact => Duration::ZERO,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ProfileSpec {
    /// On-CPU samples per second, per CPU.
    pub frequency_hz: u64,
    /// Off-CPU intervals shorter than this are counted, not kept.
    pub min_offcpu: Duration,
    /// See [`crate::kernel::probes::ProbeConfig::stack_repeat`].
    pub stack_repeat: Duration,
    /// Folded (the default) or exact.
    pub offcpu: OffCpuMode,
    /// Where slot boundaries come from; `None`: one profile for the session.
    pub slot_source: Option<SlotSourceSpec>,
    /// The main loop's per-iteration function (`--loop-symbol`,
    /// `detectors.loop_symbol`), in the target's executable.
    pub loop_symbol: Option<String>,
    /// Whether to probe the program cache (`--program-cache`,
    /// `detectors.program_cache`).
    pub program_cache: crate::kernel::cache_functions::Mode,
    pub detectors: DetectorConfig,
    /// The guest-side phase probe, when on.
    pub phase_probe: Option<PhaseProbeConfig>,
}

/// Where and how to push; `None` endpoints are off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushConfig {
    /// Pyroscope's base URL (`/ingest` is appended).
    pub pyroscope: Option<hyper::Uri>,
    /// The OTLP/HTTP profiles endpoint (a URL with no path gets
    /// `/v1development/profiles`).
    pub otlp: Option<hyper::Uri>,
    /// Pyroscope's application (service) name and OTLP's `service.name`;
    /// `None`: the target's process name.
    pub application: Option<String>,
    /// A batch spans this much slot time.
    pub every: Duration,
    /// Each endpoint's queue holds at most this many bytes.
    pub queue_bytes: u64,
    /// One request may take this long.
    pub timeout: Duration,
    /// More series labels (Pyroscope) and resource attributes (OTLP).
    pub labels: Vec<(String, String)>,
    /// Headers sent with every request (a tenant: `X-Scope-OrgID`).
    pub headers: Vec<(String, String)>,
}

impl Default for PushConfig {
    fn default() -> Self {
        Self {
            pyroscope: None,
            otlp: None,
            application: None,
            every: Duration::from_secs(10),
            queue_bytes: 64 << 20,
            timeout: Duration::from_secs(30),
            labels: Vec::new(),
            headers: Vec::new(),
        }
    }
}

impl PushConfig {
    pub fn is_on(&self) -> bool {
        self.pyroscope.is_some() || self.otlp.is_some()
    }

    /// Checks the values people type (`key` names them in messages).
    pub fn check(&self) -> anyhow::Result<()> {
        if self.every < Duration::from_secs(1) || self.every > Duration::from_secs(3600) {
            bail!("push.every: use 1s to 1h (10s is the default)");
        }
        if self.queue_bytes < 4 << 10 {
            bail!("push.queue: use at least 4KiB (64MiB is the default)");
        }
        if self.timeout < Duration::from_millis(100) {
            bail!("push.timeout: use at least 100ms (30s is the default)");
        }
        if let Some(a) = &self.application {
            if !valid_value(a) {
                bail!("push.application: {a:?} may not be empty nor hold {{ }} , = \" or control characters");
            }
        }
        for (k, v) in &self.labels {
            if !valid_name(k) {
                bail!(
                    "push.labels: {k:?} is not a label name: use letters, digits and _ (not first a digit)"
                );
            }
            if !valid_value(v) {
                bail!("push.labels.{k}: {v:?} may not be empty nor hold {{ }} , = \" or control characters");
            }
        }
        for (k, v) in &self.headers {
            if hyper::header::HeaderName::from_bytes(k.as_bytes()).is_err()
                || hyper::header::HeaderValue::from_str(v).is_err()
            {
                bail!(
                    "push.headers: {k:?} = {v:?} is not an HTTP header (a token name, a visible ASCII value)"
                );
            }
            if ["content-type", "content-encoding", "content-length", "host"]
                .contains(&k.to_ascii_lowercase().as_str())
            {
                bail!("push.headers: {k} is slotprof's to set");
            }
        }
        Ok(())
    }
}

fn valid_name(k: &str) -> bool {
    let mut c = k.chars();
    c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(crate) fn valid_value(v: &str) -> bool {
    !v.is_empty() && v.len() <= 256 && !v.chars().any(|c| "{},=\"".contains(c) || c.is_control())
}

/// Parses an endpoint URL: `http://host:port[/path]`.
pub fn parse_url(key: &str, url: &str) -> anyhow::Result<hyper::Uri> {
    if url.starts_with("https://") {
        bail!(
            "{key}: {url}: https is not supported: push to a local Grafana Alloy or OpenTelemetry \
             Collector over http://127.0.0.1, which forwards with TLS"
        );
    }
    let uri: hyper::Uri = url
        .parse()
        .map_err(|_| anyhow::anyhow!("{key}: {url:?} is not a URL: use http://HOST:PORT"))?;
    if uri.scheme_str() != Some("http") || uri.host().is_none() {
        bail!("{key}: {url:?}: use http://HOST:PORT");
    }
    if uri.query().is_some() {
        bail!("{key}: {url:?}: give no query string");
    }
    Ok(uri)
}
