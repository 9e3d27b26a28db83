//! Booting a VM under QEMU and reading the tests' results off its
//! console, watching for kernel trouble.

use std::{
    collections::BTreeSet,
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
) -> anyhow::Result<Results> {
    let log_path = cache.join(format!("console-{line}-{}.log", group.name));
    let mut log = std::fs::File::create(&log_path)?;
    let kvm = cpu_has_virtualization();
    // Precise IPs under TCG: switched on and off at run time by the
    // guest's workload (see `PreciseSwitch`), through a monitor socket in
    // a private directory.
    let switch_dir = if group.precise_ip && !kvm {
        Some(crate::private_temp_dir("slotprof-vm-monitor")?)
    } else {
        None
    };
    // One host thread for both vCPUs (no MTTCG): the kernel patches its
    // own code live when probes attach (static keys, static calls: int3,
    // then the new bytes), and with a thread per vCPU the other vCPU ran
    // stale translated code through it: int3 oopses in
    // syscall_trace_enter / syscall_exit_to_user_mode_prepare on 6.12 and
    // a two-CPU soft lockup on 6.1, each in about one boot of four.
    let accel = if kvm {
        ["-accel", "kvm"]
    } else {
        ["-accel", "tcg,thread=single"]
    };
    eprintln!(
        "xtask: booting {} under QEMU ({}{}, 2 CPUs in two sockets) for {}; console in {}",
        kernel.release,
        accel[1],
        if switch_dir.is_some() {
            ", one instruction per block while the workloads run"
        } else {
            ""
        },
        group.scenarios.join(", "),
        log_path.display()
    );
    let mut child = qemu(kernel, initramfs, disk, &accel, switch_dir.as_deref())?;
    let mut switch = match &switch_dir {
        Some(dir) => match PreciseSwitch::connect(&dir.join("monitor"), child.stdin.take().expect("piped")) {
            Ok(s) => Some(s),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(dir);
                return Err(e);
            }
        },
        None => None,
    };
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    // The group's limit, or what is left of the test budget (less a
    // minute for the rest of the run) when that is shorter.
    let limit = crate::budget::get().left().map_or(group.vm_limit, |left| {
        group.vm_limit.min(left.saturating_sub(Duration::from_secs(60)))
    });
    let deadline = Instant::now() + limit;
    let mut marks = Marks::default();
    let mut trouble = None;
    // After the first trouble line: until when to keep reading (the
    // kernel's traces follow it), and how many more lines to echo.
    let mut trouble_until: Option<Instant> = None;
    let mut echo_left = 0usize;
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
            trouble.get_or_insert_with(|| {
                if limit < group.vm_limit {
                    format!(
                        "the test budget ran out ({} s were left for this VM)",
                        limit.as_secs()
                    )
                } else {
                    format!("time limit of {} s", group.vm_limit.as_secs())
                }
            });
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
        if let Some(sw) = switch.as_mut() {
            sw.answer(line, &l);
        }
        marks.read(line, l);
    }
    let _ = child.kill();
    let _ = child.wait();
    drop(switch);
    if let Some(dir) = &switch_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    if let Some(t) = trouble {
        bail!("{t} (console: {})", log_path.display());
    }
    if !marks.began {
        bail!("the VM never reached its init (console: {})", log_path.display());
    }
    if !marks.ended {
        bail!(
            "the VM stopped before its last test (console: {})",
            log_path.display()
        );
    }
    Ok(marks.results)
}

/// What the guest's init says on the console: booted, each test's begin,
/// output and end, done.
#[derive(Default)]
struct Marks {
    results: Results,
    current: Option<(String, String, Vec<String>)>,
    began: bool,
    ended: bool,
}

impl Marks {
    fn read(&mut self, line: &str, l: String) {
        // The BIOS leaves no newline before the kernel's first output.
        if let Some(rest) = l.find("SLOTPROF-VM-BEGIN ").map(|i| &l[i + 18..]) {
            self.began = true;
            eprintln!("xtask: [{line}] booted {rest}");
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-VM-L3 ") {
            eprintln!("xtask: [{line}] L3 of {rest}");
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-TEST-BEGIN ") {
            let (bin, test) = rest.split_once(' ').unwrap_or((rest, ""));
            self.current = Some((bin.to_string(), test.to_string(), Vec::new()));
        } else if let Some(rest) = l.strip_prefix("SLOTPROF-TEST-END ") {
            if let Some((bin, test, output)) = self.current.take() {
                let ok = rest.ends_with(" rc=0");
                let (outcome, note) = judge(ok, &output);
                eprintln!("xtask: [{line}] {bin}::{test}: {} {note}", outcome.word());
                self.results.insert((bin, test), (outcome, note));
            }
        } else if l == "SLOTPROF-VM-END" {
            self.ended = true;
        } else if let Some((_, _, output)) = self.current.as_mut() {
            output.push(l);
        }
    }
}

