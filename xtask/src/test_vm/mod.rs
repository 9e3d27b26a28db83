//! `cargo xtask test-vm [--kernel 6.1] [--kernel 6.12] ...`: the
//! end-to-end detector tests, inside QEMU, on Debian's own kernels.
//!
//! For each kernel line: the newest Debian cloud-amd64 kernel package of
//! that line (apt), its bzImage payload decompressed to the ELF vmlinux
//! (booted directly, PVH), an initramfs written here (cpio newc) holding
//! busybox, slotprof, the stall programs and the e2e test executables at
//! the same absolute paths they have on the host (the tests find their
//! programs by those paths) with the shared libraries they load. The
//! guest's init mounts proc, sys, devtmpfs, tracefs, bpffs and runs each
//! test alone; the console is watched for panics, RCU stalls and soft
//! lockups, under a time limit. Downloads live in ~/.cache/slotprof/test-vm
//! (or $SLOTPROF_CACHE), outside git.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

mod initramfs;
mod kernel;
mod modules;
mod qemu;

use crate::{
    outcomes::{Outcome, Row},
    Tier,
};
use anyhow::{bail, Context};
use initramfs::*;
use kernel::*;
use qemu::*;

/// Test executables (cargo test targets of slotprof-tests) run in the VMs:
/// the probes' own checks, the detectors against their stall programs and
/// fixed twins, the spine they stand on, the uprobe slot source, and of
/// `run` the packaged unit under systemd. `host` needs a KVM host of its
/// own; it stays on the development machine.
const SCENARIOS: &[&str] = &[
    "probes",
    "spine",
    "detectors",
    "unwind",
    "slots",
    "cache_lines",
    "run",
];

/// One boot per group and kernel.
struct Group {
    name: &'static str,
    scenarios: &'static [&'static str],
    /// Run TCG one instruction per translation block while the workloads
    /// run (they ask for it: `slotprof_tests::precise_ips`). Under TCG a
    /// timer interrupt lands only between translation blocks, so a
    /// sample's IP is nearly always a jump target and never the memory
    /// access the cache-line detector decodes; one instruction per block
    /// puts the IP where hardware would (slower, so only where it matters).
    precise_ip: bool,
    /// How long one test may run before the guest dumps every task's
    /// kernel stack to the console and kills it (the VM goes on).
    test_limit: Duration,
    /// How long the VM may run, boot to power-off.
    vm_limit: Duration,
    /// Only the tests whose `binary::test` name holds one of these (empty:
    /// every test of the scenarios).
    tests: &'static [&'static str],
    /// Boot systemd as PID 1 and run the tests from a unit of its own
    /// (the packaged unit's test needs a real service manager).
    systemd: bool,
    /// Only on these kernel lines when none is asked for (empty: every
    /// line); `--kernel L` runs it on L whatever this says.
    lines: &'static [&'static str],
    /// Boot with the disk (the memory-pressure test's temporary directory).
    disk: bool,
    /// Kernel modules of the kernel's package to load at boot (with what
    /// they depend on), for tracepoints a module defines.
    modules: &'static [&'static str],
    /// The tier from which it runs: `Ci` groups run in both tiers, `Full`
    /// ones only in `cargo xtask test --full` (and `cargo xtask test-vm`).
    tier: Tier,
    /// About how long a run of the whole group takes on CI's machine,
    /// initramfs and boot included: not started when the test budget has
    /// less left (see `budget`).
    expect: Duration,
}

