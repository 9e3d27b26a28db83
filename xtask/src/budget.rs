//! The time `cargo xtask test` may take, and what each part of it took.
//!
//! CI stops a run at 90 minutes, set-up and cold build included, and a run
//! stopped there reports nothing at all: not the tests that passed, not
//! the one that failed. With a budget (`SLOTPROF_TEST_BUDGET_S` seconds,
//! counted from `SLOTPROF_TEST_STARTED`, a Unix time, when set: `.ci/run`
//! sets both) a part that would not finish inside what is left is not
//! started: its tests are SKIPPED rows that say so and name the command
//! that runs them, and a failed test is run again (to tell a flaky one)
//! only when the time is there. Without a budget everything runs.
//!
//! Every part says how long it took and how long the run has taken, so a
//! slow run shows where its time went.

use std::{
    sync::OnceLock,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

pub struct Budget {
    started: Instant,
    total: Option<Duration>,
}

static BUDGET: OnceLock<Budget> = OnceLock::new();

/// The run's budget, read from the environment once.
pub fn get() -> &'static Budget {
    BUDGET.get_or_init(|| {
        let now = Instant::now();
        let total = std::env::var("SLOTPROF_TEST_BUDGET_S")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&s| s > 0)
            .map(Duration::from_secs);
        // Time already spent before xtask ran (building xtask itself).
        let before = std::env::var("SLOTPROF_TEST_STARTED")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .and_then(|at| {
                let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
                now.checked_sub(at)
            })
            .map(Duration::from_secs)
            .unwrap_or_default();
        Budget {
            started: now.checked_sub(before).unwrap_or(now),
            total,
        }
    })
}

impl Budget {
    /// Time since the run started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Time left, or None without a budget.
    pub fn left(&self) -> Option<Duration> {
        self.total.map(|t| t.saturating_sub(self.elapsed()))
    }

    /// Whether a part expected to take `need` fits; Err says why not.
    pub fn fits(&self, need: Duration) -> Result<(), String> {
        fits(self.left(), need, self.total)
    }

    /// Says how long a part took and where the run stands.
    pub fn took(&self, part: &str, since: Instant) {
        let left = self
            .left()
            .map(|l| format!(", {} s of the budget left", l.as_secs()))
            .unwrap_or_default();
        eprintln!(
            "xtask: time: {part} took {:.0} s; the run {:.0} s so far{left}",
            since.elapsed().as_secs_f64(),
            self.elapsed().as_secs_f64()
        );
    }
}

fn fits(left: Option<Duration>, need: Duration, total: Option<Duration>) -> Result<(), String> {
    match (left, total) {
        (Some(left), Some(total)) if left < need => Err(format!(
            "not started: it takes about {} s and {} s of the test budget (SLOTPROF_TEST_BUDGET_S={}) are left",
            need.as_secs(),
            left.as_secs(),
            total.as_secs()
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_fits_when_the_budget_has_its_time_or_there_is_no_budget() {
        let s = Duration::from_secs;
        assert!(fits(None, s(10_000), None).is_ok());
        assert!(fits(Some(s(600)), s(500), Some(s(5000))).is_ok());
        let no = fits(Some(s(400)), s(500), Some(s(5000))).unwrap_err();
        assert!(
            no.contains("about 500 s") && no.contains("400 s") && no.contains("=5000"),
            "{no}"
        );
    }
}
