//! Which CPUs share what: SMT siblings (one core), and last-level-cache
//! domains (on AMD EPYC, a CCX). A cache line bouncing between CCXs costs
//! far more than one bouncing between cores that share an L3.

use std::{collections::BTreeMap, path::Path};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// Where two CPUs sit relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Distance {
    /// The same CPU.
    SameCpu,
    /// Two hardware threads of one core.
    SmtSiblings,
    /// Different cores sharing a last-level cache (one CCX).
    CrossCore,
    /// Different last-level caches (CCXs).
    CrossCcx,
}

impl Distance {
    pub fn label(self) -> &'static str {
        match self {
            Distance::SameCpu => "same CPU",
            Distance::SmtSiblings => "SMT siblings",
            Distance::CrossCore => "cross-core (same CCX)",
            Distance::CrossCcx => "cross-CCX",
        }
    }
}

/// Core and CCX of each CPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// cpu -> (core id, ccx id)
    cpus: BTreeMap<u32, (u32, u32)>,
    /// Where it came from: "sysfs" or the override file.
    pub source: String,
}

/// Which way the cache-line detector sees memory accesses here.
#[derive(Clone, Debug, Serialize)]
pub struct CacheLinePath {
    /// "vm": data addresses from decoded samples and registers.
    pub path: &'static str,
    /// In plain words: what was found and why this path runs.
    pub why: String,
}

/// Looks for a PMU that samples data addresses (AMD IBS op, Intel
/// load-latency events) and says which path runs.
pub fn cache_line_path() -> CacheLinePath {
    let devices = Path::new("/sys/bus/event_source/devices");
    let ibs = devices.join("ibs_op").exists();
    let pebs = devices.join("cpu/events/mem-loads").exists();
    let why = match (ibs, pebs) {
        (true, _) => "this machine has AMD IBS op, but slotprof's hardware path is not built yet: using the VM \
                      path (decoded samples)"
            .to_string(),
        (_, true) => "this machine has Intel load-latency sampling, but slotprof's hardware path is not built \
                      yet: using the VM path (decoded samples)"
            .to_string(),
        _ => "no PMU with data addresses here (no ibs_op, no Intel mem-loads in /sys/bus/event_source/devices, \
              as in most VMs and TEE guests): using the VM path (decoded samples)"
            .to_string(),
    };
    CacheLinePath { path: "vm", why }
}

/// Parses a kernel CPU list: `0-3,8,10-11`.
pub fn parse_cpu_list(s: &str) -> anyhow::Result<Vec<u32>> {
    let cpu = |t: &str| -> anyhow::Result<u32> {
        let n: u32 = t.trim().parse()?;
        // The kernel's own limit (NR_CPUS) is 8,192 on x86-64: a larger
        // number is no CPU, and a range to it would be billions of them.
        anyhow::ensure!(
            n < MAX_CPUS,
            "CPU {n}: no machine has it (CPUs are numbered below {MAX_CPUS})"
        );
        Ok(n)
    };
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(cpu(a)?..=cpu(b)?),
            None => out.push(cpu(part)?),
        }
    }
    Ok(out)
}

/// CPU numbers are below this (x86-64's largest NR_CPUS).
pub const MAX_CPUS: u32 = 8192;

/// CPUs as the kernel writes a list: `0-3,8`.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

impl Topology {
    /// The CCXs from `file` (`--topology`) when given, else from sysfs (none
    /// known when sysfs says nothing).
    pub fn of(file: Option<&std::path::Path>) -> anyhow::Result<Topology> {
        Ok(match file {
            Some(file) => Topology::from_file(file)?,
            None => Topology::from_sysfs().unwrap_or_default(),
        })
    }

    /// Reads `/sys/devices/system/cpu`: cores from `thread_siblings_list`,
    /// CCXs from the L3 (`cache/index3/shared_cpu_list`; the highest cache
    /// level when there is no L3).
    pub fn from_sysfs() -> anyhow::Result<Self> {
        Self::from_sysfs_root(Path::new("/sys/devices/system/cpu"))
    }

