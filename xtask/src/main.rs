//! `cargo xtask`: everything that is not plain cargo.
//!
//! - `cargo xtask setup`: toolchain components and bpf-linker (into .tools/).
//! - `cargo xtask demo`:  set up, build, profile a synthetic workload into ./slotprof-demo/.
//! - `cargo xtask test [--full] [FILTER]`: set up, build, fmt + clippy, the tests of a tier
//!   (root tests when root; see [`Tier`]); with FILTER only the host tests whose name
//!   contains it (`BINARY::NAME`, as the table writes a test, runs only that test executable).
//! - `cargo xtask test-vm [--kernel 6.1]... [--ci]`: e2e tests in QEMU on Debian kernels
//!   (every group; `--ci` only the CI tier's).
//! - `cargo xtask bench`: set up, build, measure overhead; rewrites BENCHMARKS.md.
//! - `cargo xtask fuzz [--seconds N] [TARGET...]`: coverage-guided fuzzing (10 min a target).
//! - `cargo xtask soak [--minutes N]`: `slotprof run` under random faults; BENCHMARKS.md.
//! - `cargo xtask validator [--test]`: a real Agave node to profile, or its tests.
//! - `cargo xtask record-fixtures`: the replay fixtures of tests/fixtures/replay/ (root).
//! - `cargo xtask completions` / `cargo xtask man`: build slotprof and write its shell
//!   completions (target/dist/completions/) or man pages (target/dist/man/man1/).

