//! Memory pressure as the kernel counts it (PSI, pressure stall
//! information): the time some (or all) non-idle tasks were stalled on
//! memory, for the whole system (`/proc/pressure/memory`) and for the
//! target's cgroup (cgroup v2 `memory.pressure`), per slot.
//!
//! The totals are read every 20 ms by a thread of their own; a reading is
//! kept only when it differs from the one before (with that one, so that
//! the change is placed between the two readings and not spread over a
//! quiet minute), so a machine without memory pressure keeps two readings
//! whatever the session's length. A slot's share is the difference of the
//! totals at its ends, each interpolated between the readings around it:
//! within the 20 ms of a reading.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use serde::Serialize;

/// How often the totals are read.
pub const PERIOD: Duration = Duration::from_millis(20);
/// Readings kept at most (a machine under pressure the whole time: 33
/// minutes at 50 readings a second); the oldest go first.
const MAX_READINGS: usize = 100_000;

/// The "some" and "full" totals of one pressure file, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PsiTotals {
    pub some_us: u64,
    pub full_us: u64,
}

/// Parses a pressure file (`some avg10=0.00 avg60=0.00 avg300=0.00
/// total=123` and the same for `full`). `None` for anything else.
pub fn parse(text: &str) -> Option<PsiTotals> {
    let total = |kind: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.split_whitespace().next() == Some(kind))?;
        line.split_whitespace()
            .find_map(|w| w.strip_prefix("total="))?
            .parse()
            .ok()
    };
    Some(PsiTotals {
        some_us: total("some")?,
        // Kernels before 5.13 have no "full" line for some resources; a
        // memory file always has it, but a missing one reads as 0.
        full_us: total("full").unwrap_or(0),
    })
}

/// One reading: when, the system's totals, the cgroup's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reading {
    ns: u64,
    system: PsiTotals,
    cgroup: Option<PsiTotals>,
}

/// A slot's memory pressure: the time in it during which some (full: all)
/// non-idle tasks of the system (of the target's cgroup) were stalled on
/// memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SlotPressure {
    pub some_ms: f64,
    pub full_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup_some_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup_full_ms: Option<f64>,
}

/// PsiTotals at a time between readings (µs): the system's some and full,
/// the cgroup's.
type Interpolated = (f64, f64, Option<(f64, f64)>);

/// The readings, kept as described in the module's comment.
#[derive(Debug, Default)]
pub struct PsiLog {
    kept: VecDeque<Reading>,
    /// The newest reading (kept or not): the totals are known up to it.
    last: Option<Reading>,
    /// Readings dropped for room (said by the caller if ever non-zero).
    pub dropped: u64,
}

impl PsiLog {
    fn push(&mut self, r: Reading) {
        match self.last {
            Some(last) if last.system == r.system && last.cgroup == r.cgroup => {}
            Some(last) => {
                if self.kept.back() != Some(&last) {
                    self.keep(last);
                }
                self.keep(r);
            }
            None => self.keep(r),
        }
        self.last = Some(r);
    }

    fn keep(&mut self, r: Reading) {
        if self.kept.len() == MAX_READINGS {
            self.kept.pop_front();
            self.dropped += 1;
        }
        self.kept.push_back(r);
    }

    /// The totals at `ns`, interpolated; `None` outside the time read.
    fn at(&self, ns: u64) -> Option<Interpolated> {
        let last = self.last?;
        let first = self.kept.front()?;
        if ns < first.ns || ns > last.ns {
            return None;
        }
        let value = |r: &Reading| {
            (
                r.system.some_us as f64,
                r.system.full_us as f64,
                r.cgroup.map(|c| (c.some_us as f64, c.full_us as f64)),
            )
        };
        // The first kept reading after `ns`; none: constant since the last
        // kept one (every reading after it was the same).
        let i = self.kept.partition_point(|r| r.ns <= ns);
        let Some(after) = self.kept.get(i) else {
            return Some(value(self.kept.back()?));
        };
        let before = &self.kept[i - 1];
        let f = (ns - before.ns) as f64 / (after.ns - before.ns).max(1) as f64;
        let lerp = |a: f64, b: f64| a + (b - a) * f;
        let (b, a) = (value(before), value(after));
        Some((
            lerp(b.0, a.0),
            lerp(b.1, a.1),
            match (b.2, a.2) {
                (Some(x), Some(y)) => Some((lerp(x.0, y.0), lerp(x.1, y.1))),
                _ => None,
            },
        ))
    }

