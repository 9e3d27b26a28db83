//! Finding a function in an ELF file by the name a person would type.
//!
//! Rust symbols are mangled and carry a hash; people type
//! `PohRecorder::set_bank`. We demangle every function symbol (without the
//! hash) and match the typed name against its trailing path components.

use std::path::Path;

use anyhow::{bail, Context};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// A function found in a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundFunction {
    /// Demangled, without hash.
    pub name: String,
    /// Offset of its first instruction in the file (what a uprobe needs).
    pub file_offset: u64,
}

/// Demangles Rust (legacy and v0) and leaves other names alone.
pub fn demangle(name: &str) -> String {
    match rustc_demangle::try_demangle(name) {
        Ok(d) => format!("{d:#}"),
        Err(_) => name.to_string(),
    }
}

/// Whether `demangled` is what `wanted` names: the same, or ending in
/// `::wanted`.
fn matches(demangled: &str, wanted: &str) -> bool {
    demangled == wanted || demangled.ends_with(&format!("::{wanted}"))
}

/// Finds the one function in `path` that `wanted` names (a mangled name, a
/// full demangled path, or its tail such as `PohRecorder::set_bank`).
pub fn find(path: &Path, wanted: &str) -> anyhow::Result<FoundFunction> {
    let data = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file =
        object::File::parse(&*data).with_context(|| format!("{} is not an ELF file", path.display()))?;
    let mut found: Vec<(String, u64)> = Vec::new();
    for sym in file.symbols().chain(file.dynamic_symbols()) {
        if sym.kind() != SymbolKind::Text || sym.address() == 0 {
            continue;
        }
        let Ok(raw) = sym.name() else { continue };
        let name = demangle(raw);
        if raw == wanted || matches(&name, wanted) {
            found.push((name, sym.address()));
        }
    }
    found.sort();
    found.dedup_by_key(|(_, addr)| *addr);
    let (name, addr) = match found.len() {
        0 => bail!(
            "no function named {wanted:?} in {}: list candidates with `nm -C {} | grep -i {}`",
            path.display(),
            path.display(),
            wanted.rsplit("::").next().unwrap_or(wanted)
        ),
        1 => found.remove(0),
        n => {
            let some: Vec<&str> = found.iter().take(5).map(|(n, _)| n.as_str()).collect();
            bail!(
                "{n} functions match {wanted:?} in {}: give more of the path; e.g. {some:?}",
                path.display()
            )
        }
    };
    let file_offset = file
        .segments()
        .find_map(|seg| {
            let (start, size) = (seg.address(), seg.size());
            let (off, fsize) = seg.file_range();
            (addr >= start && addr < start + size.min(fsize)).then(|| addr - start + off)
        })
        .with_context(|| {
            format!(
                "{name} at {addr:#x} is in no loaded segment of {}",
                path.display()
            )
        })?;
    Ok(FoundFunction { name, file_offset })
}

/// The data symbol (a global in .data/.bss) of the ELF file `path`,
/// mapped with its offset-0 segment at `base`, that holds `addr`:
/// `name+0xoff`.
pub fn data_symbol(path: &Path, base: u64, addr: u64) -> Option<String> {
    let data = std::fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    // The first loadable segment is the one at file offset 0.
    let first_vaddr = file.segments().map(|s| s.address()).min()?;
    let vaddr = (addr.checked_sub(base)?).checked_add(first_vaddr & !0xfff)?;
    let sym = file.symbols().find(|s| {
        s.kind() == SymbolKind::Data && s.size() > 0 && s.address() <= vaddr && vaddr < s.address() + s.size()
    })?;
    let name = demangle(sym.name().ok()?);
    Some(format!("{name}+{:#x}", vaddr - sym.address()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    #[no_mangle]
    pub extern "C" fn slotprof_functions_test_target() -> u32 {
        std::hint::black_box(7)
    }

    mod inner {
        #[inline(never)]
        pub fn a_rust_path_function() -> u32 {
            std::hint::black_box(8)
        }
    }

    #[test]
    fn finds_c_and_rust_names_and_explains_misses() {
        let me = std::env::current_exe().unwrap();
        std::hint::black_box(slotprof_functions_test_target());
        std::hint::black_box(inner::a_rust_path_function());
        let c = find(&me, "slotprof_functions_test_target").unwrap();
        assert!(c.file_offset > 0);
        let r = find(&me, "inner::a_rust_path_function").unwrap();
        assert!(
            r.name.ends_with("tests::inner::a_rust_path_function"),
            "{}",
            r.name
        );
        let err = find(&me, "no_such_function_anywhere").unwrap_err().to_string();
        assert!(err.contains("nm -C"), "{err}");
        // The file offset holds the function's code.
        let data = std::fs::read(&me).unwrap();
        let here = slotprof_functions_test_target as *const u8;
        let code = unsafe { std::slice::from_raw_parts(here, 8) };
        assert_eq!(&data[c.file_offset as usize..c.file_offset as usize + 8], code);
    }
}