    fn from_sysfs_root(root: &Path) -> anyhow::Result<Self> {
        let online = std::fs::read_to_string(root.join("online")).context("cannot read the online CPUs")?;
        let mut cpus = BTreeMap::new();
        for cpu in parse_cpu_list(&online)? {
            let dir = root.join(format!("cpu{cpu}"));
            let first = |file: &Path| -> Option<u32> {
                parse_cpu_list(&std::fs::read_to_string(file).ok()?)
                    .ok()?
                    .into_iter()
                    .min()
            };
            let core = first(&dir.join("topology/thread_siblings_list")).unwrap_or(cpu);
            let llc = (0..8)
                .rev()
                .map(|i| dir.join(format!("cache/index{i}/shared_cpu_list")))
                .find(|p| p.exists())
                .and_then(|p| first(&p))
                .unwrap_or(0);
            cpus.insert(cpu, (core, llc));
        }
        Ok(Self {
            cpus,
            source: "sysfs".into(),
        })
    }

    /// An override: one line per CCX, each a CPU list (`0-7`); cores are
    /// one per CPU unless a group is written `core:0,64` (SMT siblings).
    /// `#` starts a comment.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --topology {}", path.display()))?;
        let mut cpus = BTreeMap::new();
        let mut ccx = 0u32;
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            for group in line.split_whitespace() {
                let (is_core, list) = match group.strip_prefix("core:") {
                    Some(l) => (true, l),
                    None => (false, group),
                };
                let list = parse_cpu_list(list).with_context(|| {
                    format!(
                        "--topology {} line {}: {group:?} is not a CPU list",
                        path.display(),
                        n + 1
                    )
                })?;
                let core0 = list.iter().copied().min().unwrap_or(0);
                for cpu in list {
                    cpus.insert(cpu, (if is_core { core0 } else { cpu }, ccx));
                }
            }
            ccx += 1;
        }
        if cpus.is_empty() {
            bail!(
                "--topology {}: no CPUs in it (one line per CCX, e.g. `0-7`)",
                path.display()
            );
        }
        Ok(Self {
            cpus,
            source: path.display().to_string(),
        })
    }

    pub fn ccx_of(&self, cpu: u32) -> Option<u32> {
        self.cpus.get(&cpu).map(|c| c.1)
    }

    /// How far apart two CPUs are.
    pub fn distance(&self, a: u32, b: u32) -> Distance {
        if a == b {
            return Distance::SameCpu;
        }
        match (self.cpus.get(&a), self.cpus.get(&b)) {
            (Some(x), Some(y)) if x.1 != y.1 => Distance::CrossCcx,
            (Some(x), Some(y)) if x.0 == y.0 => Distance::SmtSiblings,
            (Some(_), Some(_)) => Distance::CrossCore,
            // Unknown CPUs: assume the worse case is not proven.
            _ => Distance::CrossCore,
        }
    }

    /// The widest distance among a set of CPUs.
    pub fn spread(&self, cpus: &[u32]) -> Distance {
        let mut d = Distance::SameCpu;
        for (i, &a) in cpus.iter().enumerate() {
            for &b in &cpus[i + 1..] {
                d = d.max(self.distance(a, b));
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_refuse_numbers_no_machine_has_and_format_as_the_kernel_writes() {
        assert_eq!(parse_cpu_list("0-3,8\n").unwrap(), vec![0, 1, 2, 3, 8]);
        // A range to 2^32 - 1 would be four billion entries.
        assert!(parse_cpu_list("0-4294967295").is_err());
        assert!(parse_cpu_list("99999").is_err());
        assert_eq!(format_cpu_list(&[8, 0, 1, 2, 3, 3, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[5]), "5");
        assert_eq!(format_cpu_list(&[]), "");
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n").unwrap(), [0, 1, 2, 3, 8, 10, 11]);
        assert!(parse_cpu_list("a-b").is_err());
    }

    #[test]
    fn override_file_makes_ccxs_and_smt_cores() {
        let dir = std::env::temp_dir().join(format!("slotprof-topo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("topo");
        std::fs::write(&f, "# two CCXs\ncore:0,2 1\n3\n").unwrap();
        let t = Topology::from_file(&f).unwrap();
        assert_eq!(t.distance(0, 2), Distance::SmtSiblings);
        assert_eq!(t.distance(0, 1), Distance::CrossCore);
        assert_eq!(t.distance(1, 3), Distance::CrossCcx);
        assert_eq!(t.spread(&[0, 1, 2]), Distance::CrossCore);
        assert_eq!(t.spread(&[0, 3]), Distance::CrossCcx);
        std::fs::write(&f, "\n# nothing\n").unwrap();
        assert!(Topology::from_file(&f)
            .unwrap_err()
            .to_string()
            .contains("no CPUs"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_machine_reads() {
        let t = Topology::from_sysfs().unwrap();
        assert!(t.ccx_of(0).is_some());
    }
}
