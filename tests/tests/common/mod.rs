//! Helpers for the end-to-end tests: finding binaries, running slotprof,
//! reading its outputs, and making sure root-only tests say why they skip.

#![allow(dead_code)]

pub mod modes;
pub mod pushed;

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::{Mutex, MutexGuard},
};

/// End-to-end tests share the kernel (probes, program lists): one at a time.
static KERNEL: Mutex<()> = Mutex::new(());

/// What a skipped test lacked. `cargo xtask test` checks each need against
/// the machine itself: under CI (`CI=true`) a test skipped for a need the
/// machine meets is a failure (a hidden device, a wrong check), and a real
/// lack is listed as such in its table.
#[derive(Clone, Debug)]
pub enum Need {
    /// Root (loads eBPF programs).
    Root,
    /// The kernel's BTF (/sys/kernel/btf/vmlinux).
    Btf,
    /// Read-write /dev/kvm.
    Kvm,
    /// This much MemAvailable, in GiB.
    MemoryGib(f64),
    /// /usr/bin/chromium (or chromium on PATH).
    Chromium,
    /// At least this many online CPUs.
    Cpus(usize),
    /// This program on PATH.
    Tool(&'static str),
    /// The real validator's binary (`../shared/validator/`).
    Validator,
    /// A kernel tracepoint ("category:name"): the test is UNSUPPORTED.
    Tracepoint(String),
    /// Not a lack: the test runs elsewhere (`cargo xtask validator --test`).
    Elsewhere,
    /// The host under this VM was not steady while the test ran, as the
    /// test's own witness measured it (the reason gives its figures): a
    /// negative check on timing proved nothing that run.
    QuietHost,
    /// Something else this machine could not do (the reason says what).
    Other,
}

impl Need {
    fn tag(&self) -> (String, String) {
        match self {
            Need::Root => ("root".into(), String::new()),
            Need::Btf => ("btf".into(), String::new()),
            Need::Kvm => ("kvm".into(), String::new()),
            Need::MemoryGib(g) => ("memory_gib".into(), format!("{g}")),
            Need::Chromium => ("chromium".into(), String::new()),
            Need::Cpus(n) => ("cpus".into(), n.to_string()),
            Need::Tool(t) => ("tool".into(), t.to_string()),
            Need::Validator => ("validator".into(), String::new()),
            Need::Tracepoint(t) => ("tracepoint".into(), t.clone()),
            Need::Elsewhere => ("elsewhere".into(), String::new()),
            Need::QuietHost => ("quiet_host".into(), String::new()),
            Need::Other => ("other".into(), String::new()),
        }
    }
}

/// Says why this test does not run: `SKIPPED: why` (or `UNSUPPORTED: why`
/// for a missing tracepoint) on stderr, which the test VMs read, and one
/// JSON line appended to `$SLOTPROF_OUTCOMES` when `cargo xtask test` set
/// it (the test's name is its thread's, as libtest names it). The caller
/// then returns: libtest prints `ok`, and only this record tells a skip
/// from a pass.
pub fn skip(need: Need, why: impl std::fmt::Display) {
    let word = if matches!(need, Need::Tracepoint(_)) {
        "UNSUPPORTED"
    } else {
        "SKIPPED"
    };
    eprintln!("{word}: {why}");
    let Some(path) = std::env::var_os("SLOTPROF_OUTCOMES") else {
        return;
    };
    let (kind, arg) = need.tag();
    let exe = std::env::current_exe().ok();
    // A test binary is named `<target>-<hash>`.
    let binary = exe
        .as_deref()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .map(|n| n.rsplit_once('-').map_or(n, |(b, _)| b).to_string())
        .unwrap_or_default();
    let line = serde_json::json!({
        "binary": binary,
        "test": std::thread::current().name().unwrap_or(""),
        "outcome": word,
        "need": kind,
        "arg": arg,
        "why": why.to_string(),
    });
    // One write of one line with O_APPEND: lines from tests running at
    // once do not interleave.
    let mut text = line.to_string();
    text.push('\n');
    use std::io::Write;
    let written = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    if let Err(e) = written {
        panic!("cannot record the skip in {}: {e}", Path::new(&path).display());
    }
}

/// Takes the kernel for one test, or returns `None` after saying why the
/// test cannot run here (see [`skip`]; the test is `#[ignore]`d unless
/// run as root by `cargo xtask test`).
pub fn kernel() -> Option<MutexGuard<'static, ()>> {
    if unsafe { libc::geteuid() } != 0 {
        skip(
            Need::Root,
            "needs root (loads eBPF programs); run `sudo cargo xtask test`",
        );
        return None;
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        skip(Need::Btf, "this kernel has no BTF (/sys/kernel/btf/vmlinux)");
        return None;
    }
    Some(KERNEL.lock().unwrap_or_else(|p| p.into_inner()))
}

