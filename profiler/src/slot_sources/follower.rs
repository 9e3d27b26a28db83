//! The RPC slot source's state machine: where slot numbers come from (the
//! websocket's notifications, `getSlot` polling, or nowhere while the RPC
//! is down), what each number is worth ([`Admission`]), and what is said,
//! once each. Pure: [`super::rpc::follow`] does the I/O and tells it what
//! happened and when (CLOCK_MONOTONIC ns); it answers what to do.
//!
//! ```text
//!            connected, websocket not failed in the last 60 s
//!   Down ─────────────────────────────────────────────────▶ Websocket
//!    ▲ │ connected, websocket failed < 60 s ago                │ silent 5 s, closed,
//!    │ ▼                                                       │ garbage, frame too large,
//!    │ Polling ◀───────────────────────────────────────────────┘ cannot connect
//!    │   │ 60 s after the websocket failed: Down -> connected -> Websocket
//!    └───┴─ an HTTP call fails (identity, schedule, getSlot): Down, backoff
//!           100 ms doubling to 5 s
//! ```
//!
//! In every state a number is admitted by [`Admission`]: a new slot is
//! taken; a repeat, a flood (under 1 ms after the last), a number below
//! the last taken or past 2^48 is dropped (the last two said once); a
//! jump is taken as a discontinuity (said once). Numbers that went
//! backwards are not re-numbered: the source is followed again when its
//! numbers pass the last one taken (the slots in between are estimated
//! and marked unaligned), since taking lower numbers would give a slot
//! number twice and overwrite an exported slot.

use std::time::Duration;

use super::{Admission, Admitted};

/// A websocket silent for this long has stopped (slots come every 400 ms).
pub const WS_SILENCE: Duration = Duration::from_secs(5);
/// After the websocket failed, getSlot is polled for this long before the
/// websocket is tried again.
pub const WS_RETRY: Duration = Duration::from_secs(60);
/// `getSlot` is polled no faster than this (or a twentieth of the
/// measured slot length when that is longer, up to [`MAX_POLL`]).
pub const MIN_POLL: Duration = Duration::from_millis(20);
pub const MAX_POLL: Duration = Duration::from_millis(100);
/// At most one leader-schedule fetch for a slot of an unknown epoch this
/// often (a hostile RPC announcing slots of ever new epochs is not fetched
/// from per slot).
pub const SCHEDULE_EVERY: Duration = Duration::from_secs(10);
/// Retry backoff after a failed HTTP call: from the first, doubling to the
/// last.
pub const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));
/// An outage this long after slots came is said (a blip, or the node
/// exiting with the session, is not).
const STOPPED_AFTER: Duration = Duration::from_secs(1);
/// No slot this long after the start is said.
const UNREACHABLE_AFTER: Duration = Duration::from_secs(2);

/// Where slot numbers come from now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Connecting (identity, schedule), or backing off after a failure.
    Down,
    /// The websocket's slot notifications.
    Websocket,
    /// `getSlot`, polled until the websocket is tried again.
    Polling,
}

/// What one event asks of the driver.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// A slot that starts now.
    pub take: Option<u64>,
    /// Warnings to say (stderr and the session's summary), each once.
    pub warnings: Vec<String>,
    /// The websocket is done with (it misbehaved): poll instead.
    pub leave_websocket: bool,
}

