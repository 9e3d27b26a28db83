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
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use crate::outcomes::{Outcome, Row};
use anyhow::{bail, Context};

/// Test executables (cargo test targets of slotprof-tests) run in the VMs:
/// the detectors against their stall programs and fixed twins, and the
/// spine they stand on, and of `run` the packaged unit under systemd.
/// `slots` needs a browser and `host` a KVM host of its own; they stay on
/// the development machine.
const SCENARIOS: &[&str] = &["spine", "detectors", "unwind", "cache_lines", "run"];

/// One boot per group and kernel.
struct Group {
    name: &'static str,
    scenarios: &'static [&'static str],
    /// Run TCG one instruction per translation block. Under TCG a timer
    /// interrupt lands only between translation blocks, so a sample's IP is
    /// nearly always a jump target and never the memory access the
    /// cache-line detector decodes; one instruction per block puts the IP
    /// where hardware would (slower, so only where it matters).
    precise_ip: bool,
    /// How long one test may run before the guest dumps every task's
    /// kernel stack to the console and kills it (the VM goes on).
    test_limit: Duration,
    /// How long the VM may run, boot to power-off.
    vm_limit: Duration,
    /// Only the tests whose names hold this (None: every test of the
    /// scenarios).
    tests: Option<&'static str>,
    /// Boot systemd as PID 1 and run the tests from a unit of its own
    /// (the packaged unit's test needs a real service manager).
    systemd: bool,
    /// Only on these kernel lines (empty: every line asked for).
    lines: &'static [&'static str],
}

const GROUPS: &[Group] = &[
    Group {
        name: "main",
        scenarios: &["spine", "detectors", "unwind"],
        precise_ip: false,
        test_limit: Duration::from_secs(240),
        vm_limit: Duration::from_secs(900),
        tests: None,
        systemd: false,
        lines: &[],
    },
    Group {
        name: "precise-ip",
        scenarios: &["cache_lines"],
        precise_ip: true,
        test_limit: Duration::from_secs(480),
        // Two tests of up to 8 min each: on 6.12 the first took 419 s
        // (6.1: 289 and 292 s), and 900 s ran out in the second.
        vm_limit: Duration::from_secs(1200),
        tests: None,
        systemd: false,
        lines: &[],
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
        tests: Some("the_packaged_unit_starts_profiles_reloads_and_stops_under_systemd"),
        systemd: true,
        lines: &["6.12"],
    },
];

/// Under TCG the guest's clock runs against a CPU 10-50x slower than a real
/// one and its timers oversleep (a 0.5 ms sleep takes 5-10 ms): the tests
/// whose scenarios are timed stretch them by this factor
/// (`SLOTPROF_TEST_TIME_SCALE`, read by the tests' `time_scale()`).
const TCG_TIME_SCALE: u32 = 5;

/// Kernel lines tested when none is given.
pub const DEFAULT_KERNELS: &[&str] = &["6.1", "6.12"];

/// Console lines that fail a VM whatever the tests say.
const KERNEL_TROUBLE: &[&str] = &[
    "Kernel panic",
    "BUG: soft lockup",
    "self-detected stall",
    "detected stalls on CPUs",
    "Oops:",
    "general protection fault",
];

/// How long a VM runs on after the kernel reported trouble (its traces
/// and the other CPUs' reports follow), and how many of those lines are
/// echoed to the terminal.
const TROUBLE_GRACE: Duration = Duration::from_secs(60);
const TROUBLE_ECHO_LINES: usize = 120;

