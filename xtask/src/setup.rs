//! Makes a fresh machine able to build slotprof: the pinned toolchain's
//! components and bpf-linker, installed into the gitignored `.tools/`.
//!
//! bpf-linker must use the same LLVM major as rustc; we link it against
//! rustc's own libLLVM (no apt LLVM needed).

use std::{path::Path, process::Command};

use anyhow::{bail, Context};

/// The toolchain pinned in rust-toolchain.toml.
const TOOLCHAIN: &str = "1.95.0";
const BPF_LINKER_VERSION: &str = "0.13.0";
/// The LLVM major of TOOLCHAIN's rustc.
const LLVM_FEATURE: &str = "llvm-22";

pub fn run(root: &Path) -> anyhow::Result<()> {
    components(root)?;
    bpf_linker(root)
}

/// What the tests need beyond the build: headless Chromium (index.html is
/// checked in a real browser), perf and Go (`go tool pprof`). Installed with apt when missing and root;
/// otherwise the tests that need it say they were skipped.
pub fn test_tools(root: &Path) -> anyhow::Result<()> {
    // Chromium opens the HTML report; perf is the unwinding tests' reference
    // (perf record --call-graph dwarf on the same run), natively and in the
    // test VMs (which get the host's perf); Go's `go tool pprof` reads every
    // pprof profile slotprof writes, and google/pprof (Debian ships its
    // source) symbolizes one by its mappings and build IDs, which Go's
    // bundled pprof does not (it has no build IDs and symbolizes Go
    // binaries only).
    let missing: Vec<&str> = [
        ("/usr/bin/chromium", "chromium"),
        ("/usr/bin/perf", "linux-perf"),
        ("/usr/bin/go", "golang-go"),
        (PPROF_SOURCE, "golang-github-google-pprof-dev"),
    ]
    .iter()
    .filter(|(bin, _)| !Path::new(bin).exists())
    .map(|(_, package)| *package)
    .collect();
    if !missing.is_empty() {
        if !crate::is_root() {
            eprintln!(
                "xtask: not root, cannot install {}: the tests that need them will be skipped",
                missing.join(", ")
            );
            return Ok(());
        }
        let env = [("DEBIAN_FRONTEND", "noninteractive")];
        let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
        args.extend(&missing);
        let ok = crate::run_env(root, "apt-get", &["update", "-qq"], &env)
            .and_then(|_| crate::run_env(root, "apt-get", &args, &env));
        if let Err(e) = ok {
            eprintln!(
                "xtask: could not install {} ({e:#}): the tests that need them will be skipped",
                missing.join(", ")
            );
        }
    }
    if let Err(e) = google_pprof(root) {
        eprintln!("xtask: could not build google/pprof ({e:#}): the test that needs it will be skipped");
    }
    if let Err(e) = otlp_python(root) {
        eprintln!(
            "xtask: could not install the OpenTelemetry proto package for Python ({e:#}): the push tests \
             will not decode OTLP a second, independent way"
        );
    }
    Ok(())
}

/// The OpenTelemetry proto package as published for Python (PyPI's
/// `opentelemetry-proto`, with Google's protobuf runtime) in a private
/// virtual environment, `.tools/otlp-venv`: the push tests decode what an
/// OTLP receiver got with it too, independently of the Rust messages
/// slotprof encodes with. Pinned: the profiles schema is still changing.
fn otlp_python(root: &Path) -> anyhow::Result<()> {
    let venv = root.join(".tools/otlp-venv");
    if venv.join("bin/python").exists() {
        return Ok(());
    }
    let venv_str = venv.to_str().context("a non-UTF-8 path")?;
    crate::run(root, "python3", &["-m", "venv", venv_str])?;
    let pip = venv.join("bin/pip");
    let installed = crate::run(
        root,
        pip.to_str().context("a non-UTF-8 path")?,
        &["install", "-q", "protobuf==7.36.2", "opentelemetry-proto==1.45.2"],
    );
    if installed.is_err() {
        // Half an environment would be taken for a whole one next time.
        let _ = std::fs::remove_dir_all(&venv);
    }
    installed
}

