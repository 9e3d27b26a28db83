//! Was a binary built with frame pointers?
//!
//! The kernel walks user stacks by following the frame-pointer chain. In a
//! binary built without frame pointers that chain is garbage after the
//! first frame, and every user stack comes out one or two frames deep. We
//! look at function prologues: with frame pointers, nearly every function
//! starts with `push %rbp; mov %rsp,%rbp` (after an optional `endbr64`).

use std::path::Path;

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

/// What the prologue scan found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramePointerScan {
    /// Functions whose first bytes could be read.
    pub functions: usize,
    /// Of those, the ones that set up a frame pointer.
    pub with_frame_pointer: usize,
}

impl FramePointerScan {
    /// Share of functions that set up a frame pointer.
    pub fn share(&self) -> f64 {
        if self.functions == 0 {
            return 0.0;
        }
        self.with_frame_pointer as f64 / self.functions as f64
    }

    /// A binary built with frame pointers still links code built without
    /// them (Rust's prebuilt std, for one), so the bar is well under half.
    pub fn has_frame_pointers(&self) -> bool {
        self.functions > 0 && self.share() >= 0.25
    }
}

/// Scans the function prologues of an x86-64 ELF file.
pub fn scan(path: &Path) -> anyhow::Result<FramePointerScan> {
    use std::os::unix::fs::FileExt;
    let data = crate::functions::read_cache(path)?;
    let file = object::File::parse(&data)?;
    let raw = std::fs::File::open(path)?;
    let mut scan = FramePointerScan {
        functions: 0,
        with_frame_pointer: 0,
    };
    let symbols: Vec<_> = if file.symbols().next().is_some() {
        file.symbols().collect()
    } else {
        file.dynamic_symbols().collect()
    };
    for sym in symbols {
        if sym.kind() != SymbolKind::Text || sym.size() < 8 {
            continue;
        }
        let Some(section) = sym.section_index().and_then(|i| file.section_by_index(i).ok()) else {
            continue;
        };
        // The prologue's 8 bytes, read alone: `data_range` would read (and
        // keep) the whole text section.
        let Some((off, len)) = section.file_range() else {
            continue;
        };
        let Some(at) = sym
            .address()
            .checked_sub(section.address())
            .filter(|d| d + 8 <= len)
        else {
            continue;
        };
        let mut bytes = [0u8; 8];
        if raw.read_exact_at(&mut bytes, off + at).is_err() {
            continue;
        }
        scan.functions += 1;
        if sets_up_frame_pointer(&bytes) {
            scan.with_frame_pointer += 1;
        }
    }
    Ok(scan)
}

fn sets_up_frame_pointer(bytes: &[u8]) -> bool {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    const PUSH_RBP_MOV_RBP_RSP: [u8; 4] = [0x55, 0x48, 0x89, 0xe5];
    let body = bytes.strip_prefix(&ENDBR64[..]).unwrap_or(bytes);
    body.starts_with(&PUSH_RBP_MOV_RBP_RSP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prologue_patterns() {
        assert!(sets_up_frame_pointer(&[0x55, 0x48, 0x89, 0xe5, 0, 0, 0, 0]));
        assert!(sets_up_frame_pointer(&[
            0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5
        ]));
        assert!(!sets_up_frame_pointer(&[0x48, 0x83, 0xec, 0x08, 0, 0, 0, 0]));
    }

    fn compile_c(dir: &Path, name: &str, flags: &[&str]) -> Option<std::path::PathBuf> {
        let src = dir.join("fp.c");
        std::fs::write(
            &src,
            "int g(int x);\n\
             __attribute__((noinline)) int f(int x) { return g(x) * 3 + 1; }\n\
             __attribute__((noinline)) int g(int x) { return x ? f(x - 1) + 2 : 0; }\n\
             __attribute__((noinline)) int h(int x) { return f(x) + g(x) + 5; }\n\
             int main(int c, char **v) { (void)v; return h(c); }\n",
        )
        .ok()?;
        let out = dir.join(name);
        let status = std::process::Command::new("cc")
            .args(flags)
            .arg("-o")
            .arg(&out)
            .arg(&src)
            .status()
            .ok()?;
        status.success().then_some(out)
    }

    #[test]
    fn tells_c_binaries_with_and_without_frame_pointers_apart() {
        let dir = std::env::temp_dir().join(format!("slotprof-fp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (Some(with), Some(without)) = (
            compile_c(&dir, "with", &["-O2", "-fno-omit-frame-pointer"]),
            compile_c(&dir, "without", &["-O2", "-fomit-frame-pointer"]),
        ) else {
            eprintln!("SKIPPED: no C compiler (cc) to build the test binaries");
            return;
        };
        let with = scan(&with).unwrap();
        let without = scan(&without).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(with.has_frame_pointers(), "{with:?}");
        assert!(!without.has_frame_pointers(), "{without:?}");
    }
}