/// Runs the scenarios in the VMs, prints their table and returns a row per
/// scenario and kernel (a VM that failed makes its scenarios FAIL rows; an
/// error is a failure to set the VMs up).
pub fn run(root: &Path, args: &[String]) -> anyhow::Result<Vec<Row>> {
    let mut kernels: Vec<String> = Vec::new();
    let mut only: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--kernel" => kernels.push(it.next().context("--kernel wants a line, e.g. 6.1")?.clone()),
            "--test" => only = Some(it.next().context("--test wants part of a test name")?.clone()),
            other => bail!(
                "unknown argument {other:?}; usage: cargo xtask test-vm [--kernel 6.1]... [--test NAME-PART]"
            ),
        }
    }
    if kernels.is_empty() {
        kernels = DEFAULT_KERNELS.iter().map(|k| k.to_string()).collect();
    }
    if !crate::is_root() {
        bail!("test-vm installs QEMU and kernel packages with apt: run `sudo cargo xtask test-vm`");
    }
    tools(root)?;
    let cache = cache_dir()?;
    remove_stale_initramfs(&cache);
    let tests = test_executables(root)?;
    let busybox = busybox(&cache)?;
    let started = Instant::now();
    let mut table: BTreeMap<(String, String), (Outcome, String)> = BTreeMap::new();
    let mut vm_failures = Vec::new();
    for (line, group) in kernels.iter().flat_map(|k| GROUPS.iter().map(move |g| (k, g))) {
        if !group.lines.is_empty() && !group.lines.contains(&line.as_str()) {
            continue;
        }
        let kernel = kernel_image(root, &cache, line)?;
        let initramfs = cache.join(format!("initramfs-{}.cpio", std::process::id()));
        let group_tests: Vec<(String, PathBuf)> = tests
            .iter()
            .filter(|(name, _)| group.scenarios.contains(&name.as_str()))
            .cloned()
            .collect();
        // `--test` matches part of `binary::test` (`cache_lines::` runs a
        // whole file's tests).
        let wanted = |b: &str, t: &str| {
            only.as_deref().is_none_or(|o| format!("{b}::{t}").contains(o))
                && group.tests.is_none_or(|g| t.contains(g))
        };
        let names = build_initramfs(root, &initramfs, &busybox, &group_tests, &wanted, group)?;
        if names.is_empty() {
            continue;
        }
        let result = boot(&kernel, &initramfs, line, group, &cache);
        let _ = std::fs::remove_file(&initramfs);
        match result {
            Ok(results) => {
                let outcome =
                    |results: &BTreeMap<(String, String), (Outcome, String)>, bin: &String, test: &String| {
                        results
                            .get(&(bin.clone(), test.clone()))
                            .cloned()
                            .unwrap_or((Outcome::Fail, "did not run (the VM stopped before it)".into()))
                    };
                let failed: BTreeSet<(String, String)> = names
                    .iter()
                    .filter(|(b, t)| outcome(&results, b, t).0 == Outcome::Fail)
                    .cloned()
                    .collect();
                // A test that failed gets one more run in a fresh VM (TCG
                // timing is noisy); the table says so either way.
                let mut retried = BTreeMap::new();
                if !failed.is_empty() {
                    eprintln!(
                        "xtask: [{line}] {} failed test(s) run once more in a fresh VM",
                        failed.len()
                    );
                    // The first run's console stays for reading.
                    let log = |tag: &str| cache.join(format!("console-{line}-{}{tag}.log", group.name));
                    let _ = std::fs::rename(log(""), log("-first-run"));
                    let again = |b: &str, t: &str| failed.contains(&(b.to_string(), t.to_string()));
                    build_initramfs(root, &initramfs, &busybox, &group_tests, &again, group)?;
                    let second = boot(&kernel, &initramfs, line, group, &cache);
                    let _ = std::fs::remove_file(&initramfs);
                    if let Ok(second) = second {
                        retried = second;
                    }
                }
                for (bin, test) in &names {
                    let key = (line.clone(), format!("{bin}::{test}"));
                    let mut r = outcome(&results, bin, test);
                    if r.0 == Outcome::Fail {
                        let (o, note) = outcome(&retried, bin, test);
                        r = match o {
                            Outcome::Fail => (Outcome::Fail, format!("{} (and again: {note})", r.1)),
                            // Passed only when run again: flaky, never
                            // a plain pass.
                            Outcome::Pass => (
                                Outcome::Flaky,
                                format!(
                                    "passed on a second run; the first failed (console-{line}-{}-first-run.log): {}",
                                    group.name, r.1
                                ),
                            ),
                            o => (
                                o,
                                format!(
                                    "on a second run; the first failed (console-{line}-{}-first-run.log): {}",
                                    group.name, r.1
                                ),
                            ),
                        };
                    }
                    table.insert(key, r);
                }
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
    }
    report(table, &vm_failures, &cache, started, only)
}

/// Prints the VMs' table and says what failed; the table as rows.
fn report(
    table: BTreeMap<(String, String), (Outcome, String)>,
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
        .filter(|(bin, _)| !on_path(bin))
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

pub(crate) fn on_path(bin: &str) -> bool {
    which_in_path(bin).is_some()
}

/// Where `bin` is on PATH (a symlink's path, not its target's: the guest
/// gets the file's contents under the name it is called by).
fn which_in_path(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
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

/// A bootable kernel.
struct Kernel {
    release: String,
    vmlinux: PathBuf,
}

/// Output of a command, or an error naming it.
fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The package of the newest kernel of `line` (e.g. "6.1", "6.12").
fn kernel_package(root: &Path, line: &str) -> anyhow::Result<String> {
    let resolve = || -> Option<String> {
        for meta in [
            format!("linux-image-{line}-cloud-amd64"),
            "linux-image-cloud-amd64".into(),
        ] {
            let Ok(deps) = output(Command::new("apt-cache").args(["depends", &meta])) else {
                continue;
            };
            let dep = deps
                .lines()
                .filter_map(|l| l.trim().strip_prefix("Depends: "))
                .find(|d| d.starts_with("linux-image-"))?
                .to_string();
            if dep.starts_with(&format!("linux-image-{line}.")) {
                return Some(dep);
            }
        }
        None
    };
    if let Some(p) = resolve() {
        return Ok(p);
    }
    crate::run_env(
        root,
        "apt-get",
        &["update", "-qq"],
        &[("DEBIAN_FRONTEND", "noninteractive")],
    )?;
    resolve().with_context(|| {
        format!("no Debian cloud-amd64 kernel package of the {line} line in apt (try 6.1 or 6.12)")
    })
}

/// Downloads (once) the package `name` into `dir` and unpacks it there.
fn fetch_deb(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let unpacked = dir.join(name);
    if unpacked.join(".done").exists() {
        return Ok(unpacked);
    }
    std::fs::create_dir_all(dir)?;
    output(
        Command::new("apt-get")
            .args(["download", "-q", name])
            .current_dir(dir),
    )?;
    let deb = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|e| e == "deb")
                && p.file_name()
                    .and_then(|f| f.to_str())
                    .is_some_and(|f| f.starts_with(&format!("{name}_")))
        })
        .with_context(|| format!("apt-get download {name} left no .deb in {}", dir.display()))?;
    output(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    std::fs::write(unpacked.join(".done"), "")?;
    let _ = std::fs::remove_file(deb);
    Ok(unpacked)
}

fn kernel_image(root: &Path, cache: &Path, line: &str) -> anyhow::Result<Kernel> {
    let package = kernel_package(root, line)?;
    let dir = fetch_deb(cache, &package)?;
    let vmlinuz = std::fs::read_dir(dir.join("boot"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with("vmlinuz-"))
        })
        .with_context(|| format!("{package} has no /boot/vmlinuz-*"))?;
    let release = vmlinuz
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or("")
        .trim_start_matches("vmlinuz-")
        .to_string();
    let vmlinux = dir.join("vmlinux");
    if !vmlinux.exists() {
        extract_vmlinux(&vmlinuz, &vmlinux)?;
    }
    eprintln!("xtask: kernel {line}: {release} ({})", vmlinux.display());
    Ok(Kernel { release, vmlinux })
}

