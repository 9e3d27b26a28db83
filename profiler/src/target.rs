//! The process being profiled.

use std::path::PathBuf;

use anyhow::bail;

/// What we know about the target process.
#[derive(Clone, Debug)]
pub struct Target {
    pub pid: u32,
    /// Its main thread's name.
    pub comm: String,
    /// Its executable, if readable.
    pub exe: Option<PathBuf>,
    /// Start time in clock ticks after boot (field 22 of /proc/PID/stat):
    /// with the pid it names the process even after the pid is reused.
    start_ticks: u64,
}

impl Target {
    /// Looks `pid` up; a pid with no live process is an error that says so.
    pub fn from_pid(pid: u32) -> anyhow::Result<Self> {
        let Some((state, start_ticks)) = stat(pid) else {
            bail!("no process with pid {pid}: check the pid (e.g. `pgrep -f agave-validator`)");
        };
        if state == 'Z' || state == 'X' {
            bail!("process {pid} has already exited (it is a zombie waiting for its parent)");
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|s| s.trim_end().to_string())
            .unwrap_or_default();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        Ok(Self {
            pid,
            comm,
            exe,
            start_ticks,
        })
    }

    /// Whether the process still runs (not gone, not a zombie, not a new
    /// process that reused the pid).
    pub fn is_alive(&self) -> bool {
        match stat(self.pid) {
            Some((state, start)) => start == self.start_ticks && state != 'Z' && state != 'X',
            None => false,
        }
    }
}

/// State letter and start time from /proc/PID/stat.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The comm field may hold spaces and parentheses: split after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let state = fields.first()?.chars().next()?;
    // Field 22 overall is index 19 after pid and comm.
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_is_alive_and_missing_pid_says_so() {
        let me = Target::from_pid(std::process::id()).unwrap();
        assert!(me.is_alive());
        assert!(me.exe.is_some());
        let err = Target::from_pid(u32::MAX - 1).unwrap_err().to_string();
        assert!(err.contains("no process with pid"), "{err}");
    }
}
