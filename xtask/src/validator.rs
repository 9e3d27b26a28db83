//! `cargo xtask validator`: the real Agave node of `../shared/validator/`.
//!
//! - `cargo xtask validator`: unpacks it (once, into ~/.cache/slotprof/),
//!   starts it on a fresh ledger in a private temporary directory, prints
//!   how to profile it, and stops and removes it on Ctrl-C.
//! - `cargo xtask validator --load N`: the same, with N transactions a
//!   second from a real Solana client (tests/loadgen: transfers, Memo and
//!   SPL Token calls).
//! - `cargo xtask validator --test [NAME]`: the real-node tests (those whose name contains NAME), long ones
//!   included (`tests/tests/validator.rs`, as root).
//!
//! `cargo xtask test` runs the short subset of those tests whenever the
//! binary can be had, and lists them as skipped, with the reason, when not.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context};

/// The published binary's name, and its sha256 once unpacked (from
/// ../shared/validator/README.md).
const NAME: &str = "solana-test-validator-4.4.0";
const SHA256: &str = "8fdd2cdc7ab1a1a56ff902c43a8e6f3e58d0fdc01e20d11601f58914044fe371";

/// Where the compressed binary is looked for: `$SLOTPROF_VALIDATOR_XZ`,
/// then `shared/validator/` next to the workspace and above it.
fn sources(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::env::var_os("SLOTPROF_VALIDATOR_XZ")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    for up in root.ancestors().skip(1).take(3) {
        out.push(up.join("shared/validator").join(format!("{NAME}.xz")));
    }
    out
}

fn cache_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/slotprof/validator")
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("cannot run sha256sum")?;
    if !out.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string())
}

/// The unpacked, checked binary; `Err` says why there is none (no
/// compressed copy on this machine, or a copy that does not check out).
pub fn binary(root: &Path) -> anyhow::Result<PathBuf> {
    let dir = cache_dir();
    let bin = dir.join(NAME);
    if bin.is_file() && sha256(&bin)? == SHA256 {
        return Ok(bin);
    }
    let Some(xz) = sources(root).into_iter().find(|p| p.is_file()) else {
        bail!(
            "no {NAME}.xz (looked in $SLOTPROF_VALIDATOR_XZ and shared/validator/ above the workspace); \
             to build it, follow ../shared/validator/README.md and point SLOTPROF_VALIDATOR_XZ at the xz of it"
        );
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Unpacked to a private name, checked, then renamed into place: a
    // partial or wrong file never has the final name.
    let part = tempfile_in(&dir, NAME)?;
    eprintln!("xtask: unpacking {} into {}", xz.display(), dir.display());
    let out = std::fs::File::create(&part)?;
    let status = Command::new("xz")
        .arg("-dc")
        .arg(&xz)
        .stdout(out)
        .status()
        .context("cannot run xz (apt-get install xz-utils)")?;
    let checked = status.success() && sha256(&part)? == SHA256;
    if !checked {
        let _ = std::fs::remove_file(&part);
        bail!(
            "{} did not unpack to the binary of ../shared/validator/README.md (sha256 {SHA256})",
            xz.display()
        );
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&part, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&part, &bin)?;
    Ok(bin)
}

/// A new file in `dir` with a random name (O_EXCL through mkstemp).
pub(crate) fn tempfile_in(dir: &Path, prefix: &str) -> anyhow::Result<PathBuf> {
    let template = dir.join(format!(".{prefix}.XXXXXX"));
    let mut bytes = std::ffi::CString::new(template.as_os_str().as_encoded_bytes())?.into_bytes_with_nul();
    // SAFETY: mkstemp rewrites the NUL-terminated template in place.
    let fd = unsafe { libc::mkstemp(bytes.as_mut_ptr().cast()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("mkstemp");
    }
    // SAFETY: the descriptor is ours and not used after this.
    unsafe { libc::close(fd) };
    bytes.pop();
    Ok(PathBuf::from(String::from_utf8(bytes)?))
}

/// The real node's client load (tests/loadgen, outside the workspace: the
/// Solana client crates), built with its lock file into target/loadgen.
pub fn loadgen(root: &Path) -> anyhow::Result<PathBuf> {
    crate::run(
        root,
        "cargo",
        &[
            "build",
            "--release",
            "--locked",
            "--manifest-path",
            "tests/loadgen/Cargo.toml",
            "--target-dir",
            "target/loadgen",
        ],
    )
    .context("the client load for the real node (tests/loadgen) did not build; it needs crates.io")?;
    Ok(root.join("target/loadgen/release/loadgen"))
}

/// `cargo xtask validator [--load TX_PER_S | --test [NAME]]`.
pub fn run(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let bin = binary(root)?;
    let node = root.join("target/release/agave-node").display().to_string();
    match args.first().map(String::as_str) {
        None => crate::run_env(
            root,
            &node,
            &[],
            &[("SLOTPROF_VALIDATOR", &bin.display().to_string())],
        ),
        Some("--load") => {
            let rate = args
                .get(1)
                .context("--load wants a rate in transactions per second, e.g. --load 100")?;
            let load = loadgen(root)?;
            crate::run_env(
                root,
                &node,
                &["--load", rate],
                &[
                    ("SLOTPROF_VALIDATOR", &bin.display().to_string()),
                    ("SLOTPROF_LOADGEN", &load.display().to_string()),
                ],
            )
        }
        Some("--test") => {
            let load = loadgen(root)?;
            if !crate::is_root() {
                bail!("the real-node tests load eBPF programs: run `sudo cargo xtask validator --test`");
            }
            let dir = crate::private_temp_dir("slotprof-validator-results")?;
            let results = dir.join("results.jsonl");
            std::fs::write(&results, "")?;
            let mut cargo_args = vec![
                "test",
                "--release",
                "-p",
                "slotprof-tests",
                "--test",
                "validator",
                "--",
                "--include-ignored",
                "--test-threads",
                "1",
                "--nocapture",
            ];
            // `--test NAME`: only the tests whose name contains NAME.
            cargo_args.extend(args.get(1).map(String::as_str));
            let outcome = crate::run_env(
                root,
                "cargo",
                &cargo_args,
                &[
                    ("SLOTPROF_VALIDATOR", &bin.display().to_string()),
                    ("SLOTPROF_LOADGEN", &load.display().to_string()),
                    ("SLOTPROF_VALIDATOR_LONG", "1"),
                    ("SLOTPROF_RESULTS", &results.display().to_string()),
                ],
            );
            let text = std::fs::read_to_string(&results).unwrap_or_default();
            let _ = std::fs::remove_dir_all(&dir);
            print_table(&text);
            outcome
        }
        Some(other) => {
            bail!(
                "unknown argument {other:?}: usage: cargo xtask validator [--load TX_PER_S | --test [NAME]]"
            )
        }
    }
}

/// The real-node checks as a table: test, check, measured, bound, verdict
/// (one JSON line each, written by the tests).
fn print_table(jsonl: &str) {
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if rows.is_empty() {
        println!("xtask: no real-node check recorded a result");
        return;
    }
    let cell = |v: &serde_json::Value| v.as_str().unwrap_or("").replace('|', "/");
    println!("\n| test | check | measured | bound | |\n|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            cell(&r["test"]),
            cell(&r["check"]),
            cell(&r["measured"]),
            cell(&r["bound"]),
            if r["ok"] == true { "ok" } else { "FAILED" }
        );
    }
    let failed = rows.iter().filter(|r| r["ok"] != true).count();
    println!("\n{} checks, {failed} failed", rows.len());
}
