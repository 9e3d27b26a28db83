//! A real Agave node (`solana-test-validator`) for the end-to-end tests and
//! for `cargo xtask validator`: started on a fresh ledger in a private
//! temporary directory, on free ports, and stopped (its whole process
//! group) and cleaned up when the [`Node`] is dropped, also when a test
//! panics.

use std::{
    io::{Read, Write},
    net::TcpStream,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// The environment variable that names the unpacked binary (`cargo xtask`
/// sets it after unpacking `../shared/validator/`).
pub const BINARY_ENV: &str = "SLOTPROF_VALIDATOR";

/// The node's binary, or why there is none (for a SKIPPED line).
pub fn binary() -> Result<PathBuf, String> {
    let Some(path) = std::env::var_os(BINARY_ENV) else {
        return Err(format!(
            "no real validator: {BINARY_ENV} is not set (`cargo xtask test` and `cargo xtask validator` \
             set it when ../shared/validator/solana-test-validator-4.4.0.xz is there)"
        ));
    };
    let path = PathBuf::from(path);
    if !path.is_file() {
        return Err(format!("{BINARY_ENV}={} is not a file", path.display()));
    }
    Ok(path)
}

/// The environment variable that names the client-load program
/// (tests/loadgen, built by `cargo xtask`).
pub const LOADGEN_ENV: &str = "SLOTPROF_LOADGEN";

/// A steady client load on a node: `loadgen` (the Solana client library:
/// system transfers, Memo and SPL Token calls) at `rate` transactions a
/// second. [`Load::finish`] waits for its report; dropping it stops it.
pub struct Load {
    child: Option<Child>,
    report: PathBuf,
}

/// What the load did (loadgen's report).
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub offered_rate: f64,
    pub reached_rate: f64,
    pub sent: u64,
    pub send_errors: u64,
    pub landed: u64,
    pub confirmed: u64,
    pub failed: u64,
    pub json: serde_json::Value,
}

