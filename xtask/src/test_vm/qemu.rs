//! Booting a VM under QEMU and reading the tests' results off its
//! console, watching for kernel trouble.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context};

use super::*;

/// Console lines that fail a VM whatever the tests say.
pub(super) const KERNEL_TROUBLE: &[&str] = &[
    "Kernel panic",
    "BUG: soft lockup",
    "self-detected stall",
    "detected stalls on CPUs",
    "Oops:",
    "general protection fault",
];

/// How long a VM runs on after the kernel reported trouble (its traces
/// and the other CPUs' reports follow), and how many of those lines are
/// echoed to the terminal.
pub(super) const TROUBLE_GRACE: Duration = Duration::from_secs(60);
pub(super) const TROUBLE_ECHO_LINES: usize = 120;

/// Boots one VM and reads the results off its console.
pub(super) fn boot(
    kernel: &Kernel,
    initramfs: &Path,
    line: &str,
    group: &Group,
    cache: &Path,
    disk: Option<&Path>,
) -> anyhow::Result<BTreeMap<(String, String), (Outcome, String)>> {
    let log_path = cache.join(format!("console-{line}-{}.log", group.name));
    let mut log = std::fs::File::create(&log_path)?;
    let kvm = cpu_has_virtualization();
    let accel = match (kvm, group.precise_ip) {
        (true, _) => vec!["-accel", "kvm"],
        (false, true) => precise_ip_accel(),
        // One host thread for both vCPUs (no MTTCG): the kernel patches
        // its own code live when probes attach (static keys, static calls:
        // int3, then the new bytes), and with a thread per vCPU the other
        // vCPU ran stale translated code through it: int3 oopses in
        // syscall_trace_enter / syscall_exit_to_user_mode_prepare on 6.12
        // and a two-CPU soft lockup on 6.1, each in about one boot of four.
        (false, false) => vec!["-accel", "tcg,thread=single"],
    };
    eprintln!(
        "xtask: booting {} under QEMU ({}, 2 CPUs in two sockets) for {}; console in {}",
        kernel.release,
        accel[1..].join(" "),
        group.scenarios.join(", "),
        log_path.display()
    );
    let mut child = Command::new("qemu-system-x86_64")
        .args(&accel)
        .args(["-m", "3G", "-smp", "2,sockets=2,cores=1,threads=1", "-cpu", "max"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(initramfs)
        .args(
            disk.map(|d| {
                vec![
                    "-drive".to_string(),
                    format!("file={},if=virtio,format=raw,cache=unsafe", d.display()),
                ]
            })
            .unwrap_or_default(),
        )
        .args([
            "-append",
            "console=ttyS0 panic=-1 loglevel=4 rdinit=/init",
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start qemu-system-x86_64")?;
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + group.vm_limit;
    let mut results = BTreeMap::new();
    let mut current: Option<(String, String, Vec<String>)> = None;
    let mut trouble = None;
    // After the first trouble line: until when to keep reading (the
    // kernel's traces follow it), and how many more lines to echo.
    let mut trouble_until: Option<Instant> = None;
    let mut echo_left = 0usize;
    let mut began = false;
    let mut ended = false;
    loop {
        if trouble_until.is_some_and(|t| Instant::now() >= t) {
            eprintln!(
                "xtask: [{line}] VM stopped {} s after the kernel's first trouble report",
                TROUBLE_GRACE.as_secs()
            );
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            trouble.get_or_insert_with(|| format!("time limit of {} s", group.vm_limit.as_secs()));
            break;
        }
        let l = match rx.recv_timeout(left.min(Duration::from_secs(1))) {
            Ok(l) => l,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let l = l.trim_end_matches('\r').to_string();
        let _ = writeln!(log, "{l}");
        if let Some(t) = KERNEL_TROUBLE.iter().find(|t| l.contains(*t)) {
            eprintln!("xtask: [{line}] {l}");
            if trouble.is_none() {
                trouble = Some(format!("kernel trouble on the console: {t}"));
                // The report's registers and call traces, for CI's log:
                // that is all a failed run leaves behind.
                echo_left = TROUBLE_ECHO_LINES;
                trouble_until = Some(Instant::now() + TROUBLE_GRACE);
            }
        } else if echo_left > 0 {
            echo_left -= 1;
            eprintln!("xtask: [{line}] | {l}");
        }
        // The BIOS leaves no newline before the kernel's first output.
        if let Some(rest) = l.find("SLOTPROF-VM-BEGIN ").map(|i| &l[i + 18..]) {
            began = true;
            eprintln!("xtask: [{line}] booted {rest}");
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-VM-L3 ") {
            eprintln!("xtask: [{line}] L3 of {rest}");
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-TEST-BEGIN ") {
            let (bin, test) = rest.split_once(' ').unwrap_or((rest, ""));
            current = Some((bin.to_string(), test.to_string(), Vec::new()));
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-TEST-END ") {
            if let Some((bin, test, output)) = current.take() {
                let ok = rest.ends_with(" rc=0");
                let (outcome, note) = judge(ok, &output);
                eprintln!("xtask: [{line}] {bin}::{test}: {} {note}", outcome.word());
                results.insert((bin, test), (outcome, note));
            }
        } else if l == "SLOTPROF-VM-END" {
            ended = true;
        } else if let Some((_, _, output)) = current.as_mut() {
            output.push(l);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    if let Some(t) = trouble {
        bail!("{t} (console: {})", log_path.display());
    }
    if !began {
        bail!("the VM never reached its init (console: {})", log_path.display());
    }
    if !ended {
        bail!(
            "the VM stopped before its last test (console: {})",
            log_path.display()
        );
    }
    Ok(results)
}

/// A test's outcome from its exit status and what it printed.
pub(super) fn judge(ok: bool, output: &[String]) -> (Outcome, String) {
    let said = |prefix: &str| {
        output
            .iter()
            .find_map(|l| l.find(prefix).map(|i| l[i + prefix.len()..].trim().to_string()))
    };
    if let Some(why) = said("SLOTPROF-TEST-HUNG") {
        return (
            Outcome::Fail,
            format!("hung: {why}; task stacks in the console log"),
        );
    }
    if !ok {
        let why = output
            .iter()
            .find(|l| l.contains("panicked at") || l.contains("assertion"))
            .or_else(|| output.iter().rev().find(|l| !l.trim().is_empty()))
            .cloned()
            .unwrap_or_default();
        return (Outcome::Fail, why);
    }
    if let Some(why) = said("UNSUPPORTED:") {
        return (Outcome::Unsupported, format!("unsupported on this kernel: {why}"));
    }
    if let Some(why) = said("SKIPPED:") {
        return (Outcome::Skipped, why);
    }
    let missing: Vec<String> = output
        .iter()
        .filter_map(|l| l.split_once("NOT ON THIS KERNEL: "))
        .filter_map(|(_, rest)| rest.split_whitespace().next().map(str::to_string))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if missing.is_empty() {
        (Outcome::Pass, String::new())
    } else {
        (
            Outcome::Pass,
            format!("without {} (not in this kernel)", missing.join(", ")),
        )
    }
}

/// TCG with one instruction per translation block (the switch was renamed in 8.1).
pub(super) fn precise_ip_accel() -> Vec<&'static str> {
    let version = output(Command::new("qemu-system-x86_64").arg("--version")).unwrap_or_default();
    let (major, minor) = version
        .split_whitespace()
        .nth(3)
        .and_then(|v| {
            let mut it = v.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
            Some((it.next()?, it.next()?))
        })
        .unwrap_or((0, 0));
    if (major, minor) >= (8, 1) {
        vec!["-accel", "tcg,one-insn-per-tb=on,thread=single"]
    } else {
        vec!["-accel", "tcg,thread=single", "-singlestep"]
    }
}

/// Whether this CPU can run KVM guests with hardware virtualization (only
/// then is -accel kvm used; this machine's paravirtual KVM is not enough).
pub(super) fn cpu_has_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| {
        c.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    })
}
