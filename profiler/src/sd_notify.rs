//! systemd's notification protocol, for `Type=notify` units: a datagram of
//! `KEY=VALUE` lines to the socket named by `$NOTIFY_SOCKET` (a path, or
//! an abstract name after `@`). Outside systemd the variable is unset and
//! every call does nothing.
//!
//! `slotprof run` says READY=1 once its probes are attached to the target
//! (or, with no target yet, once it waits for one with everything else
//! set up), RELOADING=1 then READY=1 around a SIGHUP, STOPPING=1 at the
//! end, STATUS= lines for `systemctl status`, and WATCHDOG=1 from its main
//! loop when the unit sets `WatchdogSec` (a loop that hangs is restarted).

use std::{
    os::{linux::net::SocketAddrExt, unix::net::UnixDatagram},
    time::{Duration, Instant},
};

/// Sends `state` (newline-separated `KEY=VALUE` lines); false when there is
/// no systemd to tell, or it could not be told.
pub fn notify(state: &str) -> bool {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let Ok(socket) = UnixDatagram::unbound() else {
        return false;
    };
    let bytes = path.as_encoded_bytes();
    match bytes.strip_prefix(b"@") {
        Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|addr| socket.send_to_addr(state.as_bytes(), &addr))
            .is_ok(),
        None => socket.send_to(state.as_bytes(), &path).is_ok(),
    }
}

/// `MONOTONIC_USEC=` for RELOADING=1 (CLOCK_MONOTONIC, microseconds).
pub fn monotonic_usec() -> u64 {
    crate::slots::monotonic_ns() / 1_000
}

/// Pings systemd's watchdog at half the unit's `WatchdogSec`
/// (`$WATCHDOG_USEC`), from the loop whose progress it vouches for.
pub struct Watchdog {
    every: Option<Duration>,
    last: Option<Instant>,
}

impl Watchdog {
    pub fn from_env() -> Self {
        let usec = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|v| v.parse::<u64>().ok());
        // WATCHDOG_PID, when set, names the process meant.
        let ours = std::env::var("WATCHDOG_PID")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .is_none_or(|pid| pid == std::process::id());
        Self {
            every: usec
                .filter(|&u| u > 0 && ours)
                .map(|u| Duration::from_micros(u / 2)),
            last: None,
        }
    }

    pub fn ping(&mut self) {
        let Some(every) = self.every else { return };
        if self.last.is_none_or(|t| t.elapsed() >= every) {
            notify("WATCHDOG=1");
            self.last = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_reaches_a_socket_by_path_and_by_abstract_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        // This test alone sets NOTIFY_SOCKET in this process.
        std::env::set_var("NOTIFY_SOCKET", &path);
        assert!(notify("READY=1\nSTATUS=profiling x"));
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=profiling x");
        let name = format!("slotprof-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        std::env::set_var("NOTIFY_SOCKET", format!("@{name}"));
        assert!(notify("STOPPING=1"));
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
        std::env::remove_var("NOTIFY_SOCKET");
        assert!(!notify("READY=1"));
    }
}
