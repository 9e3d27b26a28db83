//! What a test run proved, test by test: `cargo xtask test` runs every
//! test executable itself (so it knows which binary each line came from),
//! reads libtest's `test NAME ... ok` lines, and joins them with the skip
//! records the tests write (`tests/tests/common`'s `skip`, one JSON line
//! each in `$SLOTPROF_OUTCOMES`): libtest prints `ok` for a test that
//! returned early, and only the record tells that skip from a pass.
//! A failed test runs once more, alone: if it passes then it is FLAKY,
//! with the first run's panic beside it.
//!
//! Under CI (`CI=true`) a skip is checked against this machine: a test
//! skipped for something the machine has (root, BTF, /dev/kvm, memory,
//! Chromium, CPUs, a tool, the validator's binary) is a failure.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::Context;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    Pass,
    /// Passed only on a second run (a failed test runs once more, on the
    /// host alone and in the test VMs): said, never counted as a pass.
    Flaky,
    Skipped,
    Unsupported,
    Fail,
}

impl Outcome {
    pub fn word(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Flaky => "FLAKY",
            Outcome::Skipped => "SKIPPED",
            Outcome::Unsupported => "UNSUPPORTED",
            Outcome::Fail => "FAIL",
        }
    }
}

/// One test's result: where it ran (`host` or a VM's kernel line), its
/// package and binary, its name, the outcome and why.
#[derive(Clone, Debug)]
pub struct Row {
    pub place: String,
    pub package: String,
    pub binary: String,
    pub test: String,
    pub outcome: Outcome,
    pub note: String,
}

/// A test executable cargo built: package, target name, path, and the
/// directory cargo runs it in (its package's).
#[derive(Clone, Debug)]
pub struct Executable {
    pub package: String,
    pub target: String,
    pub path: PathBuf,
    pub dir: PathBuf,
}

/// The test executables `cargo test --release --no-run` builds with
/// `select` (e.g. `--workspace`, or `-p slotprof-tests --test spine`).
pub fn executables(root: &Path, select: &[&str]) -> anyhow::Result<Vec<Executable>> {
    let mut args = vec!["test", "--release", "--no-run", "--message-format=json"];
    args.extend(select);
    eprintln!("xtask: $ cargo {}", args.join(" "));
    let out = Command::new("cargo")
        .args(&args)
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo")?;
    anyhow::ensure!(
        out.status.success(),
        "`cargo {}` failed ({})",
        args.join(" "),
        out.status
    );
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(exe), Some(target), Some(manifest)) = (
            v["executable"].as_str(),
            v["target"]["name"].as_str(),
            v["manifest_path"].as_str(),
        ) else {
            continue;
        };
        let kind = v["target"]["kind"][0].as_str().unwrap_or("");
        // Benches (harness = false: running one measures) and examples
        // are not tests here.
        if v["profile"]["test"] != true || !matches!(kind, "lib" | "rlib" | "bin" | "test" | "proc-macro") {
            continue;
        }
        // package_id: "path+file:///work/main/tests#slotprof-tests@0.1.0"
        // (or "...#0.1.0" when the name is the directory's).
        let package = v["package_id"]
            .as_str()
            .and_then(|id| id.rsplit_once('#'))
            .map(|(head, tail)| match tail.split_once('@') {
                Some((name, _)) => name.to_string(),
                None => head.rsplit('/').next().unwrap_or(head).to_string(),
            })
            .unwrap_or_default();
        found.push(Executable {
            package,
            target: target.to_string(),
            path: PathBuf::from(exe),
            dir: Path::new(manifest).parent().unwrap_or(root).to_path_buf(),
        });
    }
    anyhow::ensure!(!found.is_empty(), "cargo built no test executable");
    Ok(found)
}

/// libtest's line for one finished test: name and outcome word.
fn parse_line(line: &str) -> Option<(&str, &str)> {
    let rest = line.strip_prefix("test ")?;
    let (name, result) = rest.rsplit_once(" ... ")?;
    let word = result.split([',', ' ']).next()?;
    matches!(word, "ok" | "FAILED" | "ignored").then_some((name, result))
}

/// A skip record as the tests write it.
#[derive(Clone, Debug)]
struct Skip {
    outcome: Outcome,
    need: String,
    arg: String,
    why: String,
}