const GROUPS: &[Group] = &[
    // What differs between kernels, in the CI tier: every program loads,
    // passes this kernel's verifier and attaches (or its tracepoint is
    // not in this kernel, checked in tracefs), and one short session per
    // probe family yields its events, checked against the workload's own
    // count or the kernel's tracer: scheduler switches, wakeups and CPU
    // samples (the spine's first test, which also checks futex wakers
    // through the system-call probes), madvise through the system-call
    // probes against tracefs (the purge detector's test), TLB flushes and
    // page faults and compaction (`probes`), uprobes (the slot source).
    Group {
        name: "kernel",
        scenarios: &["probes", "spine", "detectors", "slots"],
        precise_ip: false,
        test_limit: Duration::from_secs(240),
        vm_limit: Duration::from_secs(900),
        tests: &[
            "probes::",
            "spine::hot_function_and_blocking_call_are_where_the_program_says",
            "detectors::sync_allocator_purge_fires_on_the_sync_twin_only_and_counts_right",
            "slots::uprobe_slots_follow_the_programs_slot_function",
        ],
        systemd: false,
        lines: &[],
        disk: false,
        // kvm:kvm_unmap_hva_range is kvm.ko's (it loads without VMX/SVM;
        // only its vendor modules need them): `slotprof host` attaches to it.
        modules: &["kvm"],
        tier: Tier::Ci,
        expect: Duration::from_secs(240),
    },
    // The detector matrix: every detector's test, the spine and the
    // unwinder, on each kernel (the full tier).
    Group {
        name: "main",
        scenarios: &["spine", "detectors", "unwind"],
        precise_ip: false,
        test_limit: Duration::from_secs(240),
        vm_limit: Duration::from_secs(900),
        tests: &[],
        systemd: false,
        lines: &[],
        disk: true,
        modules: &[],
        tier: Tier::Full,
        // 477 and 470 s in CI's VMs (6.1, 6.12; 2026-12-06).
        expect: Duration::from_secs(540),
    },
    Group {
        name: "precise-ip",
        scenarios: &["cache_lines"],
        precise_ip: true,
        // Each session attaches at TCG's usual speed and runs its
        // workload one instruction per block: 2.3-3.9 s an attach, the
        // group about two minutes a kernel. Run one instruction per block
        // throughout, an attach takes minutes (the BPF verifier ~1,000x
        // slower).
        test_limit: Duration::from_secs(300),
        vm_limit: Duration::from_secs(900),
        tests: &[],
        systemd: false,
        lines: &[],
        disk: false,
        modules: &[],
        tier: Tier::Full,
        expect: Duration::from_secs(300),
    },
    // The packaged systemd unit under systemd 252 (the host's, copied in)
    // as PID 1: one kernel is enough for what it checks (the service
    // manager's sandbox around slotprof, not the kernel's probes).
    Group {
        name: "systemd",
        scenarios: &["run"],
        precise_ip: false,
        test_limit: Duration::from_secs(300),
        vm_limit: Duration::from_secs(600),
        tests: &["the_packaged_unit_starts_profiles_reloads_and_stops_under_systemd"],
        systemd: true,
        lines: &["6.12"],
        disk: false,
        modules: &[],
        tier: Tier::Ci,
        // 50 s of VM.
        expect: Duration::from_secs(120),
    },
];

/// Under TCG the guest's clock runs against a CPU 10-50x slower than a real
/// one and its timers oversleep (a 0.5 ms sleep takes 5-10 ms): the tests
/// whose scenarios are timed stretch them by this factor
/// (`SLOTPROF_TEST_TIME_SCALE`, read by the tests' `time_scale()`).
const TCG_TIME_SCALE: u32 = 5;

/// A disk for a boot: an ext4 image (sparse, in a private file of the
/// cache) and the kernel modules to reach it (virtio-blk and, where the
/// kernel does not build them in, virtio's own); removed when dropped.
struct Disk {
    image: PathBuf,
    modules: Vec<modules::Module>,
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.image);
    }
}