/// The ELF vmlinux inside a bzImage: the setup header says where the
/// compressed payload is; its magic says how it is compressed.
fn extract_vmlinux(bzimage: &Path, out: &Path) -> anyhow::Result<()> {
    let image = std::fs::read(bzimage)?;
    anyhow::ensure!(
        image.len() > 0x250 && &image[0x202..0x206] == b"HdrS",
        "{} is not a bzImage",
        bzimage.display()
    );
    let setup_sects = match image[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let word = |at: usize| u32::from_le_bytes(image[at..at + 4].try_into().unwrap()) as usize;
    let start = (setup_sects + 1) * 512 + word(0x248);
    let payload = image
        .get(start..start + word(0x24c))
        .context("the bzImage payload lies outside the file")?;
    let tool: &[&str] = if payload.starts_with(&[0x02, 0x21, 0x4c, 0x18]) {
        &["lz4", "-d", "-c"]
    } else if payload.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        &["zstd", "-d", "-c"]
    } else if payload.starts_with(b"\xfd7zXZ\x00") {
        &["xz", "-d", "-c"]
    } else if payload.starts_with(&[0x1f, 0x8b]) {
        &["gzip", "-d", "-c"]
    } else {
        bail!("unknown compression of the kernel in {}", bzimage.display());
    };
    let mut child = Command::new(tool[0])
        .args(&tool[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", tool[0]))?;
    let mut stdin = child.stdin.take().unwrap();
    let payload = payload.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&payload));
    let result = child.wait_with_output()?;
    let _ = feeder.join();
    // Decompressors may complain about trailing bytes after the stream.
    anyhow::ensure!(
        result.stdout.starts_with(b"\x7fELF"),
        "{} did not give an ELF vmlinux",
        tool[0]
    );
    let tmp = out.with_extension("tmp");
    std::fs::write(&tmp, &result.stdout)?;
    std::fs::rename(&tmp, out)?;
    Ok(())
}