    /// The pressure in `[from, to)` (CLOCK_MONOTONIC ns); `None` when the
    /// totals were not read over the whole of it.
    pub fn over(&self, from: u64, to: u64) -> Option<SlotPressure> {
        let (a, b) = (self.at(from)?, self.at(to)?);
        let ms = |x: f64, y: f64| ((y - x).max(0.0) / 1e3 * 100.0).round() / 100.0;
        let cgroup = a.2.zip(b.2);
        Some(SlotPressure {
            some_ms: ms(a.0, b.0),
            full_ms: ms(a.1, b.1),
            cgroup_some_ms: cgroup.map(|(x, y)| ms(x.0, y.0)),
            cgroup_full_ms: cgroup.map(|(x, y)| ms(x.1, y.1)),
        })
    }

    /// Forgets what is before `ns` (slots up to there are done), keeping
    /// the reading that brackets it.
    pub fn forget_before(&mut self, ns: u64) {
        while self.kept.len() > 1 && self.kept[1].ns <= ns {
            self.kept.pop_front();
        }
    }
}

/// The target's cgroup v2 `memory.pressure`, when it has one of its own
/// (not the root's: that is the system's).
pub fn cgroup_file(pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    if path == "/" || path.is_empty() {
        return None;
    }
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .map(|root| {
            Path::new(root)
                .join(path.trim_start_matches('/'))
                .join("memory.pressure")
        })
        .find(|p| p.is_file())
}

/// A pressure file kept open and read from its start each time (one
/// `pread` into a buffer of its own: no open, close or allocation 50 times
/// a second).
struct PressureFile {
    file: std::fs::File,
    buf: [u8; 512],
}

impl PressureFile {
    fn open(path: &Path) -> Option<PressureFile> {
        let file = std::fs::File::open(path).ok()?;
        Some(PressureFile { file, buf: [0; 512] })
    }

    fn read(&mut self) -> Option<PsiTotals> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(&mut self.buf, 0).ok()?;
        parse(std::str::from_utf8(&self.buf[..n]).ok()?)
    }
}

/// The reading thread; stops when dropped.
pub struct PsiSampler {
    pub log: Arc<Mutex<PsiLog>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PsiSampler {
    /// Starts reading for target `pid`; `None` when the kernel has no PSI
    /// (CONFIG_PSI off, or `psi=0` on its command line).
    pub fn start(pid: u32) -> Option<PsiSampler> {
        let system = Path::new("/proc/pressure/memory");
        parse(&std::fs::read_to_string(system).ok()?)?;
        let cgroup = cgroup_file(pid);
        let log = Arc::new(Mutex::new(PsiLog::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, s) = (log.clone(), stop.clone());
        let mut system = PressureFile::open(system)?;
        let mut cgroup = cgroup.as_deref().and_then(PressureFile::open);
        let thread = std::thread::Builder::new()
            .name("slotprof-psi".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Some(sys) = system.read() {
                        let r = Reading {
                            ns: crate::sys::monotonic_ns(),
                            system: sys,
                            cgroup: cgroup.as_mut().and_then(PressureFile::read),
                        };
                        l.lock().unwrap().push(r);
                    }
                    std::thread::sleep(PERIOD);
                }
            })
            .ok()?;
        Some(PsiSampler {
            log,
            stop,
            thread: Some(thread),
        })
    }

    /// The pressure over `[from, to)`.
    pub fn over(&self, from: u64, to: u64) -> Option<SlotPressure> {
        self.log.lock().unwrap().over(from, to)
    }
}

