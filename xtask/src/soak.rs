//! `cargo xtask soak [--minutes N] [--seed S]` (root): the fault soak
//! (tests/src/bin/fault-soak.rs) against `slotprof run`, its results
//! written to BENCHMARKS.md's "Fault soak" section.

use std::{fmt::Write as _, path::Path, process::Command};

use anyhow::{bail, Context};

use crate::benchmarks_md::SOAK_HEADING;

pub fn run(root: &Path, args: &[String]) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the soak loads eBPF programs and mounts a tmpfs: run `sudo cargo xtask soak`");
    }
    let (mut minutes, mut seed) = (60u64, 1u64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = it.next().and_then(|v| v.parse::<u64>().ok());
        match (a.as_str(), v) {
            ("--minutes", Some(n)) if n >= 2 => minutes = n,
            ("--seed", Some(s)) => seed = s,
            _ => bail!("usage: cargo xtask soak [--minutes N (2 or more)] [--seed S]"),
        }
    }
    // The commit measured is the one built now, not the one checked out
    // when the soak ends an hour later.
    let measured_at = crate::benchmarks_md::commit(root);
    let scratch = crate::private_temp_dir("slotprof-soak-report")?;
    let report = scratch.join("soak.json");
    let status = Command::new(root.join("target/release/fault-soak"))
        .args([
            "--minutes",
            &minutes.to_string(),
            "--seed",
            &seed.to_string(),
            "--report",
        ])
        .arg(&report)
        .status()
        .context("cannot run target/release/fault-soak")?;
    let text =
        std::fs::read_to_string(&report).with_context(|| format!("the soak wrote no report ({status})"))?;
    let _ = std::fs::remove_dir_all(&scratch);
    let r: serde_json::Value = serde_json::from_str(&text)?;
    let section = section(&r, minutes, seed);
    print!("{section}");
    let path = root.join("BENCHMARKS.md");
    let md = std::fs::read_to_string(&path).unwrap_or_default();
    let stamped = match section.split_once('\n') {
        Some((heading, rest)) => format!("{heading}\n\nMeasured at {measured_at}.\n{rest}"),
        None => section.clone(),
    };
    std::fs::write(&path, crate::benchmarks_md::splice(&md, SOAK_HEADING, &stamped))?;
    eprintln!("xtask: updated the fault soak section of BENCHMARKS.md");
    if !verdicts(&r).iter().all(|(_, ok, _)| *ok) {
        bail!("the soak failed a check (see the section above)");
    }
    Ok(())
}

/// Each check of the list: (what, held, measured).
fn verdicts(r: &serde_json::Value) -> Vec<(&'static str, bool, String)> {
    let f = |k: &str| r["slots"][k].as_f64().unwrap_or(0.0);
    let rss_mib = r["rss_max_kib"].as_f64().unwrap_or(0.0) / 1024.0;
    let expected = f("expected_from_target_time");
    let accounted = f("accounted");
    let mut v = vec![
        (
            "the daemon never exits, and ends cleanly at SIGTERM",
            r["died"].is_null() && r["exit_ok"] == true,
            format!("died: {}, exit: {}", r["died"], r["exit"].as_str().unwrap_or("?")),
        ),
        (
            "/metrics answered every 2 s sample (but while 1,100 idle connections hold its 32)",
            misses_outside_idle(r).is_empty(),
            {
                let all = r["metrics_misses"].as_array().map_or(0, Vec::len);
                let outside = misses_outside_idle(r);
                format!(
                    "{all} samples unanswered, {} of them outside an idle-connection fault{}",
                    outside.len(),
                    if outside.is_empty() { String::new() } else { format!(" (at {outside:?} s)") }
                )
            },
        ),
        ("RSS stays under 64 MiB", rss_mib < 64.0, format!("peak {rss_mib:.1} MiB")),
        (
            "every slot while the target ran is exported or counted with its reason",
            expected > 0.0 && (accounted - expected).abs() <= 0.05 * expected + 5.0,
            format!(
                "{accounted:.0} accounted (full {:.0}, summary {:.0}, low_space {:.0}, write_failed {:.0}) for {expected:.0} slot lengths of target time",
                f("full"),
                f("summary"),
                f("low_space"),
                f("write_failed")
            ),
        ),
        (
            "/metrics equals the disk: full exports = slot directories",
            f("full") == f("slot_dirs_on_disk"),
            format!("{:.0} vs {:.0}", f("full"), f("slot_dirs_on_disk")),
        ),
        (
            "/metrics equals the disk: every accounted slot has its summary line",
            accounted == f("summary_lines_on_disk"),
            format!("{accounted:.0} vs {:.0} lines", f("summary_lines_on_disk")),
        ),
    ];
    v.extend(kill_verdicts(&r["kills"]));
    v
}

