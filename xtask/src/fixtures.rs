//! `cargo xtask record-fixtures` (root): records the replay fixtures of
//! `tests/fixtures/replay/` from the stall programs under real probes
//! (`slotprof record --save-replay`), each with the program's own report
//! (`truth.json`). `profiler/tests/replay.rs` replays them in `cargo
//! test`, without root. Record again after a change to the event records,
//! the detectors' inputs or the recording format.

use std::path::Path;

use anyhow::{bail, Context};

/// One fixture: its name, the stall program and its arguments, and
/// slotprof's options.
struct Fixture {
    name: &'static str,
    program: &'static str,
    args: &'static [&'static str],
    slotprof: &'static [&'static str],
}

/// slotprof's options for the gap program and its smooth twin (as the
/// MainLoopGap e2e test runs them).
const GAPS_OPTIONS: &[&str] = &[
    "-F",
    "499",
    "--loop-symbol",
    "stall_loop_iteration",
    "--gap-threshold",
    "10ms",
    "--slot-source",
    "clock=400ms",
];

/// Short runs (the fixtures are committed): a few seconds each, every
/// one with clock slots so that the always-on replay has slots to cut.
const FIXTURES: &[Fixture] = &[
    Fixture {
        name: "gaps",
        program: "stall-gaps",
        args: &["--seconds", "3", "--gap-ms", "20"],
        slotprof: GAPS_OPTIONS,
    },
    Fixture {
        name: "gaps-smooth",
        program: "stall-gaps",
        args: &["--seconds", "2", "--smooth", "--slow-ms", "5"],
        slotprof: GAPS_OPTIONS,
    },
    Fixture {
        name: "lock",
        program: "stall-gaps",
        args: &["--seconds", "3", "--gap-ms", "50"],
        slotprof: &["--loop-thread", "main-loop", "--slot-source", "clock=400ms"],
    },
    Fixture {
        name: "purge-sync",
        program: "stall-alloc",
        args: &["--slots", "6"],
        slotprof: &["--slot-source", "clock=400ms"],
    },
    Fixture {
        name: "purge-background",
        program: "stall-alloc",
        args: &["--slots", "6", "--purge", "background"],
        slotprof: &["--slot-source", "clock=400ms"],
    },
    // Leader windows of 4 slots in every 8, for the always-on replay's
    // per-window cache-line pass.
    Fixture {
        name: "false-sharing",
        program: "stall-false-sharing",
        args: &["--mode", "counters", "--seconds", "4"],
        slotprof: &["-F", "499", "--slot-source", "clock=400ms,leader=4/8"],
    },
    Fixture {
        name: "false-sharing-padded",
        program: "stall-false-sharing",
        args: &["--mode", "counters", "--seconds", "4", "--padded"],
        slotprof: &["-F", "499", "--slot-source", "clock=400ms,leader=4/8"],
    },
];

