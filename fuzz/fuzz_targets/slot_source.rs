//! The RPC slot source as a hostile node drives it: raw websocket bytes
//! from the server (frames read with slotprof's limits, each text message
//! handed to the state machine), getSlot answers, failures and time, in
//! any order. Panics, hangs and unbounded allocations are failures, and so
//! is any broken promise of the machine: slots taken only upwards, at most
//! one a millisecond, never past 2^48; each kind of warning said at most
//! once; the backoff within 100 ms..5 s, the poll interval within
//! 20..100 ms; the mode what the last event makes it.
#![no_main]

use std::{
    io::{Cursor, Read, Write},
    time::Duration,
};

use libfuzzer_sys::fuzz_target;
use profiler::slot_sources::{
    follower::{Follower, Mode, Step, BACKOFF, MAX_POLL, MIN_POLL},
    rpc::{tungstenite, ws_config},
    MAX_SLOT, MIN_SLOT_NS,
};

/// A server's bytes to read; what the client writes (pongs, its close) is
/// dropped.
struct Replay(Cursor<Vec<u8>>);

impl Read for Replay {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Replay {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The warnings, each said at most once, by how they begin (a quoted
/// answer inside one may say anything).
const ONCE: [&str; 6] = [
    "the slot source's websocket failed (",
    "the slot source went backwards, from slot ",
    "the slot source gave slot ",
    "the slot source jumped from slot ",
    "the slot source rpc=http://x:1 stopped answering (",
    "the slot source rpc=http://x:1 answers with no slots (",
];

#[derive(Default)]
struct Watch {
    last_taken: Option<(u64, u64)>,
    said: [u32; ONCE.len()],
}

impl Watch {
    fn step(&mut self, s: Step, now: u64) {
        if let Some(slot) = s.take {
            assert!(slot <= MAX_SLOT, "took {slot}");
            if let Some((last, t)) = self.last_taken {
                assert!(slot > last, "took {slot} after {last}");
                assert!(now - t >= MIN_SLOT_NS, "two slots {} ns apart", now - t);
            }
            self.last_taken = Some((slot, now));
        }
        self.warnings(&s.warnings);
    }
    fn warnings(&mut self, warnings: &[String]) {
        for w in warnings {
            let i = ONCE
                .iter()
                .position(|p| w.starts_with(p))
                .unwrap_or_else(|| panic!("a warning of no known kind: {w}"));
            self.said[i] += 1;
            assert!(self.said[i] <= 1, "said twice: {w}");
        }
    }
}

fn u64_at(data: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    for (k, x) in data.iter().skip(i).take(8).enumerate() {
        b[k] = *x;
    }
    u64::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    let mut f = Follower::new(0);
    let mut w = Watch::default();
    let mut now = 0u64;
    let mut i = 0;
    while i < data.len() {
        let op = data[i];
        i += 1;
        // Time goes on between events: 0..65 ms, or seconds.
        now += match op >> 4 {
            0..=11 => u64::from(op >> 4) * 6_000_000,
            n => u64::from(n) * 10_000_000_000,
        };
        match op & 7 {
            0 => {
                // Raw websocket bytes: a length, then that many.
                let n = (u64_at(data, i) & 0xffff) as usize;
                let bytes = data.get(i + 2..).unwrap_or_default();
                let bytes = bytes[..n.min(bytes.len())].to_vec();
                i += 2 + bytes.len();
                let mut ws = tungstenite::WebSocket::from_raw_socket(
                    Replay(Cursor::new(bytes)),
                    tungstenite::protocol::Role::Client,
                    Some(ws_config()),
                );
                f.connected(now);
                loop {
                    let s = match ws.read() {
                        Ok(tungstenite::Message::Text(t)) => f.websocket_text(t.as_str(), now),
                        Ok(_) => continue,
                        Err(e) => f.websocket_failed(&e.to_string(), now),
                    };
                    let leave = s.leave_websocket;
                    w.step(s, now);
                    if leave {
                        assert_eq!(f.mode(), Mode::Polling);
                        break;
                    }
                    now += 100_000;
                }
            }
            1 => {
                let slot = u64_at(data, i);
                i += 8;
                let s = f.polled(slot, now);
                w.step(s, now);
                assert!((MIN_POLL..=MAX_POLL).contains(&f.poll_every()));
            }
            2 => {
                let (said, wait) = f.rpc_failed("getSlot: connection refused", "http://x:1", now);
                w.warnings(&said.into_iter().collect::<Vec<_>>());
                assert!((BACKOFF.0..=BACKOFF.1).contains(&wait), "{wait:?}");
                assert_eq!(f.mode(), Mode::Down);
                now += wait.as_nanos() as u64;
            }
            3 => {
                let m = f.connected(now);
                assert!(m == Mode::Websocket || m == Mode::Polling);
            }
            4 => f.websocket_unreachable(now),
            5 => {
                // A text message as it came.
                let n = usize::from(data.get(i).copied().unwrap_or(0));
                let text = String::from_utf8_lossy(data.get(i + 1..i + 1 + n).unwrap_or_default());
                i += 1 + n;
                let s = f.websocket_text(&text, now);
                w.step(s, now);
            }
            6 => {
                // The next slot, or a small step either way.
                let base = w.last_taken.map_or(1_000, |(s, _)| s);
                let delta = i64::from(data.get(i).copied().unwrap_or(1) as i8);
                i += 1;
                let s = f.polled(base.saturating_add_signed(delta), now);
                w.step(s, now);
            }
            _ => {
                let _ = f.keep_polling(now);
                let _ = f.fetch_schedule(now);
                now += Duration::from_secs(61).as_nanos() as u64;
            }
        }
    }
});