/// [`kernel`] for a test whose detector needs `tracepoints`
/// ("category:name"): on a kernel without one of them the test prints
/// `UNSUPPORTED: ...` (one line, which `cargo xtask test-vm` reports as
/// "unsupported on this kernel") and does not run.
pub fn kernel_with(tracepoints: &[&str]) -> Option<MutexGuard<'static, ()>> {
    let guard = kernel()?;
    let events = tracefs_root().join("events");
    if events.is_dir() {
        for tp in tracepoints {
            let (category, name) = tp.split_once(':').expect("category:name");
            if !events.join(category).join(name).is_dir() {
                skip(
                    Need::Tracepoint(tp.to_string()),
                    format!("{tp} is not in this kernel ({})", kernel_release()),
                );
                return None;
            }
        }
    }
    Some(guard)
}

/// The tracefs root, mounted at /sys/kernel/tracing when no tracefs is (as
/// slotprof itself does: a view of kernel state, no setting changed; a
/// fresh boot has none, and the checks of which tracepoints this kernel
/// has would otherwise find none).
pub fn tracefs_root() -> PathBuf {
    let find = || {
        ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.join("events").is_dir())
    };
    if let Some(root) = find() {
        return root;
    }
    let mounted = Command::new("mount")
        .args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"])
        .status();
    find().unwrap_or_else(|| {
        eprintln!("tracefs is not mounted and mounting it failed ({mounted:?})");
        PathBuf::from("/sys/kernel/tracing")
    })
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Says, one line each, which of a session's probes this kernel has no
/// tracepoint for (what depends on them went unchecked in this run).
fn say_missing_tracepoints(out: &Path) {
    let Ok(text) = std::fs::read_to_string(out.join("summary.json")) else {
        return;
    };
    let summary: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let events = tracefs_root().join("events");
    for p in summary["probes"].as_array().into_iter().flatten() {
        let event = p["event"].as_str().unwrap_or("");
        let Some((category, name)) = event.split_once(':') else {
            continue;
        };
        if p["attached"] == false && events.is_dir() && !events.join(category).join(name).is_dir() {
            eprintln!(
                "NOT ON THIS KERNEL: {event} ({} not attached; what it counts is not checked here)",
                p["program"].as_str().unwrap_or("")
            );
        }
    }
}

/// A binary of this package (a stall program).
/// How much slower than real time the timed scenarios must run here:
/// `SLOTPROF_TEST_TIME_SCALE` (1 unless set; `cargo xtask test-vm` sets it
/// in TCG guests, whose timers oversleep by milliseconds).
pub fn time_scale() -> u64 {
    match std::env::var("SLOTPROF_TEST_TIME_SCALE") {
        Err(_) => 1,
        Ok(v) => {
            let n: u64 = v
                .parse()
                .ok()
                .filter(|&n| n >= 1)
                .unwrap_or_else(|| panic!("SLOTPROF_TEST_TIME_SCALE={v:?}: want a whole number >= 1"));
            eprintln!("timed scenario stretched x{n} (SLOTPROF_TEST_TIME_SCALE)");
            n
        }
    }
}

pub fn stall_program(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_stall-spin-sleep"))
        .parent()
        .unwrap();
    dir.join(name)
}