/// The kill loop's checks (issue 42): SIGKILL at random points, restart
/// on the same directory, and the disk still agrees with itself.
fn kill_verdicts(k: &serde_json::Value) -> Vec<(&'static str, bool, String)> {
    let n = |f: &str| k[f].as_u64().unwrap_or(u64::MAX);
    let kills = n("kills");
    let exits: Vec<&str> = k["exits"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str())
        .collect();
    let leftovers = k["leftovers"].as_array().map_or(usize::MAX, Vec::len);
    vec![
        (
            "kill loop: every slot directory has its summary line, and every line of a slot exported whole its directory but for the slot in flight (at most one a kill); no line torn or twice",
            kills > 0
                && kills != u64::MAX
                && n("lines") > 0
                && n("dirs_without_line") == 0
                && n("full_lines_without_dir") <= kills
                && n("duplicate_lines") == 0
                && n("torn_lines") == 0,
            format!(
                "{kills} kills; {} slot directories, {} lines; {} directories without a line, {} lines without their directory (slots in flight), {} duplicate and {} torn lines",
                n("slot_dirs"),
                n("lines"),
                n("dirs_without_line"),
                n("full_lines_without_dir"),
                n("duplicate_lines"),
                n("torn_lines")
            ),
        ),
        (
            "kill loop: a restart removes what a kill left half-written, and slotprof never exits by itself",
            leftovers == 0 && exits == ["exit status: 0"],
            format!("{leftovers} temporaries left; exits: {exits:?}"),
        ),
    ]
}

/// The seconds at which /metrics did not answer, outside the stretches
/// when 1,100 idle connections were open (they hold the 32 connections
/// the server serves at once until its 3 s head timeout turns them over:
/// a scrape then waits its turn, by design).
fn misses_outside_idle(r: &serde_json::Value) -> Vec<u64> {
    let faults: Vec<(f64, &str)> = r["faults"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| (f[0].as_f64().unwrap_or(0.0), f[1].as_str().unwrap_or("")))
        .collect();
    r["metrics_misses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_u64())
        .filter(|&t| {
            // The fault in force at t: the last one begun before it.
            let during = faults.iter().rev().find(|(at, _)| *at <= t as f64);
            // 10 s held, up to ~15 s more while the backlog drains.
            !during.is_some_and(|(at, k)| *k == "idle_connections" && (t as f64) < at + 25.0)
        })
        .collect()
}

fn section(r: &serde_json::Value, minutes: u64, seed: u64) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{SOAK_HEADING}\n");
    let _ = writeln!(
        s,
        "`sudo cargo xtask soak --minutes {minutes} --seed {seed}`: `slotprof run` on the synthetic validator (RPC slot source served by the soak, export on a 2 GiB tmpfs, `export.full = \"findings\"`), one fault at a time every 10-30 s at random: the RPC gone 5-15 s, answers of the wrong type, 50 MB answers, the export disk filled below the floor then to just above it, 1,100 idle /metrics connections, SIGHUP with a good and with an unappliable file (its port taken), the target killed and restarted, and the websocket for 10 s silent, sending garbage, flooding (each notification 2,000 times), announcing a 2^62-byte frame, or closing. Then the kill loop: `run` on an export of its own SIGKILLed {} times at random points 1-12 s after each start, restarted on the same directory each time, then stopped by SIGTERM.\n",
        r["kills"]["kills"]
    );
    let mut counts: std::collections::BTreeMap<&str, u32> = Default::default();
    for f in r["faults"].as_array().into_iter().flatten() {
        *counts.entry(f[1].as_str().unwrap_or("?")).or_default() += 1;
    }
    let list: Vec<String> = counts.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    let _ = writeln!(s, "Faults injected: {}.\n", list.join(", "));
    let _ = writeln!(s, "| check | held | measured |\n|---|---|---|");
    for (what, ok, measured) in verdicts(r) {
        let _ = writeln!(
            s,
            "| {what} | {} | {measured} |",
            if ok { "yes" } else { "**no**" }
        );
    }
    let series: Vec<String> = r["rss_series"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| format!("{} s {:.1}", p[0], p[1].as_f64().unwrap_or(0.0) / 1024.0))
        .collect();
    let _ = writeln!(
        s,
        "\nRSS (MiB) every 30 s: {}. Export write errors: {}; events lost: {}.\n",
        series.join(", "),
        r["export_write_errors"],
        r["lost"]
    );
    s
}