impl Drop for PsiSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pressure_file_kept_open_reads_from_its_start_each_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.pressure");
        let text = |some: u64, full: u64| {
            format!(
                "some avg10=0.00 avg60=0.00 avg300=0.00 total={some}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total={full}\n"
            )
        };
        std::fs::write(&path, text(5, 2)).unwrap();
        let mut f = PressureFile::open(&path).unwrap();
        let expect = |some_us, full_us| Some(PsiTotals { some_us, full_us });
        assert_eq!(f.read(), expect(5, 2));
        assert_eq!(f.read(), expect(5, 2), "a second read starts over");
        // Rewritten in place, as the kernel's file is between reads.
        std::fs::write(&path, text(123_456_789, 42)).unwrap();
        assert_eq!(f.read(), expect(123_456_789, 42));
        std::fs::write(&path, "not a pressure file").unwrap();
        assert_eq!(f.read(), None);
        assert!(PressureFile::open(&dir.path().join("missing")).is_none());
    }

    fn r(ns: u64, some: u64, full: u64) -> Reading {
        Reading {
            ns,
            system: PsiTotals {
                some_us: some,
                full_us: full,
            },
            cgroup: None,
        }
    }

    #[test]
    fn parses_the_kernels_format_and_refuses_anything_else() {
        let text = "some avg10=1.50 avg60=0.20 avg300=0.05 total=15234\n\
                    full avg10=0.50 avg60=0.10 avg300=0.01 total=7000\n";
        assert_eq!(
            parse(text),
            Some(PsiTotals {
                some_us: 15234,
                full_us: 7000
            })
        );
        assert_eq!(parse("some total=5\n").map(|t| t.full_us), Some(0));
        for bad in [
            "",
            "garbage",
            "some total=-1",
            "some total=x\nfull total=1",
            "full total=3",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_slot_gets_the_stall_between_its_ends_and_quiet_time_keeps_two_readings() {
        let mut log = PsiLog::default();
        // Quiet for a second (50 readings), then 30 ms of stall between
        // two readings 20 ms apart, then quiet again.
        for i in 0..=50 {
            log.push(r(i * 20_000_000, 1000, 0));
        }
        log.push(r(1_020_000_000, 31_000, 10_000));
        for i in 52..=100 {
            log.push(r(i * 20_000_000, 31_000, 10_000));
        }
        assert_eq!(log.kept.len(), 3, "{:?}", log.kept);
        // The slot holding the change has all of it, the others none.
        let p = log.over(800_000_000, 1_200_000_000).unwrap();
        assert_eq!((p.some_ms, p.full_ms), (30.0, 10.0));
        assert_eq!(log.over(0, 800_000_000).unwrap().some_ms, 0.0);
        assert_eq!(log.over(1_200_000_000, 2_000_000_000).unwrap().some_ms, 0.0);
        // A boundary inside the 20 ms between the readings splits the
        // change in proportion.
        assert_eq!(log.over(0, 1_010_000_000).unwrap().some_ms, 15.0);
        // Outside the time read: unknown, not zero.
        assert_eq!(log.over(1_900_000_000, 2_100_000_000), None);
        log.forget_before(1_500_000_000);
        assert_eq!(log.over(1_500_000_000, 2_000_000_000).unwrap().some_ms, 0.0);
        assert_eq!(log.over(900_000_000, 1_100_000_000), None, "forgotten");
    }

    #[test]
    fn the_cgroup_is_reported_beside_the_system_when_read() {
        let mut log = PsiLog::default();
        let c = |ns: u64, some: u64| Reading {
            cgroup: Some(PsiTotals {
                some_us: some,
                full_us: some / 2,
            }),
            ..r(ns, some * 2, 0)
        };
        log.push(c(0, 0));
        log.push(c(100_000_000, 4000));
        let p = log.over(0, 100_000_000).unwrap();
        assert_eq!(
            (p.some_ms, p.cgroup_some_ms, p.cgroup_full_ms),
            (8.0, Some(4.0), Some(2.0))
        );
    }
}