fn busybox(cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = fetch_deb(cache, "busybox-static")?;
    let bin = dir.join("bin/busybox");
    anyhow::ensure!(bin.exists(), "busybox-static has no bin/busybox");
    Ok(bin)
}

/// The e2e test executables of [`SCENARIOS`], built now: (target, path).
fn test_executables(root: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut select = vec!["-p", "slotprof-tests"];
    for s in SCENARIOS {
        select.extend(["--test", s]);
    }
    let found: Vec<(String, PathBuf)> = crate::outcomes::executables(root, &select)?
        .into_iter()
        .filter(|e| SCENARIOS.contains(&e.target.as_str()))
        .map(|e| (e.target, e.path))
        .collect();
    anyhow::ensure!(
        found.len() == SCENARIOS.len(),
        "cargo built {found:?}, wanted {SCENARIOS:?}"
    );
    Ok(found)
}

/// The tests one executable holds (`--list`), ignored ones included.
fn list_tests(exe: &Path) -> anyhow::Result<Vec<String>> {
    let out = output(Command::new(exe).args(["--list", "--include-ignored"]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_string)
        .collect())
}

/// Writes the initramfs; returns the (executable, test) pairs it runs.
fn build_initramfs(
    root: &Path,
    out: &Path,
    busybox: &Path,
    tests: &[(String, PathBuf)],
    wanted: &dyn Fn(&str, &str) -> bool,
    group: &Group,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut files: BTreeSet<PathBuf> = BTreeSet::new();
    // The binaries, the stall programs built without frame pointers
    // (`cargo xtask build` puts them in target/nofp) and the C ones
    // (target/c), at their host paths.
    for dir in ["target/release", "target/nofp/release", "target/c"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for entry in entries {
            let p = entry?.path();
            let is_exe = p.is_file()
                && std::os::unix::fs::PermissionsExt::mode(&p.metadata()?.permissions()) & 0o111 != 0
                && p.extension().is_none();
            if is_exe && p.file_name().is_some_and(|n| n != "xtask") {
                files.insert(p);
            }
        }
    }
    // The binutils the unwind tests change binaries with (the guest has no
    // compiler; the C programs come prebuilt from target/c), and perf, their
    // reference.
    for tool in ["objcopy", "readelf", "perf"] {
        match which_in_path(tool) {
            Some(p) => {
                files.insert(p);
            }
            None => eprintln!("xtask: no {tool} here: the tests that need it will be SKIPPED in the VM"),
        }
    }
    let mut runs = Vec::new();
    let mut script = String::from(INIT_HEAD);
    if group.systemd {
        // systemd clears the environment of its services: said here.
        script.push_str("export SLOTPROF_TEST_UNDER_SYSTEMD=1\n");
    }
    script.push_str(&format!("TEST_LIMIT={}\n", group.test_limit.as_secs()));
    if !cpu_has_virtualization() {
        script.push_str(&format!("export SLOTPROF_TEST_TIME_SCALE={TCG_TIME_SCALE}\n"));
    }
    // CPUs 0 and 1 are two sockets (QEMU's -smp below): two L3 domains in
    // the guest's sysfs, which the cache-line tests assert on.
    script.push_str("export SLOTPROF_TEST_VM_SOCKETS=2\n");
    for (name, exe) in tests {
        files.insert(exe.clone());
        for test in list_tests(exe)?.into_iter().filter(|t| wanted(name, t)) {
            script.push_str(&format!("run_one {name} '{test}' {}\n", exe.display()));
            runs.push((name.clone(), test));
        }
    }
    script.push_str(INIT_TAIL);
    // As PID 1 the script mounts, then runs the tests itself, or (systemd)
    // hands over to systemd, whose test unit runs `/init tests`.
    let script = if group.systemd {
        files.extend(SYSTEMD_FILES.iter().map(PathBuf::from));
        format!(
            "#!/bin/busybox sh\nif [ \"$1\" = tests ]; then\n{script}exit 0\nfi\n{INIT_MOUNTS}\
             exec /usr/lib/systemd/systemd --unit=slotprof-vm.target --show-status=false\n"
        )
    } else {
        format!("#!/bin/busybox sh\n{INIT_MOUNTS}{script}")
    };
    let mut libs = BTreeSet::new();
    for f in &files {
        libs.extend(shared_libraries(f)?);
    }
    let mut cpio = Cpio::create(out)?;
    for dir in ["bin", "dev", "proc", "sys", "tmp", "run", "root", "etc", "var"] {
        cpio.dir(Path::new(dir))?;
    }
    cpio.file(Path::new("bin/busybox"), busybox, 0o755)?;
    cpio.bytes(Path::new("init"), script.as_bytes(), 0o755)?;
    if group.systemd {
        systemd_units(&mut cpio)?;
    }
    for f in files.iter().chain(&libs) {
        cpio.file(f.strip_prefix("/").unwrap_or(f), f, 0o755)?;
    }
    cpio.finish()?;
    Ok(runs)
}

