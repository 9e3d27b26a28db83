//! Can this process load BPF programs and open perf events?

/// Capability bits (linux/capability.h).
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_SYSLOG: u32 = 34;

/// Fails with what to do when slotprof runs without root and without
/// CAP_BPF + CAP_PERFMON.
pub fn require_bpf() -> anyhow::Result<()> {
    // Root counts only with its capabilities: a unit's
    // CapabilityBoundingSet, or a container, can take them from uid 0.
    let caps = effective_caps().unwrap_or(0);
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    if (has(CAP_BPF) && has(CAP_PERFMON)) || has(CAP_SYS_ADMIN) {
        return Ok(());
    }
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "slotprof".into());
    let lacks: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
        .iter()
        .filter(|(c, _)| !has(*c))
        .map(|(_, n)| *n)
        .collect();
    anyhow::bail!(
        "slotprof needs CAP_BPF and CAP_PERFMON to load its eBPF probes (it lacks {}{}): run it as root \
         (sudo), or grant what it uses once with `sudo setcap {SETCAP_CAPS}+ep {exe}` (CAP_SYS_PTRACE \
         reads the target's memory and maps, CAP_DAC_READ_SEARCH its files and tracefs, CAP_SYSLOG \
         kernel symbol addresses, CAP_SYS_RESOURCE lifts the memlock and descriptor limits, \
         CAP_SYS_ADMIN the kernel stacks of threads already asleep at attach)",
        lacks.join(" and "),
        if crate::sys::euid() == 0 {
            " although it runs as root: its capabilities were bounded (systemd's CapabilityBoundingSet, a container)"
        } else {
            ""
        }
    )
}

/// Whether `/proc/kallsyms`, as this process reads it, names no kernel
/// addresses: unreadable, empty (systemd's ProtectKernelTunables=yes puts
/// an empty file over it), or all zeros (`kernel.kptr_restrict` with
/// neither CAP_SYSLOG nor a perf_event_paranoid of 1 or less). Kernel
/// frames are then named `[unknown] [kernel]+ADDR`: said once, with what
/// to do.
pub fn kernel_symbols_warning() -> Option<String> {
    use std::io::{BufRead, BufReader};
    const UNNAMED: &str = "kernel frames will be named [unknown] [kernel]+ADDR";
    const UNDER_SYSTEMD: &str = "under systemd, ProtectKernelTunables=yes hides it (the packaged unit \
                                 uses ReadOnlyPaths=/proc/sys /sys instead)";
    let f = match std::fs::File::open("/proc/kallsyms") {
        Ok(f) => f,
        Err(e) => {
            return Some(format!(
                "cannot read /proc/kallsyms ({e}): {UNNAMED}; {UNDER_SYSTEMD}"
            ))
        }
    };
    let lines: Vec<String> = BufReader::new(f).lines().take(64).map_while(Result::ok).collect();
    match kallsyms_addresses(&lines) {
        Kallsyms::Named => None,
        Kallsyms::Empty => Some(format!("/proc/kallsyms reads empty: {UNNAMED}; {UNDER_SYSTEMD}")),
        Kallsyms::Zeros => {
            let syslog = effective_caps().is_some_and(|c| c & (1 << CAP_SYSLOG) != 0);
            Some(format!(
                "/proc/kallsyms shows this process no kernel addresses (kernel.kptr_restrict = {}, {}): \
                 {UNNAMED}; run slotprof with CAP_SYSLOG (under systemd: in CapabilityBoundingSet and \
                 AmbientCapabilities, and without ProtectKernelLogs=yes, which drops it)",
                std::fs::read_to_string("/proc/sys/kernel/kptr_restrict")
                    .map_or("?".into(), |s| s.trim().to_string()),
                if syslog {
                    "although it has CAP_SYSLOG"
                } else {
                    "no CAP_SYSLOG"
                }
            ))
        }
    }
}

#[derive(Debug, PartialEq)]
enum Kallsyms {
    Named,
    Empty,
    Zeros,
}

/// What kallsyms lines (`ADDR TYPE NAME`) show of the addresses.
fn kallsyms_addresses(lines: &[String]) -> Kallsyms {
    let addrs: Vec<u64> = lines
        .iter()
        .filter_map(|l| u64::from_str_radix(l.split_whitespace().next()?, 16).ok())
        .collect();
    if addrs.is_empty() {
        Kallsyms::Empty
    } else if addrs.iter().all(|a| *a == 0) {
        Kallsyms::Zeros
    } else {
        Kallsyms::Named
    }
}

/// Every capability slotprof uses, as `setcap` spells them.
pub const SETCAP_CAPS: &str =
    "cap_bpf,cap_perfmon,cap_sys_ptrace,cap_dac_read_search,cap_syslog,cap_sys_resource,cap_sys_admin";

fn effective_caps() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim();
    u64::from_str_radix(hex, 16).ok()
}

/// Lifts RLIMIT_MEMLOCK (kernels before 5.11 charge BPF maps against it)
/// and the soft RLIMIT_NOFILE to its hard limit (the default soft 1,024 is
/// too few for a target's maps, unwind files and /metrics clients at once).
pub fn raise_limits() {
    crate::sys::raise_memlock_limit();
    crate::sys::raise_nofile_limit();
}

#[cfg(test)]
mod tests {
    #[test]
    fn kallsyms_of_zeros_or_nothing_names_nothing_and_real_addresses_do() {
        use super::{kallsyms_addresses, Kallsyms};
        let zeros = vec![
            "0000000000000000 A fixed_percpu_data".to_string(),
            "0000000000000000 T _text".into(),
        ];
        assert_eq!(kallsyms_addresses(&zeros), Kallsyms::Zeros);
        let real = vec![
            "0000000000000000 A fixed_percpu_data".to_string(),
            "ffffffff81000000 T _text".into(),
        ];
        assert_eq!(kallsyms_addresses(&real), Kallsyms::Named);
        assert_eq!(kallsyms_addresses(&[]), Kallsyms::Empty);
    }
}