/// The disk for a boot of `kernel`, or None (said: the memory-pressure
/// test is then skipped in the VM, with its reason).
fn disk_for(kernel: &Kernel, cache: &Path) -> Option<Disk> {
    // SLOTPROF_VM_DISK=0 boots without (the memory-pressure test then
    // skips in the VM, saying why).
    if std::env::var_os("SLOTPROF_VM_DISK").is_some_and(|v| v == "0") {
        return None;
    }
    let made = (|| -> anyhow::Result<Disk> {
        let dir = kernel
            .vmlinux
            .parent()
            .context("the kernel's directory")?
            .join("lib/modules")
            .join(&kernel.release);
        // virtio's PCI transport (the disk is a PCI device) and the driver.
        let modules = modules::load_order(&dir, &["virtio_pci", "virtio_blk"])?;
        let image = crate::validator::tempfile_in(cache, "disk")?;
        let disk = Disk { image, modules };
        std::fs::OpenOptions::new()
            .write(true)
            .open(&disk.image)?
            .set_len(1 << 30)?;
        let status = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1"])
            .arg(&disk.image)
            .status()
            .context("cannot run mkfs.ext4 (apt-get install e2fsprogs)")?;
        anyhow::ensure!(status.success(), "mkfs.ext4 failed");
        Ok(disk)
    })();
    match made {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("xtask: no disk for the VM ({e:#}): the tests that need one will be SKIPPED in it");
            None
        }
    }
}

/// The modules a group asks for, from `kernel`'s package; none (said: the
/// tests that need their tracepoints say so in the VM) when they cannot be
/// had.
fn group_modules(kernel: &Kernel, group: &Group) -> Vec<modules::Module> {
    if group.modules.is_empty() {
        return Vec::new();
    }
    let dir = kernel
        .vmlinux
        .parent()
        .map(|p| p.join("lib/modules").join(&kernel.release));
    match dir.map(|d| modules::load_order(&d, group.modules)) {
        Some(Ok(m)) => m,
        Some(Err(e)) => {
            eprintln!("xtask: the VM boots without {:?}: {e:#}", group.modules);
            Vec::new()
        }
        None => Vec::new(),
    }
}

/// Kernel lines tested when none is given.
pub const DEFAULT_KERNELS: &[&str] = &["6.1", "6.12"];

