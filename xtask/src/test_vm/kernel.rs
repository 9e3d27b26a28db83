//! The Debian kernels the VMs boot: the package of a line, fetched with
//! apt, its bzImage payload decompressed to the ELF vmlinux; busybox too.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context};

/// A bootable kernel.
pub(super) struct Kernel {
    pub(super) release: String,
    pub(super) vmlinux: PathBuf,
}

/// Output of a command, or an error naming it.
pub(super) fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The package of the newest kernel of `line` (e.g. "6.1", "6.12").
pub(super) fn kernel_package(root: &Path, line: &str) -> anyhow::Result<String> {
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
pub(super) fn fetch_deb(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
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

pub(super) fn kernel_image(root: &Path, cache: &Path, line: &str) -> anyhow::Result<Kernel> {
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
pub(super) fn extract_vmlinux(bzimage: &Path, out: &Path) -> anyhow::Result<()> {
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

pub(super) fn busybox(cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = fetch_deb(cache, "busybox-static")?;
    let bin = dir.join("bin/busybox");
    anyhow::ensure!(bin.exists(), "busybox-static has no bin/busybox");
    Ok(bin)
}