/// Starts QEMU: 3 GiB, two CPUs in two sockets, the kernel booted
/// directly with the initramfs, the disk if any, the console on stdio;
/// with `monitor_dir`, QEMU's monitor on a socket there and the console's
/// input from a pipe (the precise-IP switch).
fn qemu(
    kernel: &Kernel,
    initramfs: &Path,
    disk: Option<&Path>,
    accel: &[&str],
    monitor_dir: Option<&Path>,
) -> anyhow::Result<std::process::Child> {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(accel)
        .args(["-m", "3G", "-smp", "2,sockets=2,cores=1,threads=1", "-cpu", "max"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(initramfs)
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
        .stderr(Stdio::piped());
    if let Some(d) = disk {
        cmd.arg("-drive")
            .arg(format!("file={},if=virtio,format=raw,cache=unsafe", d.display()));
    }
    if let Some(d) = monitor_dir {
        cmd.arg("-monitor")
            .arg(format!("unix:{}/monitor,server=on,wait=off", d.display()))
            .stdin(Stdio::piped());
    }
    cmd.spawn().context("cannot start qemu-system-x86_64")
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

/// One instruction per translation block under TCG, switched at run time
/// through QEMU's monitor when the guest's workload asks on the console
/// (`SLOTPROF-PRECISE-IP on|off`, from `slotprof_tests::precise_ips`), and
/// said done on the guest's console input (`SLOTPROF-PRECISE-IP-ACK`).
/// A timer interrupt lands only between translation blocks, so with TCG's
/// usual blocks a sample's IP is nearly always a jump target, never the
/// memory access the cache-line detector decodes. Blocks translated after
/// the switch are of one instruction (QEMU looks blocks up by these flags
/// too); the workload's threads start after it.
struct PreciseSwitch {
    monitor: std::os::unix::net::UnixStream,
    console: std::process::ChildStdin,
    command: &'static str,
}

impl PreciseSwitch {
    fn connect(path: &Path, console: std::process::ChildStdin) -> anyhow::Result<Self> {
        // QEMU makes the socket as it starts.
        let started = Instant::now();
        let monitor = loop {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(m) => break m,
                Err(_) if started.elapsed() < Duration::from_secs(30) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => return Err(e).with_context(|| format!("QEMU's monitor at {}", path.display())),
            }
        };
        monitor.set_read_timeout(Some(Duration::from_secs(30)))?;
        // `singlestep` was renamed `one-insn-per-tb` in QEMU 8.1.
        let version = output(Command::new("qemu-system-x86_64").arg("--version")).unwrap_or_default();
        let command = if qemu_at_least(&version, (8, 1)) {
            "one-insn-per-tb"
        } else {
            "singlestep"
        };
        let mut sw = Self {
            monitor,
            console,
            command,
        };
        sw.prompt().context("QEMU's monitor greeting")?;
        Ok(sw)
    }

    /// Reads the monitor's output up to its next prompt.
    fn prompt(&mut self) -> anyhow::Result<String> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !got.ends_with(b"(qemu) ") {
            let n = std::io::Read::read(&mut self.monitor, &mut buf)?;
            anyhow::ensure!(n > 0, "QEMU's monitor closed");
            got.extend_from_slice(&buf[..n]);
        }
        Ok(String::from_utf8_lossy(&got).into_owned())
    }

    /// Switches, then tells the guest.
    fn set(&mut self, on: bool) -> anyhow::Result<()> {
        let word = if on { "on" } else { "off" };
        writeln!(self.monitor, "{} {word}", self.command)?;
        let answer = self.prompt()?;
        // The monitor echoes the command (with its line editor's escape
        // sequences); anything after it is an error.
        let answer = without_escapes(&answer);
        let said = answer
            .rsplit_once(&format!("{} {word}", self.command))
            .map_or(answer.as_str(), |(_, after)| after)
            .replace("(qemu) ", "");
        anyhow::ensure!(said.trim().is_empty(), "the monitor said {:?}", said.trim());
        writeln!(self.console, "SLOTPROF-PRECISE-IP-ACK {word}")?;
        self.console.flush()?;
        Ok(())
    }

    /// Switches when a console line asks; a switch that fails is said
    /// to the guest too (its workload panics with why).
    fn answer(&mut self, line: &str, l: &str) {
        let Some(word) = l.find("SLOTPROF-PRECISE-IP ").map(|i| l[i + 20..].trim()) else {
            return;
        };
        match self.set(word == "on") {
            Ok(()) => eprintln!("xtask: [{line}] one instruction per block: {word}"),
            Err(e) => {
                eprintln!("xtask: [{line}] cannot switch one instruction per block {word}: {e:#}");
                let _ = writeln!(self.console, "SLOTPROF-PRECISE-IP-NAK {word}: {e:#}");
                let _ = self.console.flush();
            }
        }
    }
}

/// Text without its terminal escape sequences (ESC [ ... letter).
fn without_escapes(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for e in chars.by_ref() {
                if e.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether `qemu-system-x86_64 --version`'s text names a version at least `want`.
fn qemu_at_least(version: &str, want: (u32, u32)) -> bool {
    version
        .split_whitespace()
        .nth(3)
        .and_then(|v| {
            let mut it = v.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
            Some((it.next()?, it.next()?))
        })
        .is_some_and(|v| v >= want)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monitors_echo_is_read_without_its_line_editors_escapes() {
        let echo = "s\x1b[K\x1b[Dsi\x1b[K\x1b[D\x1b[Dsinglestep on\x1b[K\r\n(qemu) ";
        let text = without_escapes(echo);
        assert!(text.ends_with("singlestep on\r\n(qemu) "), "{text:?}");
        assert!(!text.contains('\x1b'));
    }

    #[test]
    fn qemus_version_decides_the_switchs_name() {
        assert!(!qemu_at_least(
            "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7)",
            (8, 1)
        ));
        assert!(qemu_at_least("QEMU emulator version 8.2.2 (Debian)", (8, 1)));
        assert!(qemu_at_least("QEMU emulator version 10.0.0", (8, 1)));
        assert!(!qemu_at_least("", (8, 1)));
    }
}