/// What systemd as PID 1 needs from the host (its libraries come by ldd).
const SYSTEMD_FILES: &[&str] = &["/usr/lib/systemd/systemd", "/usr/bin/systemctl"];

/// The units and files of the systemd boot: the host's own targets (the
/// packaged unit's default dependencies name sysinit.target, basic.target
/// and shutdown.target), a target that starts the tests' unit, that unit
/// (`/init tests`, on the serial console), and the identity files systemd
/// reads.
fn systemd_units(cpio: &mut Cpio) -> anyhow::Result<()> {
    let system = Path::new("/usr/lib/systemd/system");
    for e in std::fs::read_dir(system).with_context(|| format!("read {}", system.display()))? {
        let p = e?.path();
        let is_target = p.extension().is_some_and(|x| x == "target");
        if is_target && p.is_file() && !p.is_symlink() {
            cpio.file(p.strip_prefix("/").unwrap(), &p, 0o644)?;
        }
    }
    let etc = Path::new("etc/systemd/system");
    cpio.bytes(
        &etc.join("slotprof-vm.target"),
        b"[Unit]\nDescription=slotprof's tests under systemd\nRequires=basic.target\n\
          Wants=slotprof-vm-tests.service\nAfter=basic.target\n",
        0o644,
    )?;
    cpio.bytes(
        &etc.join("slotprof-vm-tests.service"),
        b"[Unit]\nDescription=slotprof's tests\nAfter=basic.target\n\
          [Service]\nType=oneshot\nExecStart=/init tests\nStandardOutput=tty\n\
          StandardError=tty\nTTYPath=/dev/ttyS0\nLimitMEMLOCK=infinity\nTimeoutStartSec=infinity\n",
        0o644,
    )?;
    cpio.bytes(
        Path::new("etc/passwd"),
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        0o644,
    )?;
    cpio.bytes(Path::new("etc/group"), b"root:x:0:\nnogroup:x:65534:\n", 0o644)?;
    cpio.bytes(
        Path::new("etc/os-release"),
        b"NAME=\"slotprof test VM\"\nID=slotprof-vm\n",
        0o644,
    )?;
    cpio.bytes(Path::new("etc/machine-id"), b"", 0o444)?;
    Ok(())
}

