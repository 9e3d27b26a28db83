//! The files a session leaves behind, and `summary.json`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use flamegraphs::{
    pprof::{self, ProfileMeta, SampleType},
    svg::{self, SvgOptions},
};
use serde::Serialize;

use crate::{
    aggregate::{LongInterval, Profiles, ThreadTotals},
    output::write_atomic,
    probes::{Counters, ProbeStatus, ProgramCost},
};

/// Everything `summary.json` records about a session.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub slotprof_version: &'static str,
    /// `uname -r`.
    pub kernel: String,
    pub command: &'static str,
    pub target: TargetSummary,
    /// Seconds from probes attached to probes detached.
    pub duration_s: f64,
    /// "duration", "interrupted" (SIGINT/SIGTERM) or "target exited".
    pub ended_by: &'static str,
    pub freq_hz: u64,
    pub min_offcpu_ms: f64,
    pub probes: Vec<ProbeStatus>,
    /// The probes' own cost, when `--probe-stats` was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_cost: Option<ProbeCost>,
    pub counts: Counts,
    pub lost: Lost,
    pub frame_pointers: FramePointers,
    /// Threads of the target, busiest first.
    pub threads: Vec<ThreadTotals>,
    pub longest_offcpu: Vec<LongInterval>,
    pub outputs: Vec<String>,
    /// Things the operator should know, in plain words.
    pub warnings: Vec<String>,
}

/// The kernel's accounting of the probes' run time.
#[derive(Debug, Serialize)]
pub struct ProbeCost {
    pub programs: Vec<ProgramCost>,
    /// All programs' run time as a share of the machine's CPU time over the
    /// session, in percent.
    pub cpu_percent: f64,
}

impl ProbeCost {
    pub fn new(programs: Vec<ProgramCost>, elapsed: std::time::Duration) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let total: u64 = programs.iter().map(|p| p.total_ns).sum();
        let cpu_percent = 100.0 * total as f64 / (elapsed.as_nanos() as f64 * cpus).max(1.0);
        Self {
            programs,
            cpu_percent: (cpu_percent * 10_000.0).round() / 10_000.0,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct TargetSummary {
    pub pid: u32,
    pub comm: String,
    pub exe: Option<PathBuf>,
    /// The target exited before the session ended.
    pub exited: bool,
    /// Seconds into the session when it was seen gone.
    pub exited_after_s: Option<f64>,
}

#[derive(Debug, Default, Serialize)]
pub struct Counts {
    pub oncpu_samples: u64,
    pub offcpu_intervals: u64,
    pub offcpu_ns: u64,
    pub oncpu_stacks: usize,
    pub offcpu_stacks: usize,
    /// Samples the kernel counted for the target (userspace received
    /// `oncpu_samples` of them; the difference is in `lost`).
    pub kernel_samples: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct Lost {
    pub ring_buffer_full: u64,
    pub stacks: u64,
    pub offcpu_map_full: u64,
    pub syscall_map_full: u64,
    pub malformed_records: u64,
    pub total: u64,
}

impl Lost {
    pub fn new(c: &Counters, malformed: u64) -> Self {
        Self {
            ring_buffer_full: c.ring_full,
            stacks: c.stack_lost,
            offcpu_map_full: c.offcpu_start_lost,
            syscall_map_full: c.syscall_start_lost,
            malformed_records: malformed,
            total: c.lost() + malformed,
        }
    }
}

#[derive(Debug, Default, Serialize)]
pub struct FramePointers {
    pub binary: Option<PathBuf>,
    /// Functions whose prologue was checked, and the share that sets up a
    /// frame pointer; absent when the binary could not be read.
    pub functions_scanned: Option<usize>,
    pub share_with_frame_pointer: Option<f64>,
    /// Median user-stack depth seen in on-CPU samples.
    pub median_user_depth: Option<usize>,
    /// Our verdict: false means user stacks are probably cut short.
    pub present: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advice: Option<String>,
}

impl FramePointers {
    /// Combines the prologue scan with what the stacks looked like.
    pub fn judge(
        binary: Option<PathBuf>,
        scan: Option<symbolizer::frame_pointers::FramePointerScan>,
        median_user_depth: Option<usize>,
    ) -> Self {
        let present = match (scan, median_user_depth) {
            (Some(s), _) => s.has_frame_pointers(),
            (None, Some(d)) => d > 2,
            (None, None) => true,
        };
        let advice = (!present).then(|| {
            "the target looks built without frame pointers, so user stacks will be shallow: \
             rebuild it with RUSTFLAGS=\"-C force-frame-pointers=yes\" (Rust) or \
             -fno-omit-frame-pointer (C/C++)"
                .to_string()
        });
        Self {
            binary,
            functions_scanned: scan.map(|s| s.functions),
            share_with_frame_pointer: scan.map(|s| (s.share() * 1000.0).round() / 1000.0),
            median_user_depth,
            present,
            advice,
        }
    }
}

/// Writes the flamegraphs, the folded stacks and the pprof profile into
/// `dir`, and returns the paths written.
pub fn write_profiles(
    dir: &Path,
    p: &Profiles,
    meta: &ProfileMeta,
    subtitle: &str,
) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create output directory {}", dir.display()))?;
    let mut written = Vec::new();
    let mut put = |name: &str, bytes: &[u8]| -> anyhow::Result<()> {
        let path = dir.join(name);
        write_atomic(&path, bytes)?;
        written.push(path);
        Ok(())
    };
    put("oncpu.folded", p.oncpu.to_text().as_bytes())?;
    let on = SvgOptions {
        title: "On-CPU".into(),
        subtitle: Some(subtitle.to_string()),
        count_name: "samples".into(),
        palette: "rust".into(),
    };
    put("oncpu.svg", &svg::render(&p.oncpu, &on)?)?;
    put("offcpu.folded", p.offcpu.to_text().as_bytes())?;
    let off = SvgOptions {
        title: "Off-CPU".into(),
        subtitle: Some(subtitle.to_string()),
        count_name: "ns".into(),
        palette: "io".into(),
    };
    put("offcpu.svg", &svg::render(&p.offcpu, &off)?)?;
    let profile = pprof::build(
        &[
            (SampleType::new("samples", "count"), &p.oncpu),
            (SampleType::new("offcpu", "nanoseconds"), &p.offcpu),
        ],
        meta,
    );
    put("profile.pb.gz", &pprof::encode_gzip(&profile)?)?;
    Ok(written)
}

/// `uname -r`.
pub fn kernel_release() -> String {
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    let bytes: Vec<u8> = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
