//! The threads whose every off-CPU interval the kernel reports, never
//! folded (`--offcpu folded`, see `profiler_ebpf::OffCpuFold`): the ones
//! a detector reads interval by interval. The main thread, the
//! `--hot-thread` names and the `--loop-thread` (a name or a tid), looked
//! for in `/proc`; the loop uprobe's thread adds itself in the kernel.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use crate::{
    detectors::{DetectorConfig, LoopThread},
    kernel::probes::Probes,
};

/// How often the target's threads are looked through for new ones with
/// the names.
const RESCAN: Duration = Duration::from_secs(2);

/// See the module doc.
pub(crate) struct ExactThreads {
    pid: u32,
    /// Thread names to look for.
    names: Vec<String>,
    /// Tids known without looking: the main thread, a `--loop-thread` tid.
    fixed: BTreeSet<u32>,
    /// What the kernel's set has been given (it only grows: a thread that
    /// exits leaves its tid, which costs nothing).
    given: BTreeSet<u32>,
    scanned: Option<Instant>,
    full_said: bool,
}

impl ExactThreads {
    pub(crate) fn new(pid: u32, config: &DetectorConfig) -> Self {
        let mut names = config.hot_threads.clone();
        let mut fixed = BTreeSet::from([pid]);
        match &config.loop_thread {
            Some(LoopThread::Name(n)) => names.push(n.clone()),
            Some(LoopThread::Tid(t)) => {
                fixed.insert(*t);
            }
            None => {}
        }
        Self {
            pid,
            names,
            fixed,
            given: BTreeSet::new(),
            scanned: None,
            full_said: false,
        }
    }

    /// The threads to give the kernel before its programs are attached
    /// (`ProbeConfig::exact_tids`): looked for now, and counted as given.
    pub(crate) fn initial(&mut self) -> BTreeSet<u32> {
        self.scanned = Some(Instant::now());
        let mut want = self.fixed.clone();
        if !self.names.is_empty() {
            want.extend(threads_named(self.pid, &self.names));
        }
        self.given.extend(want.iter().copied());
        want
    }

    /// At most every [`RESCAN`]: gives the kernel the threads it does not
    /// have yet.
    pub(crate) fn refresh(&mut self, probes: &mut Probes) {
        if self.scanned.is_some_and(|t| t.elapsed() < RESCAN) {
            return;
        }
        self.scanned = Some(Instant::now());
        let mut want = self.fixed.clone();
        if !self.names.is_empty() {
            want.extend(threads_named(self.pid, &self.names));
        }
        let new: BTreeSet<u32> = want.difference(&self.given).copied().collect();
        if new.is_empty() {
            return;
        }
        let refused = probes.add_exact_threads(&new);
        if !refused.is_empty() && !self.full_said {
            self.full_said = true;
            eprintln!(
                "slotprof: warning: {} thread(s) the detectors read ({refused:?}) could not be marked exact \
                 (the kernel's map of them is full): their short waits are folded; --offcpu exact reports \
                 every interval",
                refused.len()
            );
        }
        self.given.extend(new);
    }
}

/// The tids of `pid`'s threads named one of `names`.
fn threads_named(pid: u32, names: &[String]) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let tid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            names.iter().any(|n| n == comm.trim_end()).then_some(tid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_main_thread_a_loop_tid_and_names_are_what_is_looked_for() {
        let config = DetectorConfig {
            hot_threads: vec!["banking".into()],
            loop_thread: Some(LoopThread::Tid(77)),
            ..Default::default()
        };
        let e = ExactThreads::new(40, &config);
        assert_eq!(e.fixed, BTreeSet::from([40, 77]));
        assert_eq!(e.names, ["banking"]);
        let config = DetectorConfig {
            loop_thread: Some(LoopThread::Name("solPohTickProd".into())),
            ..Default::default()
        };
        let e = ExactThreads::new(40, &config);
        assert_eq!(e.fixed, BTreeSet::from([40]));
        assert_eq!(e.names, ["solPohTickProd"]);
    }

    #[test]
    fn threads_are_found_by_name_in_proc() {
        let me = std::process::id();
        let name = std::fs::read_to_string(format!("/proc/{me}/task/{me}/comm")).unwrap();
        let found = threads_named(me, &[name.trim_end().to_string()]);
        assert!(found.contains(&me), "{found:?}");
        assert!(threads_named(me, &["no-such-thread-name".into()]).is_empty());
    }
}