/// The shared libraries `exe` loads (and the loader), from ldd.
fn shared_libraries(exe: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(exe).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rhs)) => rhs.trim().split(' ').next()?,
                None => l.split(' ').next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// A cpio "newc" archive, the format the kernel unpacks as its initramfs.
struct Cpio {
    w: std::io::BufWriter<std::fs::File>,
    ino: u32,
    dirs: BTreeSet<PathBuf>,
}

impl Cpio {
    fn create(path: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            w: std::io::BufWriter::new(std::fs::File::create(path)?),
            ino: 1,
            dirs: BTreeSet::new(),
        })
    }

    fn header(&mut self, name: &Path, mode: u32, size: usize) -> anyhow::Result<()> {
        let name = name.to_str().context("non-UTF-8 path")?;
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            size as u32,
            0,
            0,
            0,
            0,
            name.len() as u32 + 1,
            0,
        ];
        let mut h = String::from("070701");
        for f in fields {
            h.push_str(&format!("{f:08x}"));
        }
        self.w.write_all(h.as_bytes())?;
        self.w.write_all(name.as_bytes())?;
        self.w.write_all(&[0])?;
        self.pad(110 + name.len() + 1)
    }

    fn pad(&mut self, len: usize) -> anyhow::Result<()> {
        let n = (4 - len % 4) % 4;
        self.w.write_all(&[0u8; 3][..n])?;
        Ok(())
    }

    fn dir(&mut self, path: &Path) -> anyhow::Result<()> {
        if path.as_os_str().is_empty() || self.dirs.contains(path) {
            return Ok(());
        }
        if let Some(parent) = path.parent() {
            self.dir(parent)?;
        }
        self.dirs.insert(path.to_path_buf());
        self.header(path, 0o040755, 0)
    }

    fn bytes(&mut self, path: &Path, data: &[u8], perm: u32) -> anyhow::Result<()> {
        if let Some(parent) = path.parent() {
            self.dir(parent)?;
        }
        self.header(path, 0o100000 | perm, data.len())?;
        self.w.write_all(data)?;
        self.pad(data.len())
    }

    fn file(&mut self, path: &Path, from: &Path, perm: u32) -> anyhow::Result<()> {
        let data = std::fs::read(from).with_context(|| format!("cannot read {}", from.display()))?;
        self.bytes(path, &data, perm)
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.header(Path::new("TRAILER!!!"), 0, 0)?;
        self.w.flush()?;
        Ok(())
    }
}

/// The guest's first steps as PID 1: the file systems the tests need.
const INIT_MOUNTS: &str = r#"/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin:/sbin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# /tmp stays on the initramfs itself (writable): a tmpfs over it would
# hide the binaries of a workspace that lives under /tmp.
mount -t tracefs nodev /sys/kernel/tracing
mount -t debugfs nodev /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf
ip link set lo up
ulimit -l unlimited
# A lockup reports every CPU's stack, not only the one that noticed.
echo 1 > /proc/sys/kernel/softlockup_all_cpu_backtrace 2>/dev/null
echo 1 > /proc/sys/kernel/softlockup_panic 2>/dev/null || true
"#;

/// Before the tests: what the host reads first, and the helpers that run
/// each test under its time limit.
const INIT_HEAD: &str = r#"export PATH=/bin:/usr/bin:/sbin:/usr/sbin
echo "SLOTPROF-VM-BEGIN $(uname -r)"
for c in /sys/devices/system/cpu/cpu[0-9]*; do
  echo "SLOTPROF-VM-L3 ${c##*/} $(cat $c/cache/index3/shared_cpu_list 2>/dev/null || echo none)"