/// The state machine (see the module's diagram).
#[derive(Debug)]
pub struct Follower {
    mode: Mode,
    admission: Admission,
    started: u64,
    /// When the websocket last failed; getSlot is polled until
    /// [`WS_RETRY`] after it.
    ws_failed: Option<u64>,
    /// Why it failed, said once getSlot answers (when the HTTP RPC is down
    /// too, the node is: said as that, not as this).
    ws_unsaid: Option<String>,
    said_ws: bool,
    /// A number came in the current connected stretch / ever.
    got_slots: bool,
    ever_slots: bool,
    /// Since when the RPC has been failing (counted from the last slot).
    failing_since: u64,
    backoff: Duration,
    said_stopped: bool,
    said_unreachable: bool,
    last_fetch: Option<u64>,
    /// The last slot polled and when, for the poll interval.
    polled: Option<(u64, u64)>,
    poll_every: Duration,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

impl Follower {
    pub fn new(now: u64) -> Self {
        Self {
            mode: Mode::Down,
            admission: Admission::default(),
            started: now,
            ws_failed: None,
            ws_unsaid: None,
            said_ws: false,
            got_slots: false,
            ever_slots: false,
            failing_since: now,
            backoff: BACKOFF.0,
            said_stopped: false,
            said_unreachable: false,
            last_fetch: None,
            polled: None,
            poll_every: MIN_POLL,
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Numbers dropped (floods, backwards, impossible).
    pub fn dropped(&self) -> u64 {
        self.admission.dropped
    }

    /// The RPC answered identity and schedule: the websocket, unless it
    /// failed in the last [`WS_RETRY`] (then getSlot).
    pub fn connected(&mut self, now: u64) -> Mode {
        self.got_slots = false;
        self.polled = None;
        self.mode = if self
            .ws_failed
            .is_none_or(|t| now.saturating_sub(t) >= ns(WS_RETRY))
        {
            Mode::Websocket
        } else {
            Mode::Polling
        };
        self.mode
    }

    /// The websocket could not be reached: polled instead, tried again
    /// after [`WS_RETRY`] (not said: a node may serve no websocket, and
    /// polling gives the same slots).
    pub fn websocket_unreachable(&mut self, now: u64) {
        self.ws_failed = Some(now);
        self.mode = Mode::Polling;
    }

    /// One websocket text message.
    pub fn websocket_text(&mut self, text: &str, now: u64) -> Step {
        match super::rpc::notification_slot(text) {
            Ok(Some(slot)) => self.number(slot, now),
            Ok(None) => Step::default(),
            Err(e) => self.websocket_failed(&format!("{e:#}"), now),
        }
    }

    /// The websocket misbehaved (silent for [`WS_SILENCE`], closed, sent
    /// garbage or a frame too large): getSlot is polled instead.
    pub fn websocket_failed(&mut self, why: &str, now: u64) -> Step {
        self.ws_failed = Some(now);
        if !self.said_ws && self.ws_unsaid.is_none() {
            self.ws_unsaid = Some(why.to_string());
        }
        if std::mem::take(&mut self.got_slots) {
            // An outage of the whole RPC counts from here.
            self.slots_came(now);
        }
        self.mode = Mode::Polling;
        Step {
            leave_websocket: true,
            ..Step::default()
        }
    }

    /// Whether to poll again (else the websocket is due a new try).
    pub fn keep_polling(&self, now: u64) -> bool {
        self.mode == Mode::Polling
            && (self
                .ws_failed
                .is_none_or(|t| now.saturating_sub(t) < ns(WS_RETRY)))
    }

    /// How long to wait before the next getSlot.
    pub fn poll_every(&self) -> Duration {
        self.poll_every
    }

    /// getSlot answered `slot`.
    pub fn polled(&mut self, slot: u64, now: u64) -> Step {
        let mut warnings = Vec::new();
        if let Some(why) = self.ws_unsaid.take() {
            self.said_ws = true;
            warnings.push(format!(
                "the slot source's websocket failed ({why}); slots come from getSlot polling \
                 instead (the websocket is tried again every {} s); said once",
                WS_RETRY.as_secs()
            ));
        }
        let mut step = Step::default();
        if self.polled.is_none_or(|(s, _)| s != slot) {
            if let Some((s, t)) = self.polled.filter(|&(s, _)| slot > s) {
                let slot_ns = now.saturating_sub(t) / (slot - s);
                self.poll_every = MIN_POLL.max(Duration::from_nanos(slot_ns / 20)).min(MAX_POLL);
            }
            self.polled = Some((slot, now));
            step = self.number(slot, now);
        }
        warnings.append(&mut step.warnings);
        step.warnings = warnings;
        step
    }

    /// A slot number from either side, through admission.
    fn number(&mut self, slot: u64, now: u64) -> Step {
        self.got_slots = true;
        let (verdict, warning) = self.admission.admit(slot, now);
        Step {
            take: (verdict == Admitted::Take).then_some(slot),
            warnings: warning.into_iter().collect(),
            leave_websocket: false,
        }
    }

    /// Whether to fetch the leader schedule for a slot of an epoch not
    /// known yet (at most once every [`SCHEDULE_EVERY`]).
    pub fn fetch_schedule(&mut self, now: u64) -> bool {
        let due = self
            .last_fetch
            .is_none_or(|t| now.saturating_sub(t) >= ns(SCHEDULE_EVERY));
        if due {
            self.last_fetch = Some(now);
        }
        due
    }

    fn slots_came(&mut self, now: u64) {
        self.ever_slots = true;
        self.backoff = BACKOFF.0;
        self.failing_since = now;
    }

    /// An HTTP call failed (`why`; `url` names the RPC): Down. The warning
    /// to say (once for an RPC that never gave slots, once for one that
    /// stopped), and how long to wait before connecting again.
    pub fn rpc_failed(&mut self, why: &str, url: &str, now: u64) -> (Option<String>, Duration) {
        self.mode = Mode::Down;
        if std::mem::take(&mut self.got_slots) {
            self.slots_came(now);
        }
        let outage = now.saturating_sub(self.failing_since);
        let warning = if self.ever_slots && !self.said_stopped && outage > ns(STOPPED_AFTER) {
            self.said_stopped = true;
            Some(format!(
                "the slot source rpc={url} stopped answering ({why}); profiling goes on, and the \
                 slots from here are estimated from the measured slot length and marked unaligned; \
                 retrying with backoff"
            ))
        } else if !self.ever_slots
            && !self.said_unreachable
            && now.saturating_sub(self.started) > ns(UNREACHABLE_AFTER)
        {
            self.said_unreachable = true;
            Some(format!(
                "the slot source rpc={url} answers with no slots ({why}); profiling goes on without slot \
                 boundaries until it does (is the validator's RPC enabled on that port?); retrying \
                 with backoff"
            ))
        } else {
            None
        };
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF.1);
        (warning, wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    fn note(slot: u64) -> String {
        format!(
            r#"{{"jsonrpc":"2.0","method":"slotNotification","params":{{"result":{{"parent":{},"root":0,"slot":{slot}}},"subscription":0}}}}"#,
            slot.saturating_sub(1)
        )
    }

    const URL: &str = "http://127.0.0.1:8899";

    #[test]
    fn healthy_websocket_takes_each_notified_slot_and_ignores_other_messages() {
        let mut f = Follower::new(0);
        assert_eq!(f.mode(), Mode::Down);
        assert_eq!(f.connected(0), Mode::Websocket);
        assert_eq!(
            f.websocket_text(r#"{"jsonrpc":"2.0","result":3,"id":1}"#, MS),
            Step::default()
        );
        for (i, slot) in (100..110).enumerate() {
            let step = f.websocket_text(&note(slot), (i as u64 + 1) * 400 * MS);
            assert_eq!(step.take, Some(slot));
            assert!(step.warnings.is_empty() && !step.leave_websocket, "{step:?}");
        }
        assert_eq!(f.mode(), Mode::Websocket);
        assert_eq!(f.dropped(), 0);
    }

    #[test]
    fn silent_closed_garbled_or_oversized_websocket_falls_to_polling_said_once_when_getslot_answers() {
        for why in ["silent", "closed", "garbage", "too large"] {
            let mut f = Follower::new(0);
            f.connected(0);
            assert_eq!(f.websocket_text(&note(100), 400 * MS).take, Some(100));
            let step = if why == "garbage" {
                f.websocket_text("garbage{", 800 * MS)
            } else {
                f.websocket_failed(why, 5 * S)
            };
            assert!(
                step.leave_websocket && step.take.is_none() && step.warnings.is_empty(),
                "{why}: {step:?}"
            );
            assert_eq!(f.mode(), Mode::Polling, "{why}");
            // Reconnecting within the minute: polling again, not the websocket.
            assert_eq!(f.connected(6 * S), Mode::Polling, "{why}");
            let step = f.polled(101, 6 * S + 400 * MS);
            assert_eq!(step.take, Some(101), "{why}");
            assert_eq!(step.warnings.len(), 1, "{why}: {step:?}");
            assert!(step.warnings[0].contains("websocket failed"), "{why}: {step:?}");
            let w = if why == "garbage" { "not JSON" } else { why };
            assert!(step.warnings[0].contains(w), "{why}: {step:?}");
            // Said once, also across a second failure.
            assert!(f.polled(102, 6 * S + 800 * MS).warnings.is_empty());
            assert!(f.keep_polling(60 * S), "{why}");
            assert!(!f.keep_polling(66 * S), "{why}: the websocket is due a new try");
            assert_eq!(f.connected(66 * S), Mode::Websocket, "{why}");
            f.websocket_failed("again", 67 * S);
            assert!(f.polled(103, 67 * S + 400 * MS).warnings.is_empty(), "{why}");
        }
    }

    #[test]
    fn an_unreachable_websocket_is_polled_without_a_word_and_retried_after_a_minute() {
        let mut f = Follower::new(0);
        f.connected(0);
        f.websocket_unreachable(MS);
        assert_eq!(f.mode(), Mode::Polling);
        let step = f.polled(100, 2 * MS);
        assert_eq!((step.take, step.warnings.len()), (Some(100), 0));
        assert!(f.keep_polling(59 * S));
        assert!(!f.keep_polling(61 * S));
    }

    #[test]
    fn a_websocket_and_rpc_that_die_together_are_said_as_the_rpc_stopping_not_the_websocket() {
        let mut f = Follower::new(0);
        f.connected(0);
        f.websocket_text(&note(100), 400 * MS);
        f.websocket_failed("closed", 800 * MS);
        let (w, _) = f.rpc_failed("getIdentity: connection refused", URL, 900 * MS);
        assert_eq!(w, None, "a blip under a second is not said");
        let (w, _) = f.rpc_failed("getIdentity: connection refused", URL, 2 * S);
        let w = w.expect("an outage over a second is said");
        assert!(
            w.contains("stopped answering") && w.contains("connection refused"),
            "{w}"
        );
        assert_eq!(f.rpc_failed("x", URL, 3 * S).0, None, "said once");
        assert_eq!(f.mode(), Mode::Down);
    }

    #[test]
    fn an_rpc_that_never_gives_slots_is_said_once_after_two_seconds_and_backed_off_doubling_to_5_s() {
        let mut f = Follower::new(0);
        let mut waits = Vec::new();
        let mut said = Vec::new();
        let mut now = 0;
        for _ in 0..10 {
            let (w, wait) = f.rpc_failed("getSlot: an answer of the wrong shape", URL, now);
            said.extend(w);
            waits.push(wait.as_millis() as u64);
            now += ns(wait);
        }
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].contains("answers with no slots") && said[0].contains("wrong shape"));
        // Slots come: the backoff starts over.
        f.connected(now);
        f.websocket_text(&note(7), now + MS);
        assert_eq!(f.rpc_failed("x", URL, now + 2 * MS).1, BACKOFF.0);
    }

    #[test]
    fn a_flood_is_dropped_past_one_slot_a_millisecond_and_the_websocket_kept() {
        let mut f = Follower::new(0);
        f.connected(0);
        let mut taken = 0;
        // 10,000 notifications of new slots within 100 ms.
        for i in 0..10_000u64 {
            let step = f.websocket_text(&note(1_000 + i), i * 10_000);
            taken += step.take.is_some() as u64;
            assert!(!step.leave_websocket);
        }
        assert!((90..=101).contains(&taken), "{taken} of a 100 ms flood taken");
        assert_eq!(f.dropped(), 10_000 - taken);
        assert_eq!(f.mode(), Mode::Websocket);
    }

    #[test]
    fn backwards_numbers_are_dropped_said_once_and_followed_again_once_past_the_last_taken() {
        let mut f = Follower::new(0);
        f.connected(0);
        assert_eq!(f.websocket_text(&note(500), 400 * MS).take, Some(500));
        let step = f.websocket_text(&note(200), 800 * MS);
        assert_eq!(step.take, None);
        assert!(
            step.warnings[0].contains("went backwards, from slot 500 to 200"),
            "{step:?}"
        );
        for (i, slot) in (201..=500).enumerate() {
            let step = f.websocket_text(&note(slot), (i as u64 + 3) * 400 * MS);
            assert_eq!((step.take, step.warnings.len()), (None, 0), "{slot}");
        }
        assert_eq!(f.websocket_text(&note(501), 200 * S).take, Some(501));
        assert_eq!(f.dropped(), 300, "200..=499 (500 is the slot taken)");
    }

    #[test]
    fn a_jump_is_taken_as_a_discontinuity_said_once_and_impossible_numbers_dropped() {
        let mut f = Follower::new(0);
        f.connected(0);
        f.websocket_text(&note(100), 400 * MS);
        let step = f.websocket_text(&note(1_000_000_000), 800 * MS);
        assert_eq!(step.take, Some(1_000_000_000));
        assert!(
            step.warnings[0].starts_with(super::super::JUMP_WARNING),
            "{step:?}"
        );
        assert!(f
            .websocket_text(&note(2_000_000_000), 1200 * MS)
            .warnings
            .is_empty());
        let step = f.websocket_text(&note(u64::MAX), 1600 * MS);
        assert_eq!(step.take, None);
        assert!(step.warnings[0].contains("past any real slot"), "{step:?}");
        let m = "{\"method\":\"slotNotification\",\"params\":{\"result\":{\"slot\":18446744073709551616}}}";
        assert!(
            f.websocket_text(m, 2 * S).leave_websocket,
            "a number past u64 is garbage"
        );
    }

    #[test]
    fn getslot_polling_takes_each_new_slot_once_and_paces_itself_by_the_slot_length() {
        let mut f = Follower::new(0);
        f.connected(0);
        f.websocket_unreachable(0);
        assert_eq!(f.poll_every(), MIN_POLL);
        let mut taken = Vec::new();
        // A slot every 400 ms, polled every 20 ms.
        for t in (0..4_000 * MS).step_by(20 * MS as usize) {
            taken.extend(f.polled(1_000 + t / (400 * MS), t).take);
        }
        assert_eq!(taken, (1_000..1_010).collect::<Vec<_>>());
        assert_eq!(f.poll_every(), Duration::from_millis(20));
        // Slots of 2 s: polled every 100 ms at most.
        f.polled(2_000, 10 * S);
        f.polled(2_001, 12 * S);
        assert_eq!(f.poll_every(), MAX_POLL);
    }

    #[test]
    fn the_schedule_of_an_unknown_epoch_is_fetched_at_most_every_10_s() {
        let mut f = Follower::new(0);
        let asked: Vec<bool> = [0, S, 9 * S, 10 * S, 11 * S, 25 * S]
            .iter()
            .map(|&t| f.fetch_schedule(t))
            .collect();
        assert_eq!(asked, [true, false, false, true, false, true]);
    }
}