impl Load {
    /// Starts the load; `report` is a path in a private directory. The
    /// program does its set-up (airdrop, a mint, accounts) first, a few
    /// seconds, then offers `rate` a second for `seconds`.
    pub fn start(node: &Node, rate: u32, seconds: u32, report: &Path) -> Result<Load, String> {
        let bin = std::env::var_os(LOADGEN_ENV).map(PathBuf::from).ok_or_else(|| {
            format!("no client load: {LOADGEN_ENV} is not set (`cargo xtask test` builds tests/loadgen and sets it)")
        })?;
        let child = Command::new(&bin)
            .args(["--url", &node.rpc_url()])
            .args(["--rate", &rate.to_string(), "--seconds", &seconds.to_string()])
            .arg("--report")
            .arg(report)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("{}: {e}", bin.display()))?;
        Ok(Load {
            child: Some(child),
            report: report.to_path_buf(),
        })
    }

    /// The load program's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Ends the offering now (SIGTERM: loadgen stops sending, waits for
    /// the statuses of what it sent, and reports).
    pub fn stop(self) -> Result<LoadReport, String> {
        if let Some(c) = &self.child {
            // SAFETY: our own child, not yet waited for.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        self.finish()
    }

    /// Waits for the program to end and reads its report.
    pub fn finish(mut self) -> Result<LoadReport, String> {
        let mut child = self.child.take().unwrap();
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("loadgen failed ({status})"));
        }
        let text =
            std::fs::read_to_string(&self.report).map_err(|e| format!("{}: {e}", self.report.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", self.report.display()))?;
        let n = |k: &str| json[k].as_u64().ok_or(format!("loadgen report: no {k}: {text}"));
        let f = |k: &str| json[k].as_f64().ok_or(format!("loadgen report: no {k}: {text}"));
        Ok(LoadReport {
            offered_rate: f("offered_rate")?,
            reached_rate: f("reached_rate")?,
            sent: n("sent")?,
            send_errors: n("send_errors")?,
            landed: n("landed")?,
            confirmed: n("confirmed")?,
            failed: n("failed")?,
            json,
        })
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A running node.
pub struct Node {
    child: Option<Child>,
    /// Its ledger and log, in a directory made by mkdtemp (removed on drop).
    pub dir: PathBuf,
    /// JSON-RPC over HTTP; the websocket is on the next port.
    pub rpc_port: u16,
    pub faucet_port: u16,
    gossip_port: u16,
    bin: PathBuf,
    env: Vec<(String, String)>,
}

/// A free TCP and UDP port on loopback (and, for `pair`, its successor).
fn free_port(pair: bool) -> u16 {
    for _ in 0..100 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let p = l.local_addr().unwrap().port();
        if p > 60_000 {
            continue;
        }
        let ok = |p: u16| {
            std::net::TcpListener::bind(("0.0.0.0", p)).is_ok()
                && std::net::UdpSocket::bind(("0.0.0.0", p)).is_ok()
        };
        drop(l);
        if ok(p) && (!pair || ok(p + 1)) {
            return p;
        }
    }
    panic!("no free port on this machine");
}

impl Node {
    /// Starts `bin` on a fresh ledger and waits until it has made
    /// `first_slots` slots (a fresh node's first slot comes after ~15 s on
    /// 2 vCPUs), at most `timeout`.
    pub fn start(bin: &Path, first_slots: u64, timeout: Duration) -> Result<Node, String> {
        Node::start_with_env(bin, first_slots, timeout, &[])
    }

    /// [`Node::start`] with more environment (`SOLANA_METRICS_CONFIG`).
    pub fn start_with_env(
        bin: &Path,
        first_slots: u64,
        timeout: Duration,
        env: &[(&str, &str)],
    ) -> Result<Node, String> {
        let dir = crate::private_temp_dir("slotprof-validator")
            .map_err(|e| format!("cannot make a ledger directory: {e}"))?;
        let mut node = Node {
            child: None,
            dir,
            rpc_port: free_port(true),
            faucet_port: free_port(false),
            gossip_port: free_port(false),
            bin: bin.to_path_buf(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        };
        node.spawn(true)?;
        node.wait_for_slot(first_slots, timeout)?;
        Ok(node)
    }

    /// Starts the process on the node's ledger (a fresh one with `reset`)
    /// and ports.
    fn spawn(&mut self, reset: bool) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("validator.log"))
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.bin);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.arg("--ledger").arg(self.dir.join("ledger"));
        if reset {
            cmd.arg("--reset");
        }
        cmd.args(["--quiet", "--bind-address", "127.0.0.1"])
            .args(["--rpc-port", &self.rpc_port.to_string()])
            .args(["--faucet-port", &self.faucet_port.to_string()])
            .args(["--gossip-port", &self.gossip_port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            // Its own process group: stopped whole, and a Ctrl-C meant for
            // the test runner reaches the runner first.
            .process_group(0);
        self.child = Some(
            cmd.spawn()
                .map_err(|e| format!("cannot start {}: {e}", self.bin.display()))?,
        );
        Ok(())
    }

    /// Stops the node and starts it again on its ledger and ports (a new
    /// process, as after an operator's restart), then waits until it is
    /// past `slot` (its slots go on from where they were).
    pub fn restart(&mut self, timeout: Duration) -> Result<(), String> {
        let before = self.slot().unwrap_or(0);
        self.stop();
        self.spawn(false)?;
        self.wait_for_slot(before + 1, timeout)
    }

    /// Waits until the node's slot is at least `slot`.
    fn wait_for_slot(&mut self, first_slots: u64, timeout: Duration) -> Result<(), String> {
        let node = self;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = node
                .child
                .as_mut()
                .unwrap()
                .try_wait()
                .map_err(|e| e.to_string())?
            {
                return Err(format!(
                    "the validator exited before its first slots ({status}); its log: {}",
                    node.log_tail()
                ));
            }
            if let Ok(slot) = node.slot() {
                if slot >= first_slots {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the validator made no {first_slots} slots in {timeout:?}; its log: {}",
                    node.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Whether the node's process is still there.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    pub fn rpc_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.rpc_port)
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("validator.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// One JSON-RPC call: its `result`, or what went wrong.
    pub fn rpc(&self, method: &str, params: serde_json::Value) -> Result<serde_json::Value, String> {
        rpc_call(self.rpc_port, method, params)
    }

    /// `getSlot` at the "processed" commitment (the slot the node is on).
    pub fn slot(&self) -> Result<u64, String> {
        self.rpc("getSlot", serde_json::json!([{"commitment": "processed"}]))?
            .as_u64()
            .ok_or_else(|| "getSlot: not a number".to_string())
    }

    /// The node's threads: (tid, name).
    pub fn threads(&self) -> Vec<(u32, String)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
        {
            let Ok(tid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let name = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push((tid, name.trim().to_string()));
        }
        out
    }

    /// Stops it (SIGTERM to its group, SIGKILL after 10 s) and waits.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pgid = child.id() as i32;
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One JSON-RPC 2.0 call over HTTP/1.1 to 127.0.0.1:`port`: its `result`,
/// or what went wrong (a refused connection, an error object, a reply
/// that is not JSON).
pub fn rpc_call(port: u16, method: &str, params: serde_json::Value) -> Result<serde_json::Value, String> {
    let body = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("{method}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let request = format!(
        "POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes())
        .map_err(|e| format!("{method}: {e}"))?;
    let mut reply = Vec::new();
    s.take(64 << 20)
        .read_to_end(&mut reply)
        .map_err(|e| format!("{method}: {e}"))?;
    let reply = String::from_utf8_lossy(&reply);
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{method}: not an HTTP reply"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("{method}: {}", head.lines().next().unwrap_or("")));
    }
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("{method}: reply is not JSON: {e}"))?;
    if let Some(err) = v.get("error") {
        return Err(format!("{method}: {err}"));
    }
    v.get("result")
        .cloned()
        .ok_or_else(|| format!("{method}: no result in the reply"))
}