/// The slotprof binary, built next to the stall programs.
pub fn slotprof() -> PathBuf {
    let p = stall_program("slotprof");
    assert!(
        p.exists(),
        "{} is missing: build it first (`cargo build --release -p profiler`; `cargo xtask test` does)",
        p.display()
    );
    p
}

/// A fresh scratch directory for one test, made by mkdtemp (a private,
/// unpredictable name: never a path another user could have prepared).
pub fn scratch(test: &str) -> PathBuf {
    slotprof_tests::private_temp_dir(&format!("slotprof-e2e-{test}")).unwrap_or_else(|e| {
        panic!(
            "cannot make a scratch directory under {}: {e}",
            std::env::temp_dir().display()
        )
    })
}

/// Runs slotprof with `args` and returns its output, echoing it for the test log.
pub fn run_slotprof(args: &[&str]) -> Output {
    let out = Command::new(slotprof())
        .args(args)
        .output()
        .expect("run slotprof");
    eprintln!(
        "slotprof {args:?} -> {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn read_folded(path: &Path) -> flamegraphs::Folded {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    flamegraphs::Folded::parse(&text).unwrap()
}

/// Names of loaded BPF programs that are slotprof's.
pub fn loaded_slotprof_programs() -> Vec<String> {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter_map(|p| p.name_as_str().map(str::to_string))
        .filter(|n| n.starts_with("slotprof_"))
        .collect()
}

/// slotprof's programs still loaded once the kernel has had time to free
/// them: a program on a system call tracepoint (faultable since 6.13) is
/// freed after an RCU Tasks Trace grace period, a few hundred ms after the
/// process that held it exited. Waits up to 5 s for none to be left, and
/// says how long they took; a program still there after that is a leak.
pub fn slotprof_programs_left() -> Vec<String> {
    let t = std::time::Instant::now();
    loop {
        let left = loaded_slotprof_programs();
        if left.is_empty() {
            if t.elapsed() > std::time::Duration::from_millis(50) {
                eprintln!("slotprof's programs were freed {:?} after its exit", t.elapsed());
            }
            return left;
        }
        if t.elapsed() > std::time::Duration::from_secs(5) {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Headless Chromium, if installed (`cargo xtask test` installs it).
pub fn chromium() -> Option<PathBuf> {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

/// Loads `page` in headless Chromium; returns the DOM after scripts ran and
/// every console message the page produced.
pub fn render_in_chromium(chromium: &Path, page: &Path) -> (String, Vec<String>) {
    let profile = scratch("chromium-profile");
    let out = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium");
    let _ = std::fs::remove_dir_all(&profile);
    let console = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains(":CONSOLE") || l.contains("Uncaught"))
        .map(str::to_string)
        .collect();
    (String::from_utf8_lossy(&out.stdout).into_owned(), console)
}

/// Runs stall program `program args` under `slotprof record [slotprof_args]`
/// with `--report`; returns (output dir, the program's report).
pub fn record(
    test: &str,
    slotprof_args: &[&str],
    program: &str,
    args: &[&str],
) -> (PathBuf, serde_json::Value) {
    record_bin(test, slotprof_args, &stall_program(program), args)
}

/// [`record`] of a stall program at `bin` (e.g. [`without_frame_pointers`]).
pub fn record_bin(
    test: &str,
    slotprof_args: &[&str],
    bin: &Path,
    args: &[&str],
) -> (PathBuf, serde_json::Value) {
    let dir = scratch(test);
    let report = dir.join("report.json");
    let out = dir.join("out");
    let mut argv: Vec<&str> = vec!["record", "--out", out.to_str().unwrap()];
    argv.extend(slotprof_args);
    argv.push("--");
    argv.push(bin.to_str().unwrap());
    argv.extend(args);
    argv.extend(["--report", report.to_str().unwrap()]);
    let o = run_slotprof(&argv);
    assert!(o.status.success());
    say_missing_tracepoints(&out);
    (out, read_json(&report))
}

/// A stall program as a plain `cargo build --release` makes it (no frame
/// pointers), built by `cargo xtask build` into target/nofp.
pub fn without_frame_pointers(name: &str) -> PathBuf {
    let release = stall_program(name);
    let p = release
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("nofp/release")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: `cargo xtask build` (or `cargo xtask test`) builds it",
        p.display()
    );
    p
}

/// The findings of one kind in an output directory.
pub fn findings(out: &Path, kind: &str) -> Vec<serde_json::Value> {
    read_json(&out.join("findings.json"))
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == kind)
        .cloned()
        .collect()
}

/// A free loopback port whose successor is free too (HTTP + websocket).
pub fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no free port pair on loopback");
}

/// The C stall program `tests/c/NAME.c` as a fresh copy in `dir`: the one
/// `cargo xtask build` compiled into `target/c/` (the test VMs have no
/// compiler), else compiled here with `cc` and the flags on its first line.
/// `None` after printing SKIPPED when neither works.
pub fn c_program(dir: &Path, name: &str) -> Option<PathBuf> {
    let bin = dir.join(name);
    let built = stall_program(name)
        .parent()
        .and_then(Path::parent)
        .map(|target| target.join("c").join(name));
    if let Some(built) = built.filter(|p| p.is_file()) {
        std::fs::copy(&built, &bin).unwrap();
        return Some(bin);
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("c")
        .join(format!("{name}.c"));
    let text = std::fs::read_to_string(&src).unwrap_or_default();
    let Some(flags) = text.lines().next().and_then(|l| l.strip_prefix("// cflags:")) else {
        skip(
            Need::Other,
            format!("{} is missing (and target/c/{name} was not built)", src.display()),
        );
        return None;
    };
    let cc = Command::new("cc")
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .status();
    if !cc.is_ok_and(|s| s.success()) {
        skip(
            Need::Tool("cc"),
            format!("no C compiler (cc) to build {name}, and no target/c/{name} (`cargo xtask build`)"),
        );
        return None;
    }
    Some(bin)
}

/// `summary.json`'s unwinding entry for module `name` (Null when absent).
pub fn unwinding_of(summary: &serde_json::Value, name: &str) -> serde_json::Value {
    summary["unwinding"]["modules"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["module"] == name)
        .cloned()
        .unwrap_or_default()
}

/// A `slotprof run` child, killed if a test fails before it is stopped;
/// its stderr goes to a file in the test's directory (a pipe nobody reads
/// would fill up over a long run and block it).
pub struct Daemon {
    child: std::process::Child,
    stderr: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Daemon {
    pub fn start(config: &Path, dir: &Path) -> Self {
        Self::start_with(config, dir, &[], &[])
    }

    /// [`Daemon::start`] under `wrapper` (a command that runs the rest of
    /// its arguments, e.g. setpriv), with `env` added.
    pub fn start_with(config: &Path, dir: &Path, wrapper: &[&str], env: &[(&str, &str)]) -> Self {
        let stderr = dir.join("slotprof-run.stderr");
        let slotprof = slotprof();
        let mut argv: Vec<&str> = wrapper.to_vec();
        argv.extend([
            slotprof.to_str().unwrap(),
            "run",
            "--config",
            config.to_str().unwrap(),
        ]);
        let child = Command::new(argv[0])
            .args(&argv[1..])
            .envs(env.iter().copied())
            .stderr(std::fs::File::create(&stderr).expect("create the daemon's stderr file"))
            .spawn()
            .expect("start slotprof run");
        Self { child, stderr }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then the exit status and everything it said.
    pub fn stop(mut self) -> (std::process::ExitStatus, String) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "slotprof run did not stop within 30 s of SIGTERM"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let err = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        eprintln!("--- slotprof run said\n{err}");
        (status, err)
    }
}

/// A free loopback TCP port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET http://127.0.0.1:port/path, the body.
pub fn http_get(port: u16, path: &str) -> String {
    let r = http_exchange(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"),
    )
    .expect("connect to /metrics");
    let (head, body) = r.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// `request` sent whole to 127.0.0.1:port, the whole answer; None when
/// nothing listens there (yet).
pub fn http_exchange(port: u16, request: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    // One write: `write!` on an unbuffered stream sends each piece apart.
    std::io::Write::write_all(&mut s, request.as_bytes()).ok()?;
    let mut r = String::new();
    std::io::Read::read_to_string(&mut s, &mut r).ok()?;
    Some(r)
}

/// One measured check for the table `cargo xtask validator --test` prints
/// at its end: a JSON line appended to `$SLOTPROF_RESULTS` when set.
/// Returns `ok`, to be asserted by the caller with its own message.
pub fn row(test: &str, check: &str, measured: &str, bound: &str, ok: bool) -> bool {
    eprintln!(
        "check: {test}: {check}: {measured} (bound {bound}): {}",
        if ok { "ok" } else { "FAILED" }
    );
    if let Some(path) = std::env::var_os("SLOTPROF_RESULTS") {
        let line = serde_json::json!({
            "test": test, "check": check, "measured": measured, "bound": bound, "ok": ok,
        });
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(path) {
            let _ = std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes());
        }
    }
    ok
}

/// One sample of `perf script`: the thread's comm and its frames, leaf
/// first, each as (symbol, dso).
pub struct PerfSample {
    pub comm: String,
    pub frames: Vec<(String, String)>,
}

/// `perf script --no-inline -F comm,tid,ip,sym,dso` of `data`, parsed;
/// what perf said on stderr when it gave nothing.
pub fn perf_script(perf: &Path, data: &Path) -> Vec<PerfSample> {
    let out = Command::new(perf)
        .args(["script", "--no-inline", "-F", "comm,tid,ip,sym,dso", "-i"])
        .arg(data)
        .output()
        .expect("perf script");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut samples = Vec::new();
    let mut current: Option<PerfSample> = None;
    for line in text.lines() {
        if line.trim().is_empty() || !line.starts_with(|c: char| c.is_whitespace()) {
            samples.extend(current.take());
            if !line.trim().is_empty() {
                let comm = line.split_whitespace().next().unwrap_or("").to_string();
                current = Some(PerfSample {
                    comm,
                    frames: Vec::new(),
                });
            }
            continue;
        }
        // "\t    55d0c0a1b2c3 sym+0x1f (/path/to/dso)"
        let Some(s) = current.as_mut() else { continue };
        let line = line.trim();
        let (rest, dso) = line.rsplit_once(" (").unwrap_or((line, ""));
        let sym = rest.split_once(' ').map_or("", |(_, s)| s);
        s.frames
            .push((sym.to_string(), dso.trim_end_matches(')').to_string()));
    }
    samples.extend(current);
    if samples.is_empty() {
        eprintln!(
            "perf script -i {} ({} bytes): {} lines out, stderr: {}",
            data.display(),
            std::fs::metadata(data).map_or(0, |m| m.len()),
            text.lines().count(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    samples
}

/// `go tool pprof` (Go from the system's packages), or None.
pub fn go_binary() -> Option<std::path::PathBuf> {
    ["/usr/bin/go", "/usr/lib/go/bin/go", "/usr/local/go/bin/go"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
}

/// google/pprof, the reference pprof with a local symbolizer that reads
/// build IDs and ELF segments (`cargo xtask test` builds it from Debian's
/// source package into `.tools/bin/pprof`), or None.
pub fn google_pprof() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/pprof");
    p.exists().then_some(p)
}

/// `go tool pprof ARGS`: its stdout, or a panic with its stderr.
pub fn go_pprof(go: &Path, args: &[&str]) -> String {
    go_pprof_with(go, args, &[])
}

/// [`go_pprof`] with extra environment variables.
pub fn go_pprof_with(go: &Path, args: &[&str], env: &[(&str, &Path)]) -> String {
    // `go` runs its bundled pprof; google/pprof is run as itself.
    let tool: &[&str] = if go.ends_with("pprof") {
        &[]
    } else {
        &["tool", "pprof"]
    };
    let o = std::process::Command::new(go)
        .args(tool)
        .args(args)
        // Go's tools want a writable home for their cache.
        .env("HOME", std::env::temp_dir())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "go tool pprof {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Each sample type's total in a pprof file, by its type name.
pub fn pprof_totals(path: &Path) -> std::collections::BTreeMap<String, i64> {
    let p = flamegraphs::pprof::decode_gzip(&std::fs::read(path).unwrap()).unwrap();
    p.sample_type
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                p.string_table[t.ty as usize].clone(),
                p.sample.iter().map(|s| s.value[i]).sum(),
            )
        })
        .collect()
}

/// `slotprof run`'s configuration file, written into `dir`.
pub fn write_config(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("slotprof.toml");
    std::fs::write(&p, body).unwrap();
    p
}

/// A configuration for the synthetic validator over its RPC fixture;
/// `export` lines go in the [export] section.
pub fn config_text(rpc: u16, metrics: u16, dir: &Path, export: &str) -> String {
    format!(
        "[target]\ncomm = \"synthetic-validator\"\n[slots]\nsource = \"rpc=http://127.0.0.1:{rpc}\"\n\
         [export]\ndir = \"{}\"\n{export}\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n\
         [phase_probe]\nenabled = false\n",
        dir.display()
    )
}

/// The synthetic validator with its RPC fixture on `port`: `slots` slots
/// from slot 345600102, its ground truth in `dir`/truth.json.
pub fn start_validator(dir: &Path, port: u16, slots: u32, extra: &[&str]) -> std::process::Child {
    // The first slot starts 3 s from now: slotprof is attached by then.
    let origin = (slotprof_tests::monotonic_ns() + 3_000_000_000).to_string();
    let mut args = vec![
        "--rpc-port".to_string(),
        port.to_string(),
        "--first-slot".into(),
        "345600102".into(),
        "--slots".into(),
        slots.to_string(),
        "--origin-ns".into(),
        origin,
        "--report".into(),
        dir.join("truth.json").to_str().unwrap().into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new(stall_program("synthetic-validator"))
        .args(&args)
        .spawn()
        .expect("start synthetic-validator")
}

/// The kernel's own tracer, as an independent counter: a tracefs instance
/// of its own (a ring buffer and event switches apart from the top-level
/// ones, which stay as they were), with the given events on and each
/// event's thread-group id recorded. Removed when dropped, panics
/// included, so nothing it changed outlives it.
pub struct TraceInstance {
    dir: PathBuf,
}

/// One event the tracer recorded: the process (thread group), the event's
/// name and its formatted fields.
#[derive(Clone, Debug)]
pub struct TracedEvent {
    /// Seconds on the tracer's clock.
    pub ts: f64,
    /// The thread.
    pub tid: u32,
    pub tgid: Option<u32>,
    /// The event's name (a system call's events say `sys_NAME(args)` and
    /// `sys_NAME -> ret` instead, whole in `text`).
    pub event: String,
    pub fields: String,
    /// Everything after the timestamp.
    pub text: String,
}

impl TraceInstance {
    /// An instance recording `events` ("category:name"), `buffer_kb` of
    /// ring per CPU; None (with why) when tracefs or an event is missing.
    pub fn start(events: &[&str], buffer_kb: u32) -> Result<Self, String> {
        let root = tracefs_root();
        // A name no other run uses (mkdir fails on an existing one).
        let scratch = scratch("trace");
        let name = scratch.file_name().unwrap().to_string_lossy().replace('.', "-");
        let _ = std::fs::remove_dir(&scratch);
        let dir = root.join("instances").join(name);
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        let me = Self { dir };
        let set = |file: &str, value: &str| {
            std::fs::write(me.dir.join(file), value).map_err(|e| format!("{file} <- {value}: {e}"))
        };
        set("buffer_size_kb", &buffer_kb.to_string())?;
        set("options/record-tgid", "1")?;
        for e in events {
            let (cat, name) = e
                .split_once(':')
                .ok_or_else(|| format!("{e}: not category:name"))?;
            set(&format!("events/{cat}/{name}/enable"), "1")?;
        }
        set("tracing_on", "1")?;
        Ok(me)
    }

    /// Stops recording and returns what was recorded; fails when the ring
    /// overran (a count short of lost events would not be the truth).
    pub fn stop(&self) -> Vec<TracedEvent> {
        std::fs::write(self.dir.join("tracing_on"), "0").expect("tracing_on <- 0");
        for cpu in std::fs::read_dir(self.dir.join("per_cpu"))
            .expect("per_cpu")
            .flatten()
        {
            let stats = std::fs::read_to_string(cpu.path().join("stats")).unwrap_or_default();
            for key in ["overrun: ", "dropped events: "] {
                let n = stats
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                assert_eq!(
                    n,
                    0,
                    "the trace ring lost events ({key}{n}): {}",
                    cpu.path().display()
                );
            }
        }
        let text = std::fs::read_to_string(self.dir.join("trace")).expect("read trace");
        text.lines().filter_map(parse_trace_line).collect()
    }
}

impl Drop for TraceInstance {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("tracing_on"), "0");
        // Removing the instance frees its ring and its event switches.
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!("cannot remove the tracefs instance {}: {e}", self.dir.display());
        }
    }
}

/// `  comm-tid  (  tgid) [cpu] flags  ts: event: fields` (options/record-tgid).
pub fn parse_trace_line(line: &str) -> Option<TracedEvent> {
    if line.starts_with('#') {
        return None;
    }
    // The tgid's parentheses are the last before the CPU's brackets (a
    // thread's name may hold either).
    let close = line.find(") [")?;
    let open = line[..close].rfind('(')?;
    let tgid = line[open + 1..close].trim().parse().ok();
    let tid = line[..open].trim_end().rsplit_once('-')?.1.parse().ok()?;
    let after = &line[close..];
    let at = after.find(": ")?;
    let ts = after[..at].rsplit(' ').next()?.parse().ok()?;
    let rest = &after[at + 2..];
    let (event, fields) = rest.split_once(": ").unwrap_or((rest, ""));
    Some(TracedEvent {
        ts,
        tid,
        tgid,
        event: event.trim().to_string(),
        fields: fields.to_string(),
        text: rest.to_string(),
    })
}

/// Steal time of each of `cpus` (USER_HZ ticks, 10 ms) from /proc/stat:
/// the time the host under this VM ran something else while a vCPU had
/// work, which the guest's own clocks count neither as running nor as
/// waiting for a CPU.
pub fn steal_ticks_of<const N: usize>(cpus: [usize; N]) -> [u64; N] {
    cpus.map(|cpu| steal_ticks(&format!("cpu{cpu} ")))
}

/// Steal time of the whole machine in ms, from /proc/stat's `cpu` line.
pub fn steal_ms() -> u64 {
    steal_ticks("cpu ") * 10
}

/// The steal column of /proc/stat's line starting with `line` (0 when
/// unreadable).
fn steal_ticks(line: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(line))
        .and_then(|l| l.split_whitespace().nth(8)?.parse().ok())
        .unwrap_or(0)
}

/// Whether `count` events in `n` trials are consistent with a rate of at
/// most `rate`: the lower end of the count's 95% Wilson interval is at or
/// below it (a count can exceed `rate * n` by chance when the true rate
/// is `rate`; it fails when the data show the rate is higher). With the
/// measured rate and interval, for the check's row.
pub fn rate_at_most(count: usize, n: usize, rate: f64) -> (bool, String) {
    let (k, n) = (count as f64, n.max(1) as f64);
    let z = 1.96f64;
    let p = k / n;
    let centre = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / (1.0 + z * z / n);
    let (lo, hi) = ((centre - half).max(0.0), (centre + half).min(1.0));
    (
        lo <= rate,
        format!(
            "{count} in {} ({:.2}%, 95% interval {:.2}-{:.2}%)",
            n as u64,
            100.0 * p,
            100.0 * lo,
            100.0 * hi
        ),
    )
}

/// A child process killed and reaped when dropped: also when a check
/// panics, so a target meant to outlive its sessions never outlives the
/// test.
pub struct KillOnDrop(pub std::process::Child);

impl KillOnDrop {
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