/// Runs the scenarios in the VMs, prints their table and returns a row per
/// scenario and kernel (a VM that failed makes its scenarios FAIL rows; an
/// error is a failure to set the VMs up).
pub fn run(root: &Path, args: &[String], tier: Tier) -> anyhow::Result<Vec<Row>> {
    let Asked {
        kernels,
        lines_asked: asked,
        only,
        tier,
    } = Asked::parse(args, tier)?;
    if !crate::is_root() {
        bail!("test-vm installs QEMU and kernel packages with apt: run `sudo cargo xtask test-vm`");
    }
    tools(root)?;
    let cache = cache_dir()?;
    remove_stale_initramfs(&cache);
    let tests = test_executables(root)?;
    let busybox = busybox(&cache)?;
    let started = Instant::now();
    let mut table = Results::new();
    let mut vm_failures = Vec::new();
    // Shortest groups first: when the test budget runs short, the long
    // precise-ip group is what is left out, not three others.
    let mut runs: Vec<(&String, &Group)> = kernels
        .iter()
        .flat_map(|k| GROUPS.iter().map(move |g| (k, g)))
        .filter(|(line, group)| asked || group.lines.is_empty() || group.lines.contains(&line.as_str()))
        .filter(|(_, group)| tier == Tier::Full || group.tier == Tier::Ci)
        .collect();
    runs.sort_by_key(|(_, g)| g.expect);
    let budget = crate::budget::get();
    for (line, group) in runs {
        let group_started = Instant::now();
        let group_tests: Vec<(String, PathBuf)> = tests
            .iter()
            .filter(|(name, _)| group.scenarios.contains(&name.as_str()))
            .cloned()
            .collect();
        // `--test` matches part of `binary::test` (`cache_lines::` runs a
        // whole file's tests).
        let wanted = |b: &str, t: &str| {
            only.as_deref().is_none_or(|o| format!("{b}::{t}").contains(o))
                && (group.tests.is_empty() || group.tests.iter().any(|g| format!("{b}::{t}").contains(g)))
        };
        if let Err(why) = budget.fits(group.expect) {
            eprintln!("xtask: [{line}] the {} group is {why}", group.name);
            table.extend(left_out(line, group, &group_tests, &wanted, &why)?);
            continue;
        }
        let kernel = kernel_image(root, &cache, line)?;
        let disk = if group.disk {
            disk_for(&kernel, &cache)
        } else {
            None
        };
        let initramfs = cache.join(format!("initramfs-{}.cpio", std::process::id()));
        let mut load = group_modules(&kernel, group);
        load.extend(disk.iter().flat_map(|d| d.modules.iter().cloned()));
        let boot_with = Boot {
            modules: &load,
            disk: disk.is_some(),
        };
        let names = build_initramfs(
            root,
            &initramfs,
            &busybox,
            &group_tests,
            &wanted,
            group,
            &boot_with,
        )?;
        if names.is_empty() {
            continue;
        }
        let image = disk.as_ref().map(|d| d.image.as_path());
        let result = boot(&kernel, &initramfs, line, group, &cache, image);
        let _ = std::fs::remove_file(&initramfs);
        match result {
            Ok(results) => {
                let failed: BTreeSet<(String, String)> = names
                    .iter()
                    .filter(|(b, t)| outcome_of(&results, b, t).0 == Outcome::Fail)
                    .cloned()
                    .collect();
                // A test that failed gets one more run in a fresh VM (TCG
                // timing is noisy); the table says so either way.
                let mut retried = BTreeMap::new();
                let again_fits = budget.fits(group_started.elapsed());
                if let (false, Err(why)) = (failed.is_empty(), &again_fits) {
                    eprintln!("xtask: [{line}] the failed test(s) are not run again: {why}");
                }
                if !failed.is_empty() && again_fits.is_ok() {
                    eprintln!(
                        "xtask: [{line}] {} failed test(s) run once more in a fresh VM",
                        failed.len()
                    );
                    // The first run's console stays for reading.
                    let log = |tag: &str| cache.join(format!("console-{line}-{}{tag}.log", group.name));
                    let _ = std::fs::rename(log(""), log("-first-run"));
                    let again = |b: &str, t: &str| failed.contains(&(b.to_string(), t.to_string()));
                    build_initramfs(
                        root,
                        &initramfs,
                        &busybox,
                        &group_tests,
                        &again,
                        group,
                        &boot_with,
                    )?;
                    let second = boot(&kernel, &initramfs, line, group, &cache, image);
                    let _ = std::fs::remove_file(&initramfs);
                    if let Ok(second) = second {
                        retried = second;
                    }
                }
                let again = again_fits.as_ref().map(|_| &retried);
                table.extend(judged(line, group, &names, &results, again));
            }
            Err(e) => {
                vm_failures.push(format!("{line} ({}, {}): {e:#}", kernel.release, group.name));
                for (bin, test) in &names {
                    table.insert(
                        (line.clone(), format!("{bin}::{test}")),
                        (Outcome::Fail, "the VM failed".into()),
                    );
                }
            }
        }
        budget.took(&format!("the {} group on {line}", group.name), group_started);
    }
    report(table, &vm_failures, &cache, started, only)
}

/// A test's outcome in `results`; a test that has none did not run.
fn outcome_of(results: &Results, bin: &str, test: &str) -> (Outcome, String) {
    results
        .get(&(bin.to_string(), test.to_string()))
        .cloned()
        .unwrap_or((Outcome::Fail, "did not run (the VM stopped before it)".into()))
}

/// Each test's row on `line`: its first run's outcome, or for one that
/// failed, what its second run in a fresh VM made of it (FLAKY when it
/// passed then, never a plain pass), or why it was not run again.
fn judged(
    line: &str,
    group: &Group,
    names: &[(String, String)],
    first: &Results,
    again: Result<&Results, &String>,
) -> Results {
    let mut table = Results::new();
    for (bin, test) in names {
        let key = (line.to_string(), format!("{bin}::{test}"));
        let mut r = outcome_of(first, bin, test);
        if r.0 == Outcome::Fail {
            r = match again {
                Err(why) => (Outcome::Fail, format!("{} (not run again: {why})", r.1)),
                Ok(retried) => {
                    let first_run = format!("console-{line}-{}-first-run.log", group.name);
                    match outcome_of(retried, bin, test) {
                        (Outcome::Fail, note) => (Outcome::Fail, format!("{} (and again: {note})", r.1)),
                        (Outcome::Pass, _) => (
                            Outcome::Flaky,
                            format!("passed on a second run; the first failed ({first_run}): {}", r.1),
                        ),
                        (o, _) => (
                            o,
                            format!("on a second run; the first failed ({first_run}): {}", r.1),
                        ),
                    }
                }
            };
        }
        table.insert(key, r);
    }
    table
}

