//! Kernel modules from a kernel's package for a test VM's initramfs: the
//! modules asked for, each after the modules it depends on, none that the
//! kernel has built in (Debian's 6.1 cloud kernel has virtio itself as
//! modules, 6.12's builds it in).

use std::path::Path;

use anyhow::Context;

/// A module to load: its name and its (decompressed) bytes.
#[derive(Clone)]
pub(super) struct Module {
    pub(super) name: String,
    pub(super) bytes: Vec<u8>,
}

/// The modules `wanted` needs under `modules_dir` (`lib/modules/RELEASE`),
/// in an order `insmod` can load them.
pub(super) fn load_order(modules_dir: &Path, wanted: &[&str]) -> anyhow::Result<Vec<Module>> {
    let read =
        |f: &str| std::fs::read_to_string(modules_dir.join(f)).with_context(|| format!("cannot read {f}"));
    let builtin: Vec<String> = read("modules.builtin")?.lines().map(module_name).collect();
    let order: Vec<String> = read("modules.order")?.lines().map(str::to_string).collect();
    let mut out: Vec<Module> = Vec::new();
    for name in wanted {
        add(modules_dir, &builtin, &order, &module_name(name), &mut out, 0)?;
    }
    Ok(out)
}

fn add(
    dir: &Path,
    builtin: &[String],
    order: &[String],
    name: &str,
    out: &mut Vec<Module>,
    depth: usize,
) -> anyhow::Result<()> {
    anyhow::ensure!(depth < 16, "module dependencies nested too deep at {name}");
    if builtin.iter().any(|b| b == name) || out.iter().any(|m| m.name == name) {
        return Ok(());
    }
    let path = order
        .iter()
        .find(|p| module_name(p) == name)
        .with_context(|| format!("module {name} is neither built in nor in modules.order"))?;
    let bytes = read_module(&dir.join(path))?;
    for dep in depends(&bytes) {
        add(dir, builtin, order, &dep, out, depth + 1)?;
    }
    out.push(Module {
        name: name.to_string(),
        bytes,
    });
    Ok(())
}

/// `kernel/drivers/virtio/virtio-ring.ko[.xz]` -> `virtio_ring`.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// A module file as listed (`.ko`), or its compressed form.
fn read_module(ko: &Path) -> anyhow::Result<Vec<u8>> {
    if ko.is_file() {
        return std::fs::read(ko).with_context(|| format!("cannot read {}", ko.display()));
    }
    let xz = ko.with_extension("ko.xz");
    let out = std::process::Command::new("xz")
        .arg("-dc")
        .arg(&xz)
        .output()
        .with_context(|| format!("cannot run xz on {}", xz.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "xz -dc {}: {}",
        xz.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(out.stdout)
}

/// The `depends=` of a module's `.modinfo` (NUL-separated `key=value`).
fn depends(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|&b| b == 0)
        .find_map(|s| s.strip_prefix(b"depends="))
        .map(|d| {
            String::from_utf8_lossy(d)
                .split(',')
                .filter(|s| !s.is_empty())
                .map(module_name)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_dependencies() {
        assert_eq!(module_name("kernel/drivers/virtio/virtio_ring.ko"), "virtio_ring");
        assert_eq!(module_name("kernel/drivers/block/virtio-blk.ko.xz"), "virtio_blk");
        let info = b"\x7fELF...\0license=GPL\0depends=virtio,virtio_ring\0intree=Y\0";
        assert_eq!(depends(info), ["virtio", "virtio_ring"]);
        assert!(depends(b"\0depends=\0name=x\0").is_empty());
        assert!(depends(b"no modinfo").is_empty());
    }

    #[test]
    fn dependencies_come_first_and_builtins_are_skipped() {
        let dir = crate::private_temp_dir("xtask-modules").unwrap();
        let d = dir.join("kernel/drivers");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("a.ko"), b"\0depends=b,c\0").unwrap();
        std::fs::write(d.join("b.ko"), b"\0depends=c\0").unwrap();
        std::fs::write(d.join("c.ko"), b"\0depends=\0").unwrap();
        std::fs::write(
            dir.join("modules.order"),
            "kernel/drivers/a.ko\nkernel/drivers/b.ko\nkernel/drivers/c.ko\n",
        )
        .unwrap();
        std::fs::write(dir.join("modules.builtin"), "kernel/drivers/x.ko\n").unwrap();
        let names = |w: &[&str]| -> Vec<String> {
            load_order(&dir, w).unwrap().into_iter().map(|m| m.name).collect()
        };
        assert_eq!(names(&["x", "a"]), ["c", "b", "a"]);
        std::fs::write(dir.join("modules.builtin"), "kernel/drivers/c.ko\n").unwrap();
        assert_eq!(names(&["a"]), ["b", "a"]);
        assert!(load_order(&dir, &["missing"]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
