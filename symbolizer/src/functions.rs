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

/// An ELF file read on demand: only the parts parsed (headers, symbol
/// and string tables, the bytes asked for) are read into memory, never the
/// whole file (a validator's binary is 77 MB).
pub fn read_cache(path: &Path) -> std::io::Result<object::read::ReadCache<std::fs::File>> {
    Ok(object::read::ReadCache::new(std::fs::File::open(path)?))
}

/// Demangles Rust (legacy and v0) and leaves other names alone.
pub fn demangle(name: &str) -> String {
    match rustc_demangle::try_demangle(name) {
        Ok(d) => format!("{d:#}"),
        Err(_) => name.to_string(),
    }
}

/// Whether `demangled` is what `wanted` names: the same, or ending in
/// `::wanted`, as written or as a path the way it reads in the source
/// ([`source_path`]: `PohRecorder::set_bank` names
/// `<solana_poh::poh_recorder::PohRecorder>::set_bank`).
fn matches(demangled: &str, wanted: &str) -> bool {
    let tail = |name: &str, wanted: &str| name == wanted || name.ends_with(&format!("::{wanted}"));
    if tail(demangled, wanted) {
        return true;
    }
    let plain = source_path(demangled);
    plain != demangled && tail(&plain, &source_path(wanted))
}

/// A demangled path as a person writes it from the source: qualified
/// paths unwrapped (`<a::B>::f` is `a::B::f`; for a trait's method,
/// `<a::B as c::T>::f` is `a::B::f`) and generic arguments left out
/// (`a::B<u8>::f` and `a::B::f::<u8>` are `a::B::f`). The v0 mangling writes every inherent
/// method as `<Type>::method`, so a name typed as `Type::method` would
/// otherwise match nothing.
pub fn source_path(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut rest = name;
    while !rest.is_empty() {
        if let Some(inner) = rest.strip_prefix('<') {
            // A qualified path starts the name or follows a `::`: its
            // content up to the matching `>`.
            let Some(end) = matching_angle(inner) else {
                out.push_str(rest);
                break;
            };
            let qualified = &inner[..end];
            if out.is_empty() {
                // A qualified path (`<a::B>::f`, `<a::B as T>::f`) starts
                // the name; everywhere else `<...>` is generic arguments
                // (`B<u8>`, the turbofish `f::<I>`), left out.
                let self_type = split_top_level_as(qualified).unwrap_or(qualified);
                out.push_str(&source_path(self_type));
            } else if out.ends_with("::") {
                out.truncate(out.len() - 2);
            }
            rest = &inner[end + 1..];
        } else {
            let next = rest.find('<').unwrap_or(rest.len());
            out.push_str(&rest[..next]);
            rest = &rest[next..];
        }
    }
    out
}