/// What `cargo xtask test-vm` was asked for.
struct Asked {
    /// Kernel lines, the default ones when none was asked for.
    kernels: Vec<String>,
    /// Whether `--kernel` named them (a group then runs on every line
    /// asked, whatever its own lines say).
    lines_asked: bool,
    /// `--test`: part of `binary::test`.
    only: Option<String>,
    tier: Tier,
}

impl Asked {
    /// `[--kernel L]... [--test NAME-PART] [--ci]`.
    fn parse(args: &[String], mut tier: Tier) -> anyhow::Result<Self> {
        let mut kernels: Vec<String> = Vec::new();
        let mut only: Option<String> = None;
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--kernel" => kernels.push(it.next().context("--kernel wants a line, e.g. 6.1")?.clone()),
                "--test" => only = Some(it.next().context("--test wants part of a test name")?.clone()),
                "--ci" => tier = Tier::Ci,
                other => bail!(
                    "unknown argument {other:?}; usage: cargo xtask test-vm [--kernel 6.1]... [--test NAME-PART] [--ci]"
                ),
            }
        }
        let lines_asked = !kernels.is_empty();
        if !lines_asked {
            kernels = DEFAULT_KERNELS.iter().map(|k| k.to_string()).collect();
        }
        Ok(Self {
            kernels,
            lines_asked,
            only,
            tier,
        })
    }
}

/// Outcomes and notes by (place, test): a kernel line and
/// `binary::test` in the table, a binary and a test from one VM.
pub(super) type Results = BTreeMap<(String, String), (Outcome, String)>;

/// A group the test budget left out: a SKIPPED row per test it would
/// have run, naming the command that runs it.
fn left_out(
    line: &str,
    group: &Group,
    tests: &[(String, PathBuf)],
    wanted: &dyn Fn(&str, &str) -> bool,
    why: &str,
) -> anyhow::Result<Results> {
    let mut rows = Results::new();
    for (bin, exe) in tests {
        for test in list_tests(exe)?.iter().filter(|t| wanted(bin, t)) {
            rows.insert(
                (line.to_string(), format!("{bin}::{test}")),
                (
                    Outcome::Skipped,
                    format!(
                        "the {} group {why}: run `sudo cargo xtask test-vm --kernel {line} --test {bin}::{test}`",
                        group.name
                    ),
                ),
            );
        }
    }
    Ok(rows)
}

/// Prints the VMs' table and says what failed; the table as rows.
fn report(
    table: Results,
    vm_failures: &[String],
    cache: &Path,
    started: Instant,
    only: Option<String>,
) -> anyhow::Result<Vec<Row>> {
    if table.is_empty() {
        bail!(
            "no VM scenario matched --test {:?} (scenarios are named binary::test, e.g. \
             cache_lines::adjacent_counters_are_the_top_line_and_the_padded_twin_is_clean)",
            only.unwrap_or_default()
        );
    }
    println!("\nslotprof test-vm: {:.0} s", started.elapsed().as_secs_f64());
    println!("{:<8} {:<70} {:<12} note", "kernel", "scenario", "result");
    for ((kernel, scenario), (outcome, note)) in &table {
        println!("{kernel:<8} {scenario:<70} {:<12} {note}", outcome.word());
    }
    for f in vm_failures {
        eprintln!("xtask: VM failure: {f}");
    }
    let failed = table.values().filter(|(o, _)| *o == Outcome::Fail).count();
    let flaky = table.values().filter(|(o, _)| *o == Outcome::Flaky).count();
    if flaky > 0 {
        eprintln!("xtask: {flaky} VM scenario(s) FLAKY: they failed once and passed when run again");
    }
    if failed > 0 || !vm_failures.is_empty() {
        eprintln!(
            "xtask: {failed} VM scenario(s) failed (console logs in {})",
            cache.display()
        );
    }
    Ok(table
        .into_iter()
        .map(|((kernel, scenario), (outcome, note))| {
            let (binary, test) = scenario.split_once("::").unwrap_or(("", &scenario));
            Row {
                place: kernel,
                package: "slotprof-tests".into(),
                binary: binary.to_string(),
                test: test.to_string(),
                outcome,
                note,
            }
        })
        .collect())
}

