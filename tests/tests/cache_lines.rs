//! CacheLinePingPong under real probes (the VM path: decoded samples),
//! against programs that share a cache line on purpose, and padded twins.

mod common;

use common::*;

/// Runs `stall-false-sharing` under `slotprof record`; returns
/// (CacheLinePingPong findings, program report).
fn run(
    test: &str,
    mode: &str,
    padded: bool,
    topology: Option<&str>,
) -> (Vec<serde_json::Value>, serde_json::Value) {
    let topo_dir = scratch(&format!("{test}-topology"));
    let topo_file = topo_dir.join("topology");
    let mut opts = vec!["-F", "499"];
    if let Some(t) = topology {
        std::fs::write(&topo_file, t).unwrap();
        opts.extend(["--topology", topo_file.to_str().unwrap()]);
    }
    // Stretched in the emulated VMs: slotprof's own start (symbol tables,
    // the prologue scan) competes with the pinned threads for their CPUs.
    let seconds = (3 * time_scale()).to_string();
    let mut args = vec!["--mode", mode, "--seconds", &seconds];
    if padded {
        args.push("--padded");
    }
    let (out, truth) = record(test, &opts, "stall-false-sharing", &args);
    let found = findings(&out, "CacheLinePingPong");
    if !padded {
        // What the detector saw, for the log (a run that finds nothing is
        // read from it).
        let s = read_json(&out.join("summary.json"));
        eprintln!(
            "{test}: {} findings; summary cache_lines: {}",
            found.len(),
            s["cache_lines"]
        );
        eprintln!("{test}: counts {} lost {}", s["counts"], s["lost"]);
        // Where the samples were: the heaviest on-CPU stacks, thread and leaf end.
        let folded = std::fs::read_to_string(out.join("oncpu.folded")).unwrap_or_default();
        let mut lines: Vec<(u64, String)> = folded
            .lines()
            .filter_map(|l| {
                let (stack, n) = l.rsplit_once(' ')?;
                let frames: Vec<&str> = stack.split(';').collect();
                let tail = frames[frames.len().saturating_sub(4)..].join(";");
                Some((n.parse().ok()?, format!("{} .. {tail}", frames[0])))
            })
            .collect();
        lines.sort_by(|a, b| b.cmp(a));
        for (n, l) in lines.iter().take(12) {
            eprintln!("{test}: {n:6} {l}");
        }
    }
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
    let _ = std::fs::remove_dir_all(&topo_dir);
    (found, truth)
}

fn names(f: &serde_json::Value) -> Vec<String> {
    f["stack"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn needs_two_cpus() -> bool {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip(Need::Cpus(2), "ping-pong needs two CPUs");
        return false;
    }
    true
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn adjacent_counters_are_the_top_line_and_the_padded_twin_is_clean() {
    let Some(_k) = kernel() else { return };
    if !needs_two_cpus() {
        return;
    }
    let (f, truth) = run("fs-counters", "counters", false, None);
    let top = f.first().unwrap_or_else(|| panic!("no CacheLinePingPong"));
    assert_eq!(
        top["magnitudes"]["line"].as_f64().unwrap() as u64,
        truth["shared_line"].as_u64().unwrap()
    );
    let sites = names(top);
    assert!(
        sites.iter().any(|s| s.contains("bump_a")) && sites.iter().any(|s| s.contains("bump_b")),
        "{sites:?}"
    );
    assert!(top["magnitudes"]["atomic_rmw"].as_f64().unwrap() > 0.0);
    // What the machine's own caches make CPUs 0 and 1: one L3 on this
    // development VM, two in the QEMU test VMs (two sockets), where the
    // cause must be cross-CCX.
    if two_l3_vm() {
        assert_eq!(
            expected_cause(),
            "cross-CCX",
            "the test VM's sysfs should show two L3 caches"
        );
    }
    assert_eq!(top["cause"], expected_cause(), "{top}");

    let (f, _) = run("fs-counters-padded", "counters", true, None);
    assert!(f.is_empty(), "padded twin: {f:?}");
}

#[test]
#[ignore = "needs root and BTF: run `sudo cargo xtask test`"]
fn the_incidents_rwlock_shape_is_found_and_says_cross_ccx_when_the_ccxs_differ() {
    let Some(_k) = kernel() else { return };
    if !needs_two_cpus() {
        return;
    }
    // In the test VMs CPUs 0 and 1 are two sockets, two L3 domains in the
    // guest's own sysfs: slotprof reads the topology itself. Elsewhere
    // (one L3 here) a topology file presents the two CPUs as two CCXs
    // (threads are pinned to 0 and 1).
    let topology = if two_l3_vm() {
        assert_eq!(
            expected_cause(),
            "cross-CCX",
            "the test VM's CPUs 0 and 1 should have two L3 caches in sysfs"
        );
        None
    } else {
        Some("# test topology\n0\n1\n")
    };
    let (f, truth) = run("fs-rwlock", "rwlock", false, topology);
    let top = f.first().unwrap_or_else(|| panic!("no CacheLinePingPong"));
    assert_eq!(
        top["magnitudes"]["line"].as_f64().unwrap() as u64,
        truth["shared_line"].as_u64().unwrap()
    );
    let sites = names(top);
    assert!(
        sites.iter().any(|s| s.contains("check_bank")) && sites.iter().any(|s| s.contains("replay_reads")),
        "{sites:?}"
    );
    assert_eq!(top["cause"], "cross-CCX", "{top}");
    assert!(top["magnitudes"]["loads"].as_f64().unwrap() > 0.0);

    let (f, _) = run("fs-rwlock-padded", "rwlock", true, topology.map(|_| "0\n1\n"));
    assert!(f.is_empty(), "padded twin: {f:?}");
}

/// Whether this is a test VM whose CPUs 0 and 1 are two sockets (`cargo
/// xtask test-vm` sets `SLOTPROF_TEST_VM_SOCKETS=2`).
fn two_l3_vm() -> bool {
    std::env::var("SLOTPROF_TEST_VM_SOCKETS").is_ok_and(|v| v == "2")
}

/// The cause slotprof should give a line shared by CPUs 0 and 1, from
/// sysfs: cross-CCX when their L3 caches differ.
fn expected_cause() -> &'static str {
    let l3 = |cpu: u32| {
        std::fs::read_to_string(format!(
            "/sys/devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list"
        ))
        .ok()
    };
    match (l3(0), l3(1)) {
        (Some(a), Some(b)) if a != b => "cross-CCX",
        _ => "cross-core (same CCX)",
    }
}
