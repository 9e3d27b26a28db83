//! The calibrated probe: short sha256 bursts, pinned, at a fixed interval.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use sha2::{Digest, Sha256};

use crate::slots::monotonic_ns;

/// One burst: when, where, and how fast.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    pub ts_ns: u64,
    pub cpu: u32,
    pub ns_per_hash: f64,
}

/// The phase probe's settings: the one type the CLI (`--phase-*`) and the
/// configuration file (`[phase_probe]`) both lower into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhaseProbeConfig {
    pub every: Duration,
    pub burst: Duration,
    /// The CPUs to probe; `None`: every online CPU.
    pub cpus: Option<Vec<u32>>,
}

impl PhaseProbeConfig {
    /// Checked settings; the error names what is wrong, for the caller to
    /// say which flag or key it came from.
    pub fn new(every: Duration, burst: Duration, cpus: Option<Vec<u32>>) -> Result<Self, String> {
        if burst.is_zero() || burst >= every {
            return Err("the burst must be above zero and shorter than the period (every)".into());
        }
        if cpus.as_ref().is_some_and(|c| c.is_empty()) {
            return Err("no CPU to probe: give a list such as 0-3,8".into());
        }
        if let Some(c) = &cpus {
            check_cpus(c, &online_cpus())?;
        }
        Ok(Self { every, burst, cpus })
    }

    /// The CPUs probed: the configured ones, or every online CPU now.
    pub fn cpus(&self) -> Vec<u32> {
        self.cpus.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/sys/devices/system/cpu/online")
                .ok()
                .and_then(|s| crate::topology::parse_cpu_list(&s).ok())
                .unwrap_or_default()
        })
    }
}

/// The CPUs online now (/sys/devices/system/cpu/online; empty when it
/// cannot be read).
fn online_cpus() -> Vec<u32> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| crate::topology::parse_cpu_list(&s).ok())
        .unwrap_or_default()
}

/// Every CPU `asked` for is one of `online` (issue 42, case 1: a CPU that
/// does not exist was accepted, at start and by a reload, and the probe's
/// thread then aborted the daemon pinning itself there). The error lists
/// the CPUs there are. An unknown online set (sysfs unreadable) refuses
/// nothing: pinning then fails per CPU, said by the probe.
fn check_cpus(asked: &[u32], online: &[u32]) -> Result<(), String> {
    let missing: Vec<String> = asked
        .iter()
        .filter(|c| !online.is_empty() && !online.contains(c))
        .map(u32::to_string)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "CPU {} is not online on this machine; its online CPUs are {}",
        missing.join(", "),
        crate::topology::format_cpu_list(online)
    ))
}

/// The running probe; [`RunningProbe::stop`] joins its threads.
pub struct RunningProbe {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    windows: Arc<Mutex<Vec<Window>>>,
}

/// A PoH-like chain: each hash is the sha256 of the previous one.
#[inline(never)]
fn hash_chain(state: &mut [u8; 32], until_ns: u64) -> u64 {
    let mut n = 0u64;
    while monotonic_ns() < until_ns {
        for _ in 0..64 {
            let out = Sha256::digest(*state);
            state.copy_from_slice(&out);
        }
        n += 64;
    }
    n
}

/// Starts one probe thread per CPU.
pub fn start(config: &PhaseProbeConfig) -> RunningProbe {
    let stop = Arc::new(AtomicBool::new(false));
    let windows = Arc::new(Mutex::new(Vec::new()));
    let threads = config
        .cpus()
        .into_iter()
        .map(|cpu| {
            let (stop, windows) = (stop.clone(), windows.clone());
            let (every, burst) = (config.every.as_nanos() as u64, config.burst.as_nanos() as u64);
            std::thread::Builder::new()
                .name(format!("slotprof-phase{cpu}"))
                .spawn(move || {
                    if !crate::sys::pin_to_cpu(cpu) {
                        return;
                    }
                    let mut state = [cpu as u8; 32];
                    let mut next = monotonic_ns();
                    while !stop.load(Ordering::Relaxed) {
                        let start = monotonic_ns();
                        let n = hash_chain(&mut state, start + burst);
                        let took = monotonic_ns() - start;
                        windows.lock().unwrap().push(Window {
                            ts_ns: start,
                            cpu,
                            ns_per_hash: took as f64 / n.max(1) as f64,
                        });
                        next += every;
                        let now = monotonic_ns();
                        if next > now {
                            std::thread::sleep(Duration::from_nanos(next - now));
                        } else {
                            next = now;
                        }
                    }
                })
                .expect("spawn the phase probe")
        })
        .collect();
    RunningProbe {
        stop,
        threads,
        windows,
    }
}

impl RunningProbe {
    /// The windows taken since the last call, by time (the probe runs on).
    pub fn take(&self) -> Vec<Window> {
        let mut w = std::mem::take(&mut *self.windows.lock().unwrap());
        w.sort_by_key(|w| w.ts_ns);
        w
    }

    /// Stops the threads and returns every window, by time.
    pub fn stop(self) -> Vec<Window> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        let mut w = std::mem::take(&mut *self.windows.lock().unwrap());
        w.sort_by_key(|w| w.ts_ns);
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_1_a_cpu_that_is_not_online_is_refused_with_the_online_list() {
        let e = check_cpus(&[0, 99_999], &[0, 1]).unwrap_err();
        assert!(
            e.contains("CPU 99999 is not online") && e.contains("online CPUs are 0-1"),
            "{e}"
        );
        assert!(check_cpus(&[5], &[0, 1]).unwrap_err().contains("CPU 5"));
        assert!(check_cpus(&[1, 0], &[0, 1]).is_ok());
        // Unknown online CPUs refuse nothing (pinning then fails per CPU).
        assert!(check_cpus(&[7], &[]).is_ok());
        // Through the one constructor the CLI, the file and a reload share.
        let ms = Duration::from_millis;
        let here = online_cpus();
        if !here.is_empty() {
            assert!(PhaseProbeConfig::new(ms(100), ms(1), Some(vec![here[0], 99_999])).is_err());
            assert!(PhaseProbeConfig::new(ms(100), ms(1), Some(vec![here[0]])).is_ok());
        }
    }
}
