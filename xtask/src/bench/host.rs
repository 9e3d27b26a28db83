//! Host mode while the kernel compacts memory.

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::Context;
use serde_json::Value;

use super::*;

/// Sets the two compaction sysctls and restores them when dropped, on
/// every path.
pub(super) struct Sysctls(Vec<(&'static str, String)>);

impl Sysctls {
    const FILES: [&'static str; 2] = [
        "/proc/sys/vm/compact_unevictable_allowed",
        "/proc/sys/vm/compaction_proactiveness",
    ];

    fn save() -> anyhow::Result<Self> {
        Ok(Self(
            Self::FILES
                .iter()
                .map(|f| Ok((*f, std::fs::read_to_string(f)?.trim().to_string())))
                .collect::<anyhow::Result<_>>()?,
        ))
    }

    fn set(&self, unevictable: u32, proactiveness: u32) -> anyhow::Result<()> {
        std::fs::write(Self::FILES[0], unevictable.to_string())?;
        std::fs::write(Self::FILES[1], proactiveness.to_string())?;
        Ok(())
    }
}

impl Drop for Sysctls {
    fn drop(&mut self) {
        for (f, v) in &self.0 {
            let _ = std::fs::write(f, v);
        }
    }
}

/// `slotprof host`'s own cost while compaction moves a KVM guest's locked
/// memory at full speed (the guest of the host-mode tests).
pub(super) fn host_section(root: &Path, scratch: &Path) -> anyhow::Result<String> {
    let mut md = format!("{HOST_HEADING}\n\n");
    let available_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / (1 << 20) as f64);
    if !Path::new("/dev/kvm").exists() || available_gib < 20.0 {
        let _ = writeln!(
            md,
            "Not measured: needs /dev/kvm and ~20 GiB free ({available_gib:.1} GiB available).\n"
        );
        return Ok(md);
    }
    let sysctls = Sysctls::save()?;
    sysctls.set(0, 0)?;
    let mut guest = Command::new(bin(root, "stall-kvm-guest"))
        .args(["--mem-mib", "1024", "--duration", "300"])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let result = (|| -> anyhow::Result<Value> {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(guest.stdout.take().context("guest stdout")?).lines();
        let ready = lines.next().context("the guest exited")??;
        anyhow::ensure!(ready == "ready", "unexpected guest output {ready:?}");
        sysctls.set(1, 0)?;
        let out = scratch.join("host");
        let mut host = Command::new(bin(root, "slotprof"))
            .args(["host", "--duration", "15s", "--probe-stats", "--vm-pid"])
            .arg(guest.id().to_string())
            .arg("-o")
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .spawn()?;
        std::thread::sleep(std::time::Duration::from_secs(3));
        std::fs::write("/proc/sys/vm/compact_memory", "1")?;
        anyhow::ensure!(host.wait()?.success(), "slotprof host failed");
        Ok(serde_json::from_str(&std::fs::read_to_string(
            out.join("summary.json"),
        )?)?)
    })();
    let _ = guest.kill();
    let _ = guest.wait();
    drop(sysctls);
    let summary = result?;
    let t = &summary["totals"];
    let _ = writeln!(
        md,
        "`slotprof host --probe-stats` for 15 s while `compact_memory` migrates a 1 GiB mlocked KVM guest \
         (tests/src/bin/stall-kvm-guest.rs, placed as in the host tests, vm.compact_unevictable_allowed=1): \
         {} invalidations, {} host events, {} lost. Stacks are walked at most once per 10 ms per thread and \
         tracepoint, so a run that reuses one costs far less than a walk.\n",
        t["invalidations"], t["events"], summary["lost"]["total"]
    );
    md.push_str(&program_table(&summary));
    let _ = writeln!(
        md,
        "\nThe host probes used {:.3}% of the machine's CPU over the session.\n",
        summary["probe_cost"]["cpu_percent"].as_f64().unwrap_or(0.0)
    );
    Ok(md)
}