/// QEMU and the decompressors, from apt when missing.
fn tools(root: &Path) -> anyhow::Result<()> {
    let want = [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("lz4", "lz4"),
        ("zstd", "zstd"),
        ("xz", "xz-utils"),
        ("dpkg-deb", "dpkg"),
    ];
    let missing: Vec<&str> = want
        .iter()
        .filter(|(bin, _)| !crate::on_path(bin))
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let env = [("DEBIAN_FRONTEND", "noninteractive")];
    crate::run_env(root, "apt-get", &["update", "-qq"], &env)?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    crate::run_env(root, "apt-get", &args, &env)
}

fn cache_dir() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("SLOTPROF_CACHE") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set; set SLOTPROF_CACHE")?)
            .join(".cache/slotprof/test-vm"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

/// Initramfs images (~360 MB each) left by runs that were killed: named
/// by their run's pid, removed when that process is gone.
fn remove_stale_initramfs(cache: &Path) {
    for e in std::fs::read_dir(cache).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("initramfs-")
            .and_then(|r| r.strip_suffix(".cpio"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!(
                "xtask: removing {} (left by a run that did not finish)",
                e.path().display()
            );
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judges_by_status_then_by_what_the_test_said() {
        let lines = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(judge(true, &lines(&["running 1 test", "ok"])).0, Outcome::Pass);
        let u = judge(
            true,
            &lines(&["test x ... UNSUPPORTED: ipi:ipi_send_cpu is not in this kernel"]),
        );
        assert_eq!(u.0, Outcome::Unsupported);
        assert!(u.1.contains("ipi:ipi_send_cpu"));
        assert_eq!(judge(true, &lines(&["SKIPPED: needs root"])).0, Outcome::Skipped);
        let h = judge(
            false,
            &lines(&[
                "running 1 test",
                "SLOTPROF-TEST-HUNG still running after 240 s (...)",
            ]),
        );
        assert_eq!(h.0, Outcome::Fail);
        assert!(h.1.starts_with("hung: still running after 240 s"), "{}", h.1);
        let f = judge(false, &lines(&["thread 'x' panicked at tests/x.rs:1:1:", "boom"]));
        assert_eq!(f.0, Outcome::Fail);
        assert!(f.1.contains("panicked"));
        let p = judge(
            true,
            &lines(&[
                "NOT ON THIS KERNEL: ipi:ipi_send_cpu (slotprof_ipi_send not attached; ...)",
                "NOT ON THIS KERNEL: ipi:ipi_send_cpu (again)",
            ]),
        );
        assert_eq!(
            p,
            (
                Outcome::Pass,
                "without ipi:ipi_send_cpu (not in this kernel)".to_string()
            )
        );
    }

    #[test]
    fn cpio_entries_are_aligned_and_end_with_the_trailer() {
        let dir = std::env::temp_dir().join(format!("xtask-cpio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.cpio");
        let mut c = Cpio::create(&p).unwrap();
        c.bytes(Path::new("a/b/init"), b"hello", 0o755).unwrap();
        c.finish().unwrap();
        let data = std::fs::read(&p).unwrap();
        assert_eq!(data.len() % 4, 0);
        let text = String::from_utf8_lossy(&data);
        assert_eq!(text.matches("070701").count(), 4, "a, a/b, a/b/init, trailer");
        assert!(text.contains("a/b/init\0"));
        assert!(text.contains("TRAILER!!!\0"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
