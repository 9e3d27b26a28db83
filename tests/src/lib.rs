//! Synthetic stall programs (the binaries in `src/bin`) and what they share.
//!
//! Each program does a known amount of a known kind of work and reports
//! what it did, so tests compare slotprof's findings against the program's
//! own ground truth rather than against fixed numbers.

pub mod http_receiver;
pub mod metrics_receiver;
pub mod rpc_fixture;
pub mod validator;

use std::time::Duration;

/// In the precise-ip test VM (its init sets `SLOTPROF_TEST_PRECISE_IP_SWITCH`):
/// asks the host, on the serial console, to run one instruction per
/// translation block (`on`: each sample's IP is then the instruction the
/// timer interrupted, as on hardware) or TCG's usual blocks (`off`), and
/// waits until the host says it has. Only the workload runs switched on:
/// attaching under it took 180-200 s an attach (the kernel's BPF verifier,
/// CI's 6.1 VM, 2026-12-06). Anywhere else: nothing.
pub fn precise_ips(on: bool) {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    if std::env::var_os("SLOTPROF_TEST_PRECISE_IP_SWITCH").is_none() {
        return;
    }
    let word = if on { "on" } else { "off" };
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open("/dev/ttyS0")
        .unwrap_or_else(|e| panic!("the VM's console /dev/ttyS0: {e}"));
    writeln!(&tty, "\nSLOTPROF-PRECISE-IP {word}").expect("write to the console");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    // What the console's input brought so far (read as it comes: a line
    // buffered past a poll would never wake it).
    let mut got = String::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(
            !left.is_zero(),
            "the host did not answer SLOTPROF-PRECISE-IP {word} in 120 s (its xtask reads the console)"
        );
        let mut fd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&tty),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut fd, 1, left.as_millis().min(1000) as i32) } <= 0 {
            continue;
        }
        let mut buf = [0u8; 256];
        let n = (&tty).read(&mut buf).unwrap_or(0);
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
        if got.contains(&format!("SLOTPROF-PRECISE-IP-ACK {word}\n")) {
            return;
        }
        if let Some(why) = got
            .split_once("SLOTPROF-PRECISE-IP-NAK ")
            .and_then(|(_, w)| w.split_once('\n'))
        {
            panic!("the host could not switch precise IPs {word}: {}", why.0.trim());
        }
    }
}

/// Minimal flag parsing for the stall programs: `--name value` pairs.
pub struct Flags {
    args: Vec<String>,
}

impl Flags {
    pub fn from_env() -> Self {
        Self {
            args: std::env::args().skip(1).collect(),
        }
    }

    /// The value after `--name`, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        let flag = format!("--{name}");
        self.args
            .iter()
            .position(|a| *a == flag)
            .and_then(|i| self.args.get(i + 1))
            .map(String::as_str)
    }

    /// A number after `--name`, or `default`; exits with a message when the
    /// value is not a number.
    pub fn num(&self, name: &str, default: f64) -> f64 {
        match self.get(name) {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|_| {
                eprintln!("--{name} wants a number, got {v:?}");
                std::process::exit(2)
            }),
        }
    }

    /// A duration in (fractional) seconds.
    pub fn secs(&self, name: &str, default: f64) -> Duration {
        Duration::from_secs_f64(self.num(name, default))
    }
}

/// Writes the program's report (JSON text) to `--report FILE` when given,
/// else to stdout. Written via a rename so a reader never sees half of it.
pub fn write_report(flags: &Flags, json: &str) {
    match flags.get("report") {
        Some(path) => {
            let tmp = format!("{path}.tmp");
            std::fs::write(&tmp, json).expect("write report");
            std::fs::rename(&tmp, path).expect("rename report");
        }
        None => println!("{json}"),
    }
}

/// Pins the calling thread (and the threads it spawns after) to `cpu`;
/// exits with status 2, saying why, when the kernel refuses.
pub fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET bounds `cpu`.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        eprintln!("cannot pin to CPU {cpu}: {}", std::io::Error::last_os_error());
        std::process::exit(2);
    }
}

/// Names the calling thread (what `comm` and flamegraph roots show).
pub fn name_thread(name: &str) {
    let c = std::ffi::CString::new(name).expect("thread name");
    unsafe { libc::prctl(libc::PR_SET_NAME, c.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns` and of slotprof's
/// slot timeline.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The calling thread's time spent runnable, waiting for a CPU (ns): the
/// second field of `/proc/thread-self/schedstat` (0 where the kernel has
/// no CONFIG_SCHED_INFO): the kernel's own count, runqlat's measure.
pub fn run_delay_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// MemAvailable from /proc/meminfo, in bytes (0 when unreadable).
pub fn mem_available_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// A new private directory under the system's temporary directory
/// (mkdtemp: a random name, mode 0700).
pub fn private_temp_dir(prefix: &str) -> std::io::Result<std::path::PathBuf> {
    let template = std::env::temp_dir().join(format!("{prefix}.XXXXXX"));
    let mut bytes = std::ffi::CString::new(template.as_os_str().as_encoded_bytes())
        .expect("no NUL in the temporary directory's path")
        .into_bytes_with_nul();
    let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(std::io::Error::last_os_error());
    }
    bytes.pop();
    Ok(std::path::PathBuf::from(
        String::from_utf8(bytes).expect("the temporary directory's path is UTF-8"),
    ))
}