/// Where Debian's golang-github-google-pprof-dev puts pprof's source.
const PPROF_SOURCE: &str = "/usr/share/gocode/src/github.com/google/pprof";

/// google/pprof built from Debian's source package into `.tools/bin/pprof`
/// (offline: its dependencies are Debian packages in the same GOPATH).
fn google_pprof(root: &Path) -> anyhow::Result<()> {
    let out = root.join(".tools/bin/pprof");
    if out.exists() || !Path::new(PPROF_SOURCE).exists() || !Path::new("/usr/bin/go").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(root.join(".tools/bin"))?;
    // Go wants a writable cache; a private one, removed after.
    let cache = crate::private_temp_dir("slotprof-go-cache")?;
    let status = std::process::Command::new("/usr/bin/go")
        .args(["build", "-o"])
        .arg(&out)
        .arg("github.com/google/pprof")
        .env("GO111MODULE", "off")
        .env("GOPATH", "/usr/share/gocode")
        .env("GOCACHE", &cache)
        .env("HOME", &cache)
        .status();
    let _ = std::fs::remove_dir_all(&cache);
    let status = status?;
    anyhow::ensure!(status.success(), "go build github.com/google/pprof: {status}");
    Ok(())
}

fn components(root: &Path) -> anyhow::Result<()> {
    let sysroot = sysroot()?;
    let have_src = Path::new(&sysroot)
        .join("lib/rustlib/src/rust/library/core")
        .is_dir();
    if have_src {
        return Ok(());
    }
    crate::run(
        root,
        "rustup",
        &[
            "component",
            "add",
            "rust-src",
            "clippy",
            "rustfmt",
            "--toolchain",
            TOOLCHAIN,
        ],
    )
}

fn sysroot() -> anyhow::Result<String> {
    let out = Command::new("rustup")
        .args(["run", TOOLCHAIN, "rustc", "--print", "sysroot"])
        .output()
        .with_context(|| format!("cannot run rustc {TOOLCHAIN}: is rustup installed?"))?;
    if !out.status.success() {
        // Not installed at all: install it, then ask again.
        crate::run(
            Path::new("."),
            "rustup",
            &[
                "toolchain",
                "install",
                TOOLCHAIN,
                "--profile",
                "minimal",
                "--component",
                "rust-src,clippy,rustfmt",
            ],
        )?;
        return sysroot();
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

fn bpf_linker(root: &Path) -> anyhow::Result<()> {
    let tools = root.join(".tools");
    let linker = tools.join("bin/bpf-linker");
    let works = Command::new(&linker)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if works {
        return Ok(());
    }
    eprintln!("xtask: installing bpf-linker {BPF_LINKER_VERSION} into .tools/ (1-2 minutes, once)");
    // A prefix whose lib/libLLVM.so is rustc's own libLLVM.
    let sysroot = sysroot()?;
    let llvm_lib = std::fs::read_dir(Path::new(&sysroot).join("lib"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("libLLVM.so.") || (n.starts_with("libLLVM-") && n.ends_with(".so"))
            })
        })
        .with_context(|| format!("no libLLVM in {sysroot}/lib: reinstall toolchain {TOOLCHAIN}"))?;
    let prefix = tools.join("llvm");
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&llvm_lib, &link)?;
    let status = Command::new("rustup")
        .args(["run", TOOLCHAIN, "cargo", "install", "bpf-linker"])
        .args([
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--no-default-features",
        ])
        .args(["--features", LLVM_FEATURE, "--root"])
        .arg(&tools)
        .env("LLVM_PREFIX", &prefix)
        .current_dir(root)
        .status()
        .context("cannot run cargo install")?;
    if !status.success() {
        bail!("installing bpf-linker failed ({status}); see the cargo output above");
    }
    Ok(())
}