done
# A test that outlives TEST_LIMIT seconds is hung: every user task's state,
# wait channel and kernel stack go to the console, then it is killed.
dump_tasks() {
  for t in /proc/[0-9]*/task/[0-9]*; do
    [ -n "$(head -c 1 ${t%/task/*}/cmdline 2>/dev/null)" ] || continue
    echo "SLOTPROF-TASK ${t#/proc/} $(cat $t/comm) $(cut -d' ' -f3 $t/stat) wchan=$(cat $t/wchan)"
    sed 's/^/SLOTPROF-TASK   /' $t/stack
  done
  echo w > /proc/sysrq-trigger
}
run_one() {
  echo "SLOTPROF-TEST-BEGIN $1 $2"
  "$3" --exact "$2" --include-ignored --nocapture --test-threads=1 2>&1 &
  pid=$!
  n=0
  while kill -0 $pid 2>/dev/null && [ $n -lt $TEST_LIMIT ]; do
    sleep 1
    n=$((n + 1))
  done
  if kill -0 $pid 2>/dev/null; then
    echo "SLOTPROF-TEST-HUNG still running after $n s (every task's kernel stack follows)"
    dump_tasks
    kill -9 -1
  fi
  wait $pid
  echo "SLOTPROF-TEST-END $1 $2 rc=$?"
}
"#;

const INIT_TAIL: &str = r#"echo "SLOTPROF-VM-END"
poweroff -f
"#;