fn read_skips(path: &Path) -> BTreeMap<(String, String), Skip> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            let s = |k: &str| v[k].as_str().unwrap_or("").to_string();
            (
                (s("binary"), s("test")),
                Skip {
                    outcome: if s("outcome") == "UNSUPPORTED" {
                        Outcome::Unsupported
                    } else {
                        Outcome::Skipped
                    },
                    need: s("need"),
                    arg: s("arg"),
                    why: s("why"),
                },
            )
        })
        .collect()
}

fn mem_available_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / (1024.0 * 1024.0))
}

/// Whether this machine has what a skipped test said it lacked, checked
/// here independently of the test (`None`: not a lack of the machine,
/// e.g. a test that runs in `cargo xtask validator --test`).
fn machine_has(need: &str, arg: &str, validator: bool) -> Option<bool> {
    Some(match need {
        "root" => crate::is_root(),
        "btf" => Path::new("/sys/kernel/btf/vmlinux").exists(),
        "kvm" => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok(),
        "memory_gib" => mem_available_gib() >= arg.parse::<f64>().unwrap_or(f64::INFINITY),
        "chromium" => Path::new("/usr/bin/chromium").is_file() || crate::on_path("chromium"),
        "cpus" => {
            std::thread::available_parallelism().map_or(1, |n| n.get()) >= arg.parse().unwrap_or(usize::MAX)
        }
        "tool" => crate::on_path(arg),
        "validator" => validator,
        "tracepoint" => {
            let (cat, name) = arg.split_once(':').unwrap_or((arg, ""));
            ["/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"]
                .iter()
                .any(|e| Path::new(e).join(cat).join(name).is_dir())
        }
        "elsewhere" => return None,
        // Measured by the test itself during its run (its witness's
        // figures are in the reason); nothing to check afterwards.
        "quiet_host" => return None,
        // Something the test could not do on a machine that should: under
        // CI that is a failure to look at.
        _ => true,
    })
}

/// How `cargo_tests` runs.
pub struct Options<'a> {
    pub include_ignored: bool,
    pub env: &'a [(&'a str, &'a str)],
    /// `CI=true`: a skip for a need this machine meets fails.
    pub ci: bool,
    /// Whether the real validator's binary is here (for its skips).
    pub validator: bool,
    /// Only the tests whose name contains this (libtest's filter); the doc
    /// tests are left out then.
    pub filter: Option<&'a str>,
}

/// What one test executable is given of the user's filter, or `None` to
/// leave it out: `BINARY::REST` (as the table writes a test, e.g.
/// `phase::a_steady`), where BINARY names one of the test executables
/// (`-` and `_` alike), runs only that executable with the filter REST;
/// any other filter goes to every executable as it is.
fn split_filter<'f>(filter: Option<&'f str>, target: &str, targets: &[&str]) -> Option<Option<&'f str>> {
    let same = |a: &str, b: &str| a.replace('-', "_") == b.replace('-', "_");
    let Some(f) = filter else { return Some(None) };
    match f.split_once("::") {
        Some((bin, rest)) if targets.iter().any(|t| same(t, bin)) => {
            same(target, bin).then_some(Some(rest).filter(|r| !r.is_empty()))
        }
        _ => Some(Some(f)),
    }
}