/// Where the `>` that closes an opened `<` is, in `s` (which starts just
/// after it). `->` is not a bracket.
fn matching_angle(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let bytes = s.as_bytes();
    for (i, &c) in bytes.iter().enumerate() {
        match c {
            b'<' => depth += 1,
            b'>' if i > 0 && bytes[i - 1] == b'-' => {}
            b'>' if depth == 0 => return Some(i),
            b'>' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// `A as T` (outside any brackets): `A`.
fn split_top_level_as(s: &str) -> Option<&str> {
    let mut depth = 0i32;
    let bytes = s.as_bytes();
    for i in 0..bytes.len() {
        match bytes[i] {
            b'<' | b'(' | b'[' => depth += 1,
            b'>' if i > 0 && bytes[i - 1] == b'-' => {}
            b'>' | b')' | b']' => depth -= 1,
            b' ' if depth == 0 && s[i..].starts_with(" as ") => return Some(&s[..i]),
            _ => {}
        }
    }
    None
}

/// Finds the one function in `path` that `wanted` names (a mangled name, a
/// full demangled path, or its tail such as `PohRecorder::set_bank`).
pub fn find(path: &Path, wanted: &str) -> anyhow::Result<FoundFunction> {
    let data = read_cache(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file =
        object::File::parse(&data).with_context(|| format!("{} is not an ELF file", path.display()))?;
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

/// Every function in `path` that each of `wanted` names (as [`find`]
/// matches them), all of them: a generic function has one copy per
/// monomorphization (and per codegen unit that instantiated it), each an
/// address of its own. By address, one entry per address and name.
pub fn find_each(path: &Path, wanted: &[&str]) -> anyhow::Result<Vec<Vec<FoundFunction>>> {
    let data = read_cache(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file =
        object::File::parse(&data).with_context(|| format!("{} is not an ELF file", path.display()))?;
    let mut found: Vec<Vec<(u64, String)>> = vec![Vec::new(); wanted.len()];
    for sym in file.symbols().chain(file.dynamic_symbols()) {
        if sym.kind() != SymbolKind::Text || sym.address() == 0 {
            continue;
        }
        let Ok(raw) = sym.name() else { continue };
        // Cheap first: the function's own name must be in the symbol.
        if !wanted
            .iter()
            .any(|w| raw.contains(w.rsplit("::").next().unwrap_or(w)))
        {
            continue;
        }
        let name = demangle(raw);
        for (i, w) in wanted.iter().enumerate() {
            if raw == *w || matches(&name, w) {
                found[i].push((sym.address(), name.clone()));
            }
        }
    }
    let segments: Vec<(u64, u64, u64)> = file
        .segments()
        .map(|seg| {
            let (off, fsize) = seg.file_range();
            (seg.address(), seg.size().min(fsize), off)
        })
        .collect();
    Ok(found
        .into_iter()
        .map(|mut v| {
            v.sort();
            v.dedup_by_key(|(addr, _)| *addr);
            v.into_iter()
                .filter_map(|(addr, name)| {
                    let (start, _, off) = segments
                        .iter()
                        .find(|(start, size, _)| addr >= *start && addr < start + size)?;
                    Some(FoundFunction {
                        name,
                        file_offset: addr - start + off,
                    })
                })
                .collect()
        })
        .collect())
}

/// The data symbol (a global in .data/.bss) of the ELF file `path`,
/// mapped with its offset-0 segment at `base`, that holds `addr`:
/// `name+0xoff`.
pub fn data_symbol(path: &Path, base: u64, addr: u64) -> Option<String> {
    let data = read_cache(path).ok()?;
    let file = object::File::parse(&data).ok()?;
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
    fn names_are_matched_as_written_in_the_source() {
        // The real validator's names (solana-test-validator 4.4.0, v0).
        let set_bank = "<solana_poh::poh_recorder::PohRecorder>::set_bank";
        assert_eq!(
            source_path(set_bank),
            "solana_poh::poh_recorder::PohRecorder::set_bank"
        );
        assert!(matches(set_bank, "PohRecorder::set_bank"));
        assert!(matches(set_bank, "poh_recorder::PohRecorder::set_bank"));
        assert!(matches(set_bank, set_bank));
        assert!(matches(set_bank, "set_bank"));
        assert!(!matches(set_bank, "Recorder::set_bank"));
        assert!(!matches(set_bank, "PohController::set_bank"));
        // A trait's method: named by its self type.
        let tr = "<solana_runtime::bank::Bank as core::ops::drop::Drop>::drop";
        assert_eq!(source_path(tr), "solana_runtime::bank::Bank::drop");
        assert!(matches(tr, "Bank::drop"));
        // Generic arguments are left out; a name typed with them still works.
        let generic = "<alloc::vec::Vec<u8, A>>::push";
        assert_eq!(source_path(generic), "alloc::vec::Vec::push");
        assert!(matches(generic, "Vec::push"));
        assert!(matches(generic, generic));
        let nested = "<std::collections::HashMap<K, V, S> as core::iter::Extend<(K, V)>>::extend::<I>";
        assert_eq!(source_path(nested), "std::collections::HashMap::extend");
        let closure = "<a::B>::run::{closure#0}";
        assert_eq!(source_path(closure), "a::B::run::{closure#0}");
        assert_eq!(source_path("fn_ptr::<fn() -> u8>::call"), "fn_ptr::call");
        // Not Rust: unchanged.
        assert_eq!(source_path("pthread_cond_wait"), "pthread_cond_wait");
        assert_eq!(source_path("operator<"), "operator<");
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
        // SAFETY: a function's first 8 bytes of code are mapped and readable.
        let code = unsafe { std::slice::from_raw_parts(here, 8) };
        assert_eq!(&data[c.file_offset as usize..c.file_offset as usize + 8], code);
    }
}