/// Boots one VM and reads the results off its console.
fn boot(
    kernel: &Kernel,
    initramfs: &Path,
    line: &str,
    group: &Group,
    cache: &Path,
) -> anyhow::Result<BTreeMap<(String, String), (Outcome, String)>> {
    let log_path = cache.join(format!("console-{line}-{}.log", group.name));
    let mut log = std::fs::File::create(&log_path)?;
    let kvm = cpu_has_virtualization();
    let accel = match (kvm, group.precise_ip) {
        (true, _) => vec!["-accel", "kvm"],
        (false, true) => precise_ip_accel(),
        // One host thread for both vCPUs (no MTTCG): the kernel patches
        // its own code live when probes attach (static keys, static calls:
        // int3, then the new bytes), and with a thread per vCPU the other
        // vCPU ran stale translated code through it: int3 oopses in
        // syscall_trace_enter / syscall_exit_to_user_mode_prepare on 6.12
        // and a two-CPU soft lockup on 6.1, each in about one boot of four.
        (false, false) => vec!["-accel", "tcg,thread=single"],
    };
    eprintln!(
        "xtask: booting {} under QEMU ({}, 2 CPUs in two sockets) for {}; console in {}",
        kernel.release,
        accel[1..].join(" "),
        group.scenarios.join(", "),
        log_path.display()
    );
    let mut child = Command::new("qemu-system-x86_64")
        .args(&accel)
        .args(["-m", "3G", "-smp", "2,sockets=2,cores=1,threads=1", "-cpu", "max"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(initramfs)
        .args([
            "-append",
            "console=ttyS0 panic=-1 loglevel=4 rdinit=/init",
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start qemu-system-x86_64")?;
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + group.vm_limit;
    let mut results = BTreeMap::new();
    let mut current: Option<(String, String, Vec<String>)> = None;
    let mut trouble = None;
    // After the first trouble line: until when to keep reading (the
    // kernel's traces follow it), and how many more lines to echo.
    let mut trouble_until: Option<Instant> = None;
    let mut echo_left = 0usize;
    let mut began = false;
    let mut ended = false;
    loop {
        if trouble_until.is_some_and(|t| Instant::now() >= t) {
            eprintln!(
                "xtask: [{line}] VM stopped {} s after the kernel's first trouble report",
                TROUBLE_GRACE.as_secs()
            );
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            trouble.get_or_insert_with(|| format!("time limit of {} s", group.vm_limit.as_secs()));
            break;
        }
        let l = match rx.recv_timeout(left.min(Duration::from_secs(1))) {
            Ok(l) => l,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let l = l.trim_end_matches('\r').to_string();
        let _ = writeln!(log, "{l}");
        if let Some(t) = KERNEL_TROUBLE.iter().find(|t| l.contains(*t)) {
            eprintln!("xtask: [{line}] {l}");
            if trouble.is_none() {
                trouble = Some(format!("kernel trouble on the console: {t}"));
                // The report's registers and call traces, for CI's log:
                // that is all a failed run leaves behind.
                echo_left = TROUBLE_ECHO_LINES;
                trouble_until = Some(Instant::now() + TROUBLE_GRACE);
            }
        } else if echo_left > 0 {
            echo_left -= 1;
            eprintln!("xtask: [{line}] | {l}");
        }
        // The BIOS leaves no newline before the kernel's first output.
        if let Some(rest) = l.find("SLOTPROF-VM-BEGIN ").map(|i| &l[i + 18..]) {
            began = true;
            eprintln!("xtask: [{line}] booted {rest}");
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-VM-L3 ") {
            eprintln!("xtask: [{line}] L3 of {rest}");
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-TEST-BEGIN ") {
            let (bin, test) = rest.split_once(' ').unwrap_or((rest, ""));
            current = Some((bin.to_string(), test.to_string(), Vec::new()));
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-TEST-END ") {
            if let Some((bin, test, output)) = current.take() {
                let ok = rest.ends_with(" rc=0");
                let (outcome, note) = judge(ok, &output);
                eprintln!("xtask: [{line}] {bin}::{test}: {} {note}", outcome.word());
                results.insert((bin, test), (outcome, note));
            }
        } else if l == "SLOTPROF-VM-END" {
            ended = true;
        } else if let Some((_, _, output)) = current.as_mut() {
            output.push(l);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    if let Some(t) = trouble {
        bail!("{t} (console: {})", log_path.display());
    }
    if !began {
        bail!("the VM never reached its init (console: {})", log_path.display());
    }
    if !ended {
        bail!(
            "the VM stopped before its last test (console: {})",
            log_path.display()
        );
    }
    Ok(results)
}

/// A test's outcome from its exit status and what it printed.
fn judge(ok: bool, output: &[String]) -> (Outcome, String) {
    let said = |prefix: &str| {
        output
            .iter()
            .find_map(|l| l.find(prefix).map(|i| l[i + prefix.len()..].trim().to_string()))
    };
    if let Some(why) = said("SLOTPROF-TEST-HUNG") {
        return (
            Outcome::Fail,
            format!("hung: {why}; task stacks in the console log"),
        );
    }
    if !ok {
        let why = output
            .iter()
            .find(|l| l.contains("panicked at") || l.contains("assertion"))
            .or_else(|| output.iter().rev().find(|l| !l.trim().is_empty()))
            .cloned()
            .unwrap_or_default();
        return (Outcome::Fail, why);
    }
    if let Some(why) = said("UNSUPPORTED:") {
        return (Outcome::Unsupported, format!("unsupported on this kernel: {why}"));
    }
    if let Some(why) = said("SKIPPED:") {
        return (Outcome::Skipped, why);
    }
    let missing: Vec<String> = output
        .iter()
        .filter_map(|l| l.split_once("NOT ON THIS KERNEL: "))
        .filter_map(|(_, rest)| rest.split_whitespace().next().map(str::to_string))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if missing.is_empty() {
        (Outcome::Pass, String::new())
    } else {
        (
            Outcome::Pass,
            format!("without {} (not in this kernel)", missing.join(", ")),
        )
    }
}

/// TCG with one instruction per translation block (the switch was renamed in 8.1).
fn precise_ip_accel() -> Vec<&'static str> {
    let version = output(Command::new("qemu-system-x86_64").arg("--version")).unwrap_or_default();
    let (major, minor) = version
        .split_whitespace()
        .nth(3)
        .and_then(|v| {
            let mut it = v.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
            Some((it.next()?, it.next()?))
        })
        .unwrap_or((0, 0));
    if (major, minor) >= (8, 1) {
        vec!["-accel", "tcg,one-insn-per-tb=on,thread=single"]
    } else {
        vec!["-accel", "tcg,thread=single", "-singlestep"]
    }
}

/// Whether this CPU can run KVM guests with hardware virtualization (only
/// then is -accel kvm used; this machine's paravirtual KVM is not enough).
fn cpu_has_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| {
        c.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    })
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
