//! The `slotprof` binary: parse the command line, run, report.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use profiler::{
    cli::{Cli, Command},
    drivers::session::{self, SessionOptions},
    kernel::privileges,
    kernel::target::{exec_when_released, find_program, spawn_held, Target, HELD_FD_ENV},
};

fn main() -> ExitCode {
    // Large buffers (ring batches, a slot's SVG, folded text and pprof:
    // hundreds of KiB to MiB, made and dropped every slot) straight from
    // and back to the kernel: glibc's default raises the mmap threshold to
    // the largest size freed, after which such buffers come from the heap
    // and leave it fragmented (the always-on daemon's RSS crept up by tens
    // of MiB on the real node). A fixed threshold also fixes the trim one.
    profiler::sys::set_mmap_threshold(256 << 10);
    if let Some(fd) = std::env::var_os(HELD_FD_ENV) {
        return exec_when_released(fd.to_str().and_then(|s| s.parse().ok()));
    }
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("slotprof: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("slotprof: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the command; the exit code is its (for `record`, the profiled
/// command's, as `perf record` and `time` return it).
async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Attach(a) => {
            let target = Target::from_pid(a.pid)?;
            privileges::require_bpf()?;
            privileges::raise_limits();
            profiler::output::prepare_out_dir(&a.profile.out)?;
            let opts = session_options(a.profile, "attach", Some(a.duration), None)?;
            eprintln!(
                "slotprof: profiling {} (pid {}) for {:.0} s; Ctrl-C stops early",
                target.comm,
                target.pid,
                a.duration.as_secs_f64()
            );
            finish(session::run(&opts, target, None).await?)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions { shell } => {
            profiler::cli::completions(shell, &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Man { dir } => {
            for page in profiler::cli::man_pages(&dir)
                .with_context(|| format!("cannot write the man pages into {}", dir.display()))?
            {
                println!("{}", page.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Host(h) => {
            privileges::require_bpf()?;
            privileges::raise_limits();
            let outcome = profiler::drivers::host::run(&profiler::drivers::host::HostOptions {
                duration: h.duration,
                out: h.out,
                vm_pids: h.vm_pids,
                probe_stats: h.probe_stats,
                save_replay: h.save_replay,
            })
            .await?;
            let s = &outcome.summary;
            println!(
                "slotprof host: {:.1} s, {} KVM invalidations ({} pages, {} of them guest RAM, \
                 {} the VMs' own memory) in {} VM process(es), \
                 {} compaction runs, {} pages migrated, {} lost; ended by {}",
                s.duration_s,
                s.totals.invalidations,
                s.totals.invalidated_pages,
                s.totals.attributed_pages,
                s.totals.vmm_own_pages,
                s.vms.len(),
                s.totals.compaction_runs,
                s.totals.migrated,
                s.lost.total,
                s.ended_by
            );
            for path in &s.outputs {
                println!("  {path}");
            }
            for f in &outcome.findings {
                println!("slotprof: KvmMmuInvalidation: {}", f.finding.explanation);
                println!("  what to do: {}", f.finding.advice);
            }
            for w in &s.warnings {
                eprintln!("slotprof: warning: {w}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Run(r) => {
            if r.print_config {
                print!("{}", profiler::config::SAMPLE);
                return Ok(ExitCode::SUCCESS);
            }
            privileges::require_bpf()?;
            privileges::raise_limits();
            profiler::drivers::run::run(profiler::drivers::run::RunOptions {
                config: r.config,
                pid: r.pid,
                comm: r.comm,
                export_dir: r.export_dir,
                duration: r.duration,
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Diff(d) => {
            println!(
                "{}",
                profiler::drivers::diff::run(&d.before, &d.after, d.offcpu, d.normalize, &d.out)?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Explain(e) => {
            let outcomes = match (&e.outcomes, e.longer_than, e.blocks) {
                (Some(f), _, _) => profiler::drivers::explain::Outcomes::read(f, e.threshold)?,
                (None, Some(d), _) => profiler::drivers::explain::Outcomes::LongerThan(d.as_secs_f64() * 1e3),
                (None, None, true) => profiler::drivers::explain::Outcomes::Blocks {
                    cu_below: e.tx_below.is_none().then_some(e.cu_below),
                    tx_below: e.tx_below,
                },
                (None, None, false) => anyhow::bail!(
                    "say what makes a slot bad: --blocks (the node's own blocks, recorded by `slotprof \
                     run` from its RPC: skipped, or under --cu-below 7000000 compute units), \
                     --longer-than 450ms, or --outcomes FILE with your own per-slot judgement"
                ),
            };
            print!(
                "{}",
                profiler::drivers::explain::run(&e.dirs, &outcomes, e.out.as_deref())?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Record(r) => {
            let exe = find_program(&r.command[0])?;
            privileges::require_bpf()?;
            profiler::output::prepare_out_dir(&r.profile.out)?;
            let (held, pid) = spawn_held(&r.command)?;
            // After the spawn: the command runs with the limits it was
            // given, not slotprof's raised ones.
            privileges::raise_limits();
            let target = Target::from_pid(pid)?;
            let opts = session_options(r.profile, "record", r.duration, Some(exe))?;
            let outcome = session::run(&opts, target, Some(held)).await?;
            let status = outcome.command_status;
            finish(outcome)?;
            Ok(status.map_or(ExitCode::SUCCESS, command_exit_code))
        }
    }
}

/// What attach and record lower their shared options into.
fn session_options(
    p: profiler::cli::ProfileArgs,
    command: &'static str,
    duration: Option<std::time::Duration>,
    exe: Option<std::path::PathBuf>,
) -> anyhow::Result<SessionOptions> {
    Ok(SessionOptions {
        spec: p.spec()?,
        duration,
        out: p.out,
        command,
        probe_stats: p.probe_stats,
        exe,
        detector_probes: !p.no_detector_probes,
        save_events: p.save_events,
        save_replay: p.save_replay,
        push: {
            let push = p.push.config()?;
            if push.is_on() && p.slot_source.is_none() {
                anyhow::bail!("--push-pyroscope and --push-otlp push slots: give --slot-source too");
            }
            push
        },
    })
}

/// A command's exit code as a shell gives it: its own, or 128 + the
/// signal that ended it.
fn command_exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code as u8),
        (None, Some(signal)) => ExitCode::from((128 + signal) as u8),
        (None, None) => ExitCode::FAILURE,
    }
}

fn finish(outcome: session::Outcome) -> anyhow::Result<()> {
    let s = &outcome.summary;
    println!(
        "slotprof: {:.1} s, {} on-CPU samples, {} off-CPU intervals ({:.1} ms), {} lost; ended by {}",
        s.duration_s,
        s.counts.oncpu_samples,
        s.counts.offcpu_intervals,
        s.counts.offcpu_ns as f64 / 1e6,
        s.lost.total,
        s.ended_by
    );
    for path in &s.outputs {
        println!("  {path}");
    }
    if !s.findings.is_empty() {
        let kinds: Vec<String> = s.findings.iter().map(|(k, n)| format!("{n} {k}")).collect();
        println!("slotprof: findings: {} (see findings.json)", kinds.join(", "));
    }
    for w in s.warnings.iter().filter(|w| !outcome.printed.contains(w)) {
        eprintln!("slotprof: warning: {w}");
    }
    if !s.missing.is_empty() {
        for m in &s.missing {
            eprintln!("slotprof: error: not written: {}", m.error);
        }
        anyhow::bail!(
            "{} output(s) could not be written; {} says what is there and what is not (\"complete\": \
             false): free some space on that file system (or choose another --out) and run again",
            s.missing.len(),
            outcome.summary_path.display()
        );
    }
    Ok(())
}