mod bench;
mod benchmarks_md;
mod budget;
mod fixtures;
mod fuzz;
mod outcomes;
mod setup;
mod soak;
mod test_vm;
mod validator;

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{bail, Context};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("setup") => setup::run(&root()),
        Some("build") => setup::run(&root()).and_then(|_| build(&root())),
        Some("demo") => demo(&root()),
        Some("test") => test_args(&args[1..]).and_then(|(tier, filter)| test(&root(), tier, filter)),
        Some("test-vm") => setup::run(&root())
            .and_then(|_| build(&root()))
            .and_then(|_| test_vm::run(&root(), &args[1..], Tier::Full))
            .and_then(|rows| match outcomes::print_summary(&rows) {
                0 => Ok(()),
                n => Err(anyhow::anyhow!("{n} VM scenario(s) failed")),
            }),
        Some("validator") => setup::run(&root())
            .and_then(|_| build(&root()))
            .and_then(|_| validator::run(&root(), &args[1..])),
        Some("fuzz") => fuzz::run(&root(), &args[1..]),
        Some("soak") => setup::run(&root())
            .and_then(|_| build(&root()))
            .and_then(|_| soak::run(&root(), &args[1..])),
        Some("record-fixtures") => setup::run(&root())
            .and_then(|_| build(&root()))
            .and_then(|_| fixtures::run(&root())),
        Some(what @ ("completions" | "man")) => setup::run(&root()).and_then(|_| dist(&root(), what)),
        Some("bench") => setup::run(&root())
            .and_then(|_| build(&root()))
            .and_then(|_| bench::run(&root(), &args[1..])),
        _ => {
            eprintln!(
                "usage: cargo xtask <setup|build|demo|test [--full] [FILTER]|test-vm [--kernel 6.1]... [--ci]|bench [--only SECTION] [--run-minutes N]|validator [--load N | --test]|fuzz [--seconds N] [TARGET...]|soak [--minutes N] [--seed S]|record-fixtures|completions|man>"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs a command in the workspace, failing with its name when it fails.
pub fn run(root: &Path, program: &str, args: &[&str]) -> anyhow::Result<()> {
    run_env(root, program, args, &[])
}

/// [`run`] with extra environment variables.
pub fn run_env(root: &Path, program: &str, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<()> {
    eprintln!("xtask: $ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root)
        .status()
        .with_context(|| format!("cannot run {program}"))?;
    if !status.success() {
        bail!("`{program} {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

/// `cargo xtask completions` / `man`: slotprof built, then asked for its
/// shell completions (bash, zsh, fish) or its man pages, under target/dist/.
fn dist(root: &Path, what: &str) -> anyhow::Result<()> {
    run(
        root,
        "cargo",
        &["build", "--release", "--package", "profiler", "--bin", "slotprof"],
    )?;
    let slotprof = root.join("target/release/slotprof");
    let out = root.join("target/dist");
    if what == "man" {
        let dir = out.join("man/man1");
        run(
            root,
            &slotprof.display().to_string(),
            &["man", &dir.display().to_string()],
        )?;
        eprintln!(
            "xtask: man pages in {} (install: cp {}/*.1 /usr/local/share/man/man1/)",
            dir.display(),
            dir.display()
        );
        return Ok(());
    }
    let dir = out.join("completions");
    std::fs::create_dir_all(&dir)?;
    for (shell, file) in [
        ("bash", "slotprof"),
        ("zsh", "_slotprof"),
        ("fish", "slotprof.fish"),
    ] {
        let o = Command::new(&slotprof)
            .args(["completions", shell])
            .output()
            .with_context(|| format!("cannot run {}", slotprof.display()))?;
        if !o.status.success() {
            bail!(
                "slotprof completions {shell}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::fs::write(dir.join(file), &o.stdout)?;
    }
    eprintln!(
        "xtask: completions in {} (bash: /usr/share/bash-completion/completions/slotprof; zsh: a directory of $fpath as _slotprof; fish: ~/.config/fish/completions/)",
        dir.display()
    );
    Ok(())
}

fn build(root: &Path) -> anyhow::Result<()> {
    run(root, "cargo", &["build", "--release", "--workspace", "--bins"])?;
    // The stall programs again as a plain `cargo build --release` makes
    // them (and as real validators are): no frame pointers in our code,
    // jemalloc built with the C compiler's defaults (-O2 omits them).
    run_env(
        root,
        "cargo",
        &[
            "build",
            "--release",
            "--package",
            "slotprof-tests",
            "--bins",
            "--target-dir",
            "target/nofp",
        ],
        // RUSTFLAGS replaces .cargo/config.toml's target rustflags (a
        // CARGO_TARGET_*_RUSTFLAGS variable would be added to them).
        &[("RUSTFLAGS", "-C force-frame-pointers=no"), ("CFLAGS", "-O2")],
    )?;
    build_c_programs(root)
}

/// Compiles the C stall programs (`tests/c/NAME.c`, flags on their first
/// line as `// cflags: ...`) into `target/c/NAME`, where the tests and the
/// test VMs (which have no compiler) find them.
fn build_c_programs(root: &Path) -> anyhow::Result<()> {
    let out = root.join("target/c");
    std::fs::create_dir_all(&out)?;
    let mut sources: Vec<_> = std::fs::read_dir(root.join("tests/c"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "c"))
        .collect();
    sources.sort();
    for src in sources {
        let text = std::fs::read_to_string(&src)?;
        let flags = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("// cflags:"))
            .with_context(|| format!("{}: the first line must be `// cflags: ...`", src.display()))?;
        let name = src.file_stem().unwrap().to_string_lossy().into_owned();
        let mut args: Vec<String> = flags.split_whitespace().map(str::to_string).collect();
        args.extend([
            "-o".into(),
            out.join(&name).display().to_string(),
            src.display().to_string(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(root, "cc", &args)?;
    }
    Ok(())
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no failure mode.
    unsafe { geteuid() == 0 }
}

extern "C" {
    fn geteuid() -> u32;
}

/// Profiles the built-in workload (a hot function and a blocking call)
/// with `slotprof attach` and leaves the outputs in ./slotprof-demo/.
fn demo(root: &Path) -> anyhow::Result<()> {
    setup::run(root)?;
    // Only what it runs: slotprof and one stall program (the tests' whole
    // build, with its second no-frame-pointer copy and the C programs,
    // doubled the demo's time on a fresh machine).
    run(
        root,
        "cargo",
        &[
            "build",
            "--release",
            "--package",
            "profiler",
            "--package",
            "slotprof-tests",
            "--bin",
            "slotprof",
            "--bin",
            "stall-spin-sleep",
        ],
    )?;
    let bin = root.join("target/release");
    let out = root.join("slotprof-demo");
    let mut workload = Command::new(bin.join("stall-spin-sleep"))
        .args(["--seconds", "12", "--report"])
        .arg(out.join("workload.json"))
        .spawn()
        .context("cannot start the demo workload")?;
    std::fs::create_dir_all(&out)?;
    if !is_root() {
        eprintln!("xtask: slotprof needs root (or CAP_BPF + CAP_PERFMON); expect it to say so");
    }
    let status = Command::new(bin.join("slotprof"))
        .args([
            "attach",
            "--pid",
            &workload.id().to_string(),
            "--duration",
            "10s",
            "--slot-source",
            "clock=400ms,leader=4/8",
            "--out",
        ])
        .arg(&out)
        .status();
    let _ = workload.wait();
    if !status.context("cannot run slotprof")?.success() {
        bail!("slotprof failed (see above)");
    }
    println!("\nThe demo workload (stall-spin-sleep) spun in `hot_spin` and slept in `blocking_sleep`.");
    println!("Its profile is in {}/:", out.display());
    println!("  oncpu.svg, offcpu.svg     flamegraphs: open in a browser");
    println!("  oncpu.folded, offcpu.folded  folded stacks (inferno, flamegraph.pl, speedscope)");
    println!(
        "  profile.pb.gz             pprof: `go tool pprof -http=: {}/profile.pb.gz`",
        out.display()
    );
    println!("  index.html                every 400 ms slot (a fixed clock here), sortable, with links");
    println!("  slots/<n>/, windows/<n>/  the same profiles per slot and per 4-slot leader window");
    println!("  trace.json                threads and slots on a timeline: open in https://ui.perfetto.dev");
    println!("  findings.json             what the detectors found");
    println!("  summary.json              counts, lost events, probes, frame-pointer check");
    println!("  workload.json             what the workload itself says it did");
    Ok(())
}

/// What `cargo xtask test` runs. Both tiers end with the same table and
/// closing line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// What `.ci/run` runs, inside 45 minutes of a clean clone: set-up,
    /// build, fmt + clippy, the unit and replay tests, every native
    /// end-to-end test under the real probes (each detector with its
    /// precision checks and fixed twin, the short real-node set), and in
    /// each test VM what differs between kernels (every program loads,
    /// passes the verifier and attaches; one short session per probe
    /// family), plus the packaged unit under systemd.
    Ci,
    /// `--full`: the CI tier and the detector matrix in both test VMs, the
    /// cache-line group one instruction per block, the fuzz smoke runs
    /// and, with the validator's binary here, the long real-node checks.
    Full,
}

/// `[--full] [FILTER]`, in either order.
fn test_args(args: &[String]) -> anyhow::Result<(Tier, Option<&str>)> {
    let mut tier = Tier::Ci;
    let mut filter = None;
    for a in args {
        match a.as_str() {
            "--full" => tier = Tier::Full,
            f if f.starts_with("--") => {
                bail!("unknown option {f}: usage: cargo xtask test [--full] [FILTER]")
            }
            f if filter.is_none() => filter = Some(f),
            f => bail!(
                "one FILTER only (got {f:?} after {:?})",
                filter.unwrap_or_default()
            ),
        }
    }
    Ok((tier, filter))
}

/// `cargo xtask test [--full] [FILTER]`: a tier (see [`Tier`]), or (with
/// FILTER) only the host tests whose name contains FILTER, as libtest
/// filters them (no test VMs, no doc tests); the table and the closing
/// line either way.
fn test(root: &Path, tier: Tier, filter: Option<&str>) -> anyhow::Result<()> {
    let budget = budget::get();
    let part = std::time::Instant::now();
    setup::run(root)?;
    setup::test_tools(root)?;
    budget.took("set-up", part);
    let part = std::time::Instant::now();
    build(root)?;
    budget.took("the build", part);
    let part = std::time::Instant::now();
    run(root, "cargo", &["fmt", "--all", "--", "--check"])?;
    run(
        root,
        "cargo",
        &[
            "clippy",
            "--release",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    budget.took("fmt and clippy", part);
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let mut rows = Vec::new();
    if is_root() {
        // The real node's short checks run when its binary can be had; its
        // long ones in the full tier.
        let node = validator::binary(root)
            .map(|bin| bin.display().to_string())
            .map_err(|e| eprintln!("xtask: the real-validator tests will be SKIPPED: {e:#}"))
            .ok();
        let load = match &node {
            Some(_) => Some(validator::loadgen(root)?.display().to_string()),
            None => None,
        };
        let mut env: Vec<(&str, &str)> = node
            .iter()
            .map(|b| ("SLOTPROF_VALIDATOR", b.as_str()))
            .chain(load.iter().map(|l| ("SLOTPROF_LOADGEN", l.as_str())))
            .collect();
        if tier == Tier::Full {
            env.push(("SLOTPROF_VALIDATOR_LONG", "1"));
        }
        let part = std::time::Instant::now();
        rows.extend(outcomes::cargo_tests(
            root,
            &outcomes::Options {
                include_ignored: true,
                env: &env,
                ci,
                validator: node.is_some(),
                filter,
            },
        )?);
        budget.took("the host tests", part);
        if let Some(f) = filter {
            eprintln!("xtask: the test VMs are not run: only the host tests matching {f:?} were asked for");
            let failed = outcomes::print_summary(&rows);
            if failed > 0 {
                bail!("{failed} test(s) failed (see the table above)");
            }
            return Ok(());
        }
        if tier == Tier::Full {
            // Each fuzz target for a short while (the long runs: `cargo
            // xtask fuzz`).
            let part = std::time::Instant::now();
            rows.extend(fuzz::smoke(root));
            budget.took("the fuzz smoke runs", part);
        }
        // In QEMU on Debian's kernels: the tier's groups, each on the
        // lines it names.
        match test_vm::run(root, &[], tier) {
            Ok(vm) => rows.extend(vm),
            Err(e) => rows.push(outcomes::Row {
                place: "vm".into(),
                package: "slotprof-tests".into(),
                binary: "test-vm".into(),
                test: "(setting the VMs up)".into(),
                outcome: outcomes::Outcome::Fail,
                note: format!("{e:#}"),
            }),
        }
    } else {
        rows.extend(outcomes::cargo_tests(
            root,
            &outcomes::Options {
                include_ignored: false,
                env: &[],
                ci,
                validator: false,
                filter,
            },
        )?);
        eprintln!(
            "xtask: SKIPPED the end-to-end tests and the QEMU test VMs (they load eBPF programs \
             and install QEMU; they need root): run `sudo cargo xtask test` to include them"
        );
    }
    let failed = outcomes::print_summary(&rows);
    match tier {
        Tier::Ci => println!(
            "(the CI tier, {:.0} s; `cargo xtask test --full` adds the detector matrix in the test VMs, \
             the cache-line VMs, the fuzz smoke runs and the long real-node checks)",
            budget.elapsed().as_secs_f64()
        ),
        Tier::Full => println!("(the full tier, {:.0} s)", budget.elapsed().as_secs_f64()),
    }
    if failed > 0 {
        bail!("{failed} test(s) failed (see the table above)");
    }
    Ok(())
}

/// A new private directory under the temporary directory (mkdtemp: a
/// random name, mode 0700).
pub fn private_temp_dir(prefix: &str) -> anyhow::Result<PathBuf> {
    let template = std::env::temp_dir().join(format!("{prefix}.XXXXXX"));
    let mut bytes = std::ffi::CString::new(template.as_os_str().as_encoded_bytes())?.into_bytes_with_nul();
    // SAFETY: a NUL-terminated template that mkdtemp rewrites in place.
    if unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) }.is_null() {
        return Err(std::io::Error::last_os_error()).context("mkdtemp");
    }
    bytes.pop();
    Ok(PathBuf::from(String::from_utf8(bytes)?))
}

pub(crate) fn on_path(bin: &str) -> bool {
    which_in_path(bin).is_some()
}

/// Where `bin` is on PATH (a symlink's path, not its target's: the guest
/// gets the file's contents under the name it is called by).
pub(crate) fn which_in_path(bin: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}