/// Runs every test executable of the workspace (and the doc tests), one
/// after another, and returns a row per test.
pub fn cargo_tests(root: &Path, opts: &Options) -> anyhow::Result<Vec<Row>> {
    let exes = executables(root, &["--workspace"])?;
    let dir = crate::private_temp_dir("slotprof-outcomes")?;
    let records = dir.join("skips.jsonl");
    std::fs::write(&records, "")?;
    let mut rows = Vec::new();
    let result = (|| {
        let targets: Vec<&str> = exes.iter().map(|e| e.target.as_str()).collect();
        for exe in &exes {
            let Some(filter) = split_filter(opts.filter, &exe.target, &targets) else {
                continue;
            };
            let mut args: Vec<&str> = Vec::new();
            if opts.include_ignored {
                args.push("--include-ignored");
            }
            args.extend(filter);
            let exe_started = std::time::Instant::now();
            let first = run_executable(exe, &args, opts, &records)?;
            let budget = crate::budget::get();
            // (The many that take no time are not listed.)
            if exe_started.elapsed() >= std::time::Duration::from_secs(1) {
                budget.took(&format!("{} {}", exe.package, exe.target), exe_started);
            }
            // A failed test runs once more, alone: passing then makes it
            // FLAKY (said, with the first run's panic), never a pass.
            let mut again: BTreeMap<String, (bool, String)> = BTreeMap::new();
            for (name, result) in &first.seen {
                if !result.starts_with("FAILED") {
                    continue;
                }
                // Run again only when the time is there: the longest
                // e2e test takes about 5 minutes.
                if let Err(why) = budget.fits(std::time::Duration::from_secs(300)) {
                    eprintln!("xtask: {name} failed; not run again: {why}");
                    again.insert(
                        name.clone(),
                        (
                            false,
                            format!("failed (not run again: {why}): {}", first.panic_of(name)),
                        ),
                    );
                    continue;
                }
                let before = read_skips(&records);
                let mut retry_args: Vec<&str> = args
                    .iter()
                    .copied()
                    .filter(|a| *a == "--include-ignored")
                    .collect();
                retry_args.extend(["--exact", name.as_str()]);
                eprintln!("xtask: {name} failed; running it once more, alone, to tell a flaky test from a failing one");
                let second = run_executable(exe, &retry_args, opts, &records)?;
                let passed = second.seen.iter().any(|(n, r)| n == name && r.starts_with("ok"));
                let key = (exe.target.clone(), name.clone());
                let skipped = read_skips(&records)
                    .get(&key)
                    .filter(|_| !before.contains_key(&key))
                    .cloned();
                let note = match (&skipped, passed) {
                    (Some(s), _) => format!(
                        "failed; run again it skipped ({}), so the failure stands: {}",
                        s.why,
                        first.panic_of(name)
                    ),
                    (None, true) => format!(
                        "passed on a second run; the first failed: {}",
                        first.panic_of(name)
                    ),
                    (None, false) => format!("failed twice: {}", first.panic_of(name)),
                };
                again.insert(name.clone(), (passed && skipped.is_none(), note));
            }
            let (seen, status) = (first.seen, first.status);
            let skips = read_skips(&records);
            for (name, result) in &seen {
                let (outcome, note) = if let Some((flaky, note)) = again.get(name) {
                    (if *flaky { Outcome::Flaky } else { Outcome::Fail }, note.clone())
                } else if let Some(reason) = result.strip_prefix("ignored") {
                    (
                        Outcome::Skipped,
                        format!("ignored{reason} (run as root to include it)"),
                    )
                } else if let Some(s) = skips.get(&(exe.target.clone(), name.clone())) {
                    match machine_has(&s.need, &s.arg, opts.validator) {
                        Some(true) if opts.ci => (
                            Outcome::Fail,
                            format!(
                                "skipped under CI, but this machine has what it said it lacked ({}): {}",
                                s.need, s.why
                            ),
                        ),
                        _ => (s.outcome, s.why.clone()),
                    }
                } else {
                    (Outcome::Pass, String::new())
                };
                rows.push(Row {
                    place: "host".into(),
                    package: exe.package.clone(),
                    binary: exe.target.clone(),
                    test: name.clone(),
                    outcome,
                    note,
                });
            }
            if !status.success() && !seen.iter().any(|(_, r)| r.starts_with("FAILED")) {
                // (not rerun: a crash of the harness is not one test's)
                // A crash, or a failure outside any test (e.g. a panic in
                // the harness): say so as a row of its own.
                rows.push(Row {
                    place: "host".into(),
                    package: exe.package.clone(),
                    binary: exe.target.clone(),
                    test: "(the executable)".into(),
                    outcome: Outcome::Fail,
                    note: format!("exited with {status}"),
                });
            }
        }
        if opts.filter.is_some() {
            return anyhow::Ok(());
        }
        // The doc tests, as cargo runs them (one row for them all).
        let doc = crate::run(root, "cargo", &["test", "--release", "--workspace", "--doc"]);
        rows.push(Row {
            place: "host".into(),
            package: "(workspace)".into(),
            binary: "doctests".into(),
            test: "(all doc tests)".into(),
            outcome: if doc.is_ok() { Outcome::Pass } else { Outcome::Fail },
            note: doc.err().map(|e| format!("{e:#}")).unwrap_or_default(),
        });
        anyhow::Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    Ok(rows)
}

/// The end-to-end tests (package `slotprof-tests`, the fuzz targets and
/// the test VMs) as a
/// table, unit tests as one line per package, then the closing line
/// `N passed, N failed, N skipped` (and `, N flaky` when some were).
/// Returns the number of failures.
pub fn print_summary(rows: &[Row]) -> usize {
    let e2e = |r: &Row| r.package == "slotprof-tests" || r.package == "slotprof-fuzz" || r.place != "host";
    println!("\nEnd-to-end tests:");
    println!("{:<6} {:<92} {:<11} note", "where", "test", "result");
    for r in rows.iter().filter(|r| e2e(r)) {
        println!(
            "{:<6} {:<92} {:<11} {}",
            r.place,
            format!("{}::{}", r.binary, r.test),
            r.outcome.word(),
            r.note
        );
    }
    let mut units: BTreeMap<&str, [usize; 5]> = BTreeMap::new();
    for r in rows.iter().filter(|r| !e2e(r)) {
        units.entry(&r.package).or_default()[r.outcome as usize] += 1;
    }
    println!("\nUnit and integration tests by package (passed / failed / skipped):");
    for (p, c) in &units {
        println!(
            "  {p:<24} {} / {} / {}",
            c[Outcome::Pass as usize] + c[Outcome::Flaky as usize],
            c[Outcome::Fail as usize],
            c[Outcome::Skipped as usize] + c[Outcome::Unsupported as usize]
        );
    }
    for r in rows.iter().filter(|r| !e2e(r) && r.outcome != Outcome::Pass) {
        println!("  {} {}::{}: {}", r.outcome.word(), r.binary, r.test, r.note);
    }
    // The failures and flaky passes again, last, with their panics: a
    // reader of the log's tail (CI keeps only the ends of a long log)
    // sees why without the table.
    let bad: Vec<&Row> = rows
        .iter()
        .filter(|r| e2e(r) && matches!(r.outcome, Outcome::Fail | Outcome::Flaky))
        .collect();
    if !bad.is_empty() {
        println!("\nFailed and flaky end-to-end tests:");
        for r in bad {
            let note: String = r.note.chars().take(1500).collect();
            let more = if note.len() < r.note.len() { " [...]" } else { "" };
            println!(
                "  {} {} {}::{}: {note}{more}",
                r.outcome.word(),
                r.place,
                r.binary,
                r.test
            );
        }
    }
    let count = |o: &[Outcome]| rows.iter().filter(|r| o.contains(&r.outcome)).count();
    let passed = count(&[Outcome::Pass]);
    let failed = count(&[Outcome::Fail]);
    let skipped = count(&[Outcome::Skipped, Outcome::Unsupported]);
    let flaky = count(&[Outcome::Flaky]);
    let mut line = format!("{passed} passed, {failed} failed, {skipped} skipped");
    if flaky > 0 {
        line.push_str(&format!(", {flaky} flaky"));
    }
    println!("\n{line}");
    failed
}

/// One run of a test executable: libtest's result per test, its output,
/// and how it exited.
struct ExecutableRun {
    seen: Vec<(String, String)>,
    lines: Vec<String>,
    status: std::process::ExitStatus,
}

impl ExecutableRun {
    /// The first `panicked at` line of `name`'s captured output and the
    /// message after it (or "" when libtest printed none).
    fn panic_of(&self, name: &str) -> String {
        let header = format!("---- {name} stdout ----");
        let mut lines = self
            .lines
            .iter()
            .skip_while(|l| **l != header)
            .skip(1)
            .take_while(|l| !l.starts_with("---- "));
        let Some(at) = lines.by_ref().find(|l| l.contains("panicked at")) else {
            return "(no panic message in its output)".into();
        };
        match lines.next() {
            Some(msg) => format!("{} {}", at.trim(), msg.trim()),
            None => at.trim().to_string(),
        }
    }
}

/// Runs `exe` with `args`, echoing its output, with the skip records in
/// `records`.
fn run_executable(
    exe: &Executable,
    args: &[&str],
    opts: &Options,
    records: &Path,
) -> anyhow::Result<ExecutableRun> {
    eprintln!(
        "xtask: $ {} {} ({} {})",
        exe.path.display(),
        args.join(" "),
        exe.package,
        exe.target
    );
    let mut child = Command::new(&exe.path)
        .args(args)
        .envs(opts.env.iter().copied())
        .env("SLOTPROF_OUTCOMES", records)
        .current_dir(&exe.dir)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", exe.path.display()))?;
    let mut seen: Vec<(String, String)> = Vec::new();
    let mut lines = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if let Some((name, result)) = parse_line(&line) {
            seen.push((name.to_string(), result.to_string()));
        }
        lines.push(line);
    }
    let status = child.wait()?;
    Ok(ExecutableRun { seen, lines, status })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_tests_panic_is_found_in_its_own_captured_output() {
        let text = "running 2 tests\ntest a ... FAILED\ntest b ... FAILED\n\nfailures:\n\n---- a stdout ----\nsome output\n\nthread 'a' (7) panicked at tests/x.rs:1:2:\nwrong answer\n---- b stdout ----\nnothing\n---- c stdout ----\nthread 'c' (8) panicked at y.rs:3:4:\nother\n";
        let run = ExecutableRun {
            seen: Vec::new(),
            lines: text.lines().map(str::to_string).collect(),
            status: std::process::Command::new("true").status().unwrap(),
        };
        assert_eq!(
            run.panic_of("a"),
            "thread 'a' (7) panicked at tests/x.rs:1:2: wrong answer"
        );
        assert_eq!(run.panic_of("b"), "(no panic message in its output)");
        assert_eq!(run.panic_of("d"), "(no panic message in its output)");
    }

    #[test]
    fn libtest_lines_are_read_and_others_are_not() {
        assert_eq!(parse_line("test a::b ... ok"), Some(("a::b", "ok")));
        assert_eq!(parse_line("test x ... FAILED"), Some(("x", "FAILED")));
        assert_eq!(
            parse_line("test y ... ignored, needs root"),
            Some(("y", "ignored, needs root"))
        );
        assert_eq!(parse_line("test result: ok. 3 passed; 0 failed"), None);
        assert_eq!(parse_line("test z has been running for over 60 seconds"), None);
        assert_eq!(parse_line("running 3 tests"), None);
    }

    #[test]
    fn a_filter_names_an_executable_as_the_table_does_or_goes_to_all() {
        let t = ["spine", "stall-gaps", "profiler"];
        assert_eq!(split_filter(None, "spine", &t), Some(None));
        assert_eq!(split_filter(Some("hot"), "spine", &t), Some(Some("hot")));
        assert_eq!(split_filter(Some("spine::hot"), "spine", &t), Some(Some("hot")));
        assert_eq!(split_filter(Some("spine::hot"), "profiler", &t), None);
        assert_eq!(split_filter(Some("spine::"), "spine", &t), Some(None));
        assert_eq!(
            split_filter(Some("stall_gaps::x"), "stall-gaps", &t),
            Some(Some("x"))
        );
        // A module path inside an executable is a plain filter.
        assert_eq!(
            split_filter(Some("detectors::lock::tests"), "profiler", &t),
            Some(Some("detectors::lock::tests"))
        );
    }

    #[test]
    fn a_skip_for_a_need_the_machine_meets_is_known_as_such() {
        assert_eq!(machine_has("elsewhere", "", true), None);
        assert_eq!(machine_has("validator", "", false), Some(false));
        assert_eq!(machine_has("cpus", "1", false), Some(true));
        assert_eq!(machine_has("cpus", "100000", false), Some(false));
        assert_eq!(machine_has("memory_gib", "1000000", false), Some(false));
        assert_eq!(machine_has("tool", "no-such-tool-anywhere", false), Some(false));
        assert_eq!(machine_has("tool", "sh", false), Some(true));
    }

    #[test]
    fn the_closing_line_counts_every_row_once() {
        let row = |o| Row {
            place: "host".into(),
            package: "p".into(),
            binary: "b".into(),
            test: "t".into(),
            outcome: o,
            note: String::new(),
        };
        let rows = [
            row(Outcome::Pass),
            row(Outcome::Pass),
            row(Outcome::Skipped),
            row(Outcome::Unsupported),
            row(Outcome::Fail),
        ];
        assert_eq!(print_summary(&rows), 1);
    }
}
