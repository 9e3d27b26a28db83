//! Where the runtime's program cache is in a validator's executable: the
//! functions that load, verify, JIT-compile and evict programs, found by
//! their demangled names. The names differ between releases (the VM crate
//! was `solana_rbpf` before it became `solana_sbpf`; the cache was
//! `LoadedPrograms` before it became `ProgramCache`), so there is a table
//! of releases; the row with the most functions present in the binary is
//! used, and a binary none matches gets a message saying what was looked
//! for. A name may match several functions (a generic function has one
//! copy per monomorphization): each gets its uprobes.

use std::path::{Path, PathBuf};

use profiler_ebpf::cache_work;
use serde::{Deserialize, Serialize};

/// Whether to probe the program cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// When the target's executable has the functions of a known release
    /// (an Agave validator); otherwise said once and left off.
    #[default]
    Auto,
    /// Required: attaching fails when the functions are not found.
    On,
    /// Never (no uprobes in the target's program-cache code).
    Off,
}

/// One release's (or range of releases') program-cache functions.
pub struct Release {
    pub name: &'static str,
    /// How the names were checked.
    pub checked: &'static str,
    /// (kind, demangled path as in the source).
    pub functions: &'static [(u32, &'static str)],
}

pub const RELEASES: &[Release] = &[
    Release {
        name: "Agave 2.2 to 4.4 (solana-sbpf, ProgramCache)",
        checked: "against the solana-test-validator 4.4.0 binary (crates.io build)",
        functions: &[
            (cache_work::LOAD, "solana_sbpf::elf::Executable::load"),
            (
                cache_work::VERIFY,
                "solana_sbpf::verifier::RequisiteVerifier::verify",
            ),
            (cache_work::JIT, "solana_sbpf::elf::Executable::jit_compile"),
            (
                cache_work::EVICT,
                "solana_program_runtime::loaded_programs::ProgramCache::evict_using_random_selection",
            ),
            (
                cache_work::EVICT,
                "solana_program_runtime::loaded_programs::ProgramCache::prune",
            ),
        ],
    },
    Release {
        name: "Agave 2.0 to 2.1 (solana-rbpf, ProgramCache)",
        checked: "from those releases' sources only (no binary here to check against)",
        functions: &[
            (cache_work::LOAD, "solana_rbpf::elf::Executable::load"),
            (
                cache_work::VERIFY,
                "solana_rbpf::verifier::RequisiteVerifier::verify",
            ),
            (cache_work::JIT, "solana_rbpf::elf::Executable::jit_compile"),
            (
                cache_work::EVICT,
                "solana_program_runtime::loaded_programs::ProgramCache::evict_using_2s_random_selection",
            ),
            (
                cache_work::EVICT,
                "solana_program_runtime::loaded_programs::ProgramCache::prune",
            ),
        ],
    },
    Release {
        name: "Solana 1.17 to Agave 1.18 (solana-rbpf, LoadedPrograms)",
        checked: "from those releases' sources only (no binary here to check against)",
        functions: &[
            (cache_work::LOAD, "solana_rbpf::elf::Executable::load"),
            (
                cache_work::VERIFY,
                "solana_rbpf::verifier::RequisiteVerifier::verify",
            ),
            (cache_work::JIT, "solana_rbpf::elf::Executable::jit_compile"),
            (
                cache_work::EVICT,
                "solana_program_runtime::loaded_programs::LoadedPrograms::sort_and_unload",
            ),
            (
                cache_work::EVICT,
                "solana_program_runtime::loaded_programs::LoadedPrograms::prune",
            ),
        ],
    },
];

/// One uprobe pair's place: a function of `binary` and the kind of work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheUprobe {
    pub binary: PathBuf,
    pub file_offset: u64,
    pub what: u32,
    /// The demangled name, for messages.
    pub name: String,
}

/// What was found in a binary.
#[derive(Debug)]
pub struct Found {
    pub release: &'static str,
    pub uprobes: Vec<CacheUprobe>,
    /// The row's names that matched nothing (said, not fatal).
    pub missing: Vec<&'static str>,
}

/// Every function looked for, by release (for the error of
/// `--program-cache on`).
pub fn looked_for() -> String {
    let rows: Vec<String> = RELEASES
        .iter()
        .map(|r| {
            let fns: Vec<&str> = r.functions.iter().map(|f| f.1).collect();
            format!("{}: {}", r.name, fns.join(", "))
        })
        .collect();
    rows.join("; ")
}

/// The release whose functions `binary` has (the most of them), with every
/// address; an error saying what was looked for when no row matches.
pub fn find(binary: &Path) -> anyhow::Result<Found> {
    let mut names: Vec<&'static str> = RELEASES
        .iter()
        .flat_map(|r| r.functions.iter().map(|f| f.1))
        .collect();
    names.sort_unstable();
    names.dedup();
    let hits = symbolizer::functions::find_each(binary, &names)?;
    let of = |name: &str| {
        &hits[names
            .iter()
            .position(|n| *n == name)
            .expect("a name of the table")]
    };
    let best = RELEASES
        .iter()
        .map(|r| (r.functions.iter().filter(|f| !of(f.1).is_empty()).count(), r))
        .filter(|(n, _)| *n > 0)
        .max_by_key(|(n, r)| (*n, std::cmp::Reverse(r.name)));
    let Some((_, release)) = best else {
        let releases: Vec<&str> = RELEASES.iter().map(|r| r.name).collect();
        anyhow::bail!(
            "none of the program-cache functions of {} is in {} (not an Agave validator, or its \
             symbols are stripped: `nm -C {} | grep -c ProgramCache` says)",
            releases.join(", "),
            binary.display(),
            binary.display()
        );
    };
    let mut uprobes = Vec::new();
    let mut missing = Vec::new();
    for &(what, name) in release.functions {
        if of(name).is_empty() {
            missing.push(name);
        }
        for f in of(name) {
            uprobes.push(CacheUprobe {
                binary: binary.to_path_buf(),
                file_offset: f.file_offset,
                what,
                name: f.name.clone(),
            });
        }
    }
    Ok(Found {
        release: release.name,
        uprobes,
        missing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_in_every_release_and_names_are_source_paths() {
        for r in RELEASES {
            for k in [
                cache_work::LOAD,
                cache_work::VERIFY,
                cache_work::JIT,
                cache_work::EVICT,
            ] {
                assert!(r.functions.iter().any(|f| f.0 == k), "{}: kind {k}", r.name);
            }
            for (_, name) in r.functions {
                assert_eq!(symbolizer::functions::source_path(name), *name);
            }
        }
    }

    #[test]
    fn a_binary_without_them_is_said_in_a_line_and_the_names_looked_for_are_listed_apart() {
        let exe = std::env::current_exe().unwrap();
        let e = find(&exe).unwrap_err().to_string();
        assert!(e.contains("none of the program-cache functions"), "{e}");
        assert!(e.contains(&exe.display().to_string()), "{e}");
        // Every program that is not a validator gets this line in `auto`:
        // it names the releases, not their ~40 functions. Its length
        // without the binary's path (named twice; a clone's path is as
        // long as it is: /work/fullrun2/... made 405 bytes).
        let fixed = e.replace(&exe.display().to_string(), "");
        assert!(fixed.len() < 350, "{} bytes without the path: {e}", fixed.len());
        assert!(!e.contains("jit_compile"), "{e}");
        assert!(looked_for().contains("solana_sbpf::elf::Executable::jit_compile"));
    }
}