pub fn run(root: &Path) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("recording loads eBPF programs: run `sudo cargo xtask record-fixtures`");
    }
    let dir = root.join("tests/fixtures/replay");
    let scratch = crate::private_temp_dir("slotprof-fixtures")?;
    for f in FIXTURES {
        let into = dir.join(f.name);
        let _ = std::fs::remove_dir_all(&into);
        std::fs::create_dir_all(&into)?;
        let out = scratch.join(f.name);
        let mut args: Vec<String> = vec![
            "record".into(),
            "--out".into(),
            out.display().to_string(),
            "--save-replay".into(),
            into.display().to_string(),
        ];
        args.extend(f.slotprof.iter().map(|s| s.to_string()));
        args.push("--".into());
        args.push(root.join("target/release").join(f.program).display().to_string());
        args.extend(f.args.iter().map(|s| s.to_string()));
        args.push("--report".into());
        args.push(into.join("truth.json").display().to_string());
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        crate::run(
            root,
            &root.join("target/release/slotprof").display().to_string(),
            &argv,
        )
        .with_context(|| format!("recording the {} fixture", f.name))?;
        let bytes: u64 = std::fs::read_dir(&into)?
            .flatten()
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum();
        eprintln!("xtask: fixture {}: {} KiB", f.name, bytes >> 10);
    }
    for (name, unevictable) in [("kvm-compaction", 1), ("kvm-locked-untouched", 0)] {
        record_host(root, &dir.join(name), &scratch, unevictable)
            .with_context(|| format!("recording the {name} fixture"))?;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// The compaction sysctls, restored when dropped (also on an error).
struct Sysctls(Vec<(&'static str, String)>);

const SYSCTLS: [&str; 2] = [
    "/proc/sys/vm/compact_unevictable_allowed",
    "/proc/sys/vm/compaction_proactiveness",
];

impl Sysctls {
    fn save() -> anyhow::Result<Self> {
        let mut saved = Vec::new();
        for p in SYSCTLS {
            saved.push((
                p,
                std::fs::read_to_string(p)
                    .with_context(|| p.to_string())?
                    .trim()
                    .to_string(),
            ));
        }
        Ok(Self(saved))
    }

    fn set(&self, unevictable: u32, proactiveness: u32) -> anyhow::Result<()> {
        std::fs::write(SYSCTLS[0], unevictable.to_string())?;
        std::fs::write(SYSCTLS[1], proactiveness.to_string())?;
        Ok(())
    }
}

impl Drop for Sysctls {
    fn drop(&mut self) {
        for (p, v) in &self.0 {
            if let Err(e) = std::fs::write(p, v) {
                eprintln!("xtask: could not restore {p} to {v}: {e}");
            }
        }
    }
}

/// A `slotprof host` recording: a real KVM guest with 256 MiB of mlocked
/// memory (stall-kvm-guest, without its memory placement: a fixture needs
/// some migrated pages, not the most), compaction asked for by hand while
/// `slotprof host` watches; `unevictable` is vm.compact_unevictable_allowed
/// (0: the locked guest must stay untouched, the fixed twin). The guest's
/// report (`truth.json`) counts the pages that moved.
fn record_host(root: &Path, into: &Path, scratch: &Path, unevictable: u32) -> anyhow::Result<()> {
    use std::io::BufRead;
    if !Path::new("/dev/kvm").exists() {
        bail!("the host fixtures run a KVM guest: this machine has no /dev/kvm");
    }
    let _ = std::fs::remove_dir_all(into);
    std::fs::create_dir_all(into)?;
    let sysctls = Sysctls::save()?;
    sysctls.set(0, 0)?;
    let mut guest = std::process::Command::new(root.join("target/release/stall-kvm-guest"))
        .args(["--mem-mib", "256", "--no-placement", "--report"])
        .arg(into.join("truth.json"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting stall-kvm-guest")?;
    let mut lines = std::io::BufReader::new(guest.stdout.take().context("guest stdout")?).lines();
    let ready = lines.next().transpose()?.unwrap_or_default();
    if ready != "ready" {
        let _ = guest.kill();
        bail!("stall-kvm-guest did not start (said {ready:?})");
    }
    sysctls.set(unevictable, 0)?;
    let out = scratch.join(into.file_name().unwrap_or_default());
    let pid = guest.id().to_string();
    let mut host = std::process::Command::new(root.join("target/release/slotprof"))
        .arg("host")
        .args(["-d", "6s", "--vm-pid", &pid, "--out"])
        .arg(&out)
        .arg("--save-replay")
        .arg(into)
        .spawn()
        .context("starting slotprof host")?;
    // Attached within a second here; compaction in the middle of the watch.
    std::thread::sleep(std::time::Duration::from_secs(2));
    std::fs::write("/proc/sys/vm/compact_memory", "1").context("writing compact_memory")?;
    let status = host.wait()?;
    // SAFETY: kill(2) on the guest we started; SIGTERM makes it write its report.
    unsafe { libc::kill(guest.id() as i32, libc::SIGTERM) };
    guest.wait()?;
    drop(sysctls);
    if !status.success() {
        bail!("slotprof host failed: {status}");
    }
    eprintln!(
        "xtask: fixture {}: {} KiB",
        into.display(),
        std::fs::metadata(into.join("host-recording.json.gz"))?.len() >> 10
    );
    Ok(())
}
