//! Slot sources: where slot boundaries and the leader schedule come from
//! while a session runs. Each source appends what it sees to a shared
//! [`SlotLog`]; at the end [`SlotLog::timeline`] turns it into the
//! [`Timeline`] that everything is cut along.
//!
//! Here: the RPC follower ([`rpc`], its state machine [`follower`]), what became of the leader slots'
//! blocks ([`blocks`]), the slot log, and the parsed
//! `--slot-source` ([`SlotSourceSpec`]). Not here: the timeline and its
//! bucketing (`slots`), and the slot uprobe, which is one of the probes
//! (`probes`, marks decoded by `events`).

pub mod blocks;
pub mod follower;
pub mod rpc;
mod source_spec;

pub use source_spec::{SlotNumbers, SlotSourceSpec};

use std::sync::{Arc, Mutex};

use crate::slots::{Slot, Timeline, SLOTS_PER_WINDOW};

/// The leader slots of one epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EpochSchedule {
    pub first_slot: u64,
    pub slots_in_epoch: u64,
    /// The slots this node leads as runs `[start, end)` of consecutive
    /// absolute slot numbers, sorted ([`leader_runs`] builds them): a node
    /// that leads every slot of a 432,000-slot epoch (a one-node cluster)
    /// is one run, not 3.3 MiB of slot numbers kept all session.
    pub leader_runs: Vec<(u64, u64)>,
}

impl EpochSchedule {
    /// Whether `slot` is in this epoch (no overflow whatever the RPC said).
    pub fn contains(&self, slot: u64) -> bool {
        slot >= self.first_slot && slot - self.first_slot < self.slots_in_epoch
    }
}

/// The most slots filled in between two sightings of the source (about an
/// hour of 400 ms slots), and the shortest a filled-in slot may be: a jump
/// beyond either (an RPC answering a slot 10^12 ahead, a node replaying
/// far behind) is a discontinuity, not a run of estimated slots.
pub const MAX_FILL_SLOTS: u64 = 10_000;
pub const MIN_SLOT_NS: u64 = 1_000_000;

/// Whether `slots` slots can have started in `ns` nanoseconds.
pub fn plausible_advance(slots: u64, ns: u64) -> bool {
    slots <= MAX_FILL_SLOTS && slots.saturating_sub(1).saturating_mul(MIN_SLOT_NS) <= ns
}

/// How a discontinuity is said (once a session).
pub const JUMP_WARNING: &str = "the slot source jumped";

/// The largest slot number a source may give: 2^48 slots of 400 ms are
/// 3.5 million years; anything above it (u64::MAX from a hostile RPC,
/// whose estimated successors wrapped to 0, 1, 2, ...) is no slot.
pub const MAX_SLOT: u64 = 1 << 48;

/// What becomes of one slot number a source announced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admitted {
    /// A new slot: it starts now.
    Take,
    /// The slot already taken (polling sees each slot many times).
    Same,
    /// Lower than the last slot taken: dropped (said once).
    Backwards { last: u64 },
    /// Within [`MIN_SLOT_NS`] of the last slot taken: a flood, dropped
    /// (counted); no slot is that short.
    TooSoon,
    /// Above [`MAX_SLOT`]: dropped (said once).
    Implausible,
}

/// Admits slot numbers from a source, one at a time, keeping the last
/// taken: the one place a source's numbers are judged (issue 42: a flood
/// of notifications held the session's stop for over a minute, numbers
/// going backwards made the session one slot of 1 ns, u64::MAX wrapped).
#[derive(Clone, Debug, Default)]
pub struct Admission {
    /// (slot, CLOCK_MONOTONIC ns) of the last slot taken.
    last: Option<(u64, u64)>,
    /// Numbers dropped as a flood, backwards or implausible.
    pub dropped: u64,
    said_backwards: bool,
    said_implausible: bool,
    said_jump: bool,
}

impl Admission {
    /// Judges `slot`, announced at `now`; the warning to say, once each
    /// kind a session, when there is one.
    pub fn admit(&mut self, slot: u64, now: u64) -> (Admitted, Option<String>) {
        let verdict = match self.last {
            _ if slot > MAX_SLOT => Admitted::Implausible,
            None => Admitted::Take,
            Some((last, _)) if slot == last => Admitted::Same,
            Some((last, _)) if slot < last => Admitted::Backwards { last },
            Some((_, t)) if now.saturating_sub(t) < MIN_SLOT_NS => Admitted::TooSoon,
            Some(_) => Admitted::Take,
        };
        let mut warning = None;
        match verdict {
            Admitted::Take => {
                if let Some((last, t)) = self.last {
                    let ns = now.saturating_sub(t);
                    if !plausible_advance(slot - last, ns) && !std::mem::replace(&mut self.said_jump, true) {
                        warning = Some(format!(
                            "{JUMP_WARNING} from slot {last} to {slot} in {} ms: taken as a discontinuity \
                             (no slots are filled in between); said once",
                            ns / 1_000_000
                        ));
                    }
                }
                self.last = Some((slot, now));
            }
            Admitted::Same => {}
            Admitted::Backwards { last } => {
                self.dropped += 1;
                if !std::mem::replace(&mut self.said_backwards, true) {
                    warning = Some(format!(
                        "the slot source went backwards, from slot {last} to {slot}: slot numbers below \
                         the last one taken are dropped (is the RPC another node's, or did the node \
                         restart from an older snapshot?); said once"
                    ));
                }
            }
            Admitted::TooSoon => self.dropped += 1,
            Admitted::Implausible => {
                self.dropped += 1;
                if !std::mem::replace(&mut self.said_implausible, true) {
                    warning = Some(format!(
                        "the slot source gave slot {slot}, past any real slot (2^48): dropped, as every \
                         such number; said once"
                    ));
                }
            }
        }
        (verdict, warning)
    }
}

/// Runs of consecutive slots from slot numbers in any order.
pub fn leader_runs(mut slots: Vec<u64>) -> Vec<(u64, u64)> {
    slots.sort_unstable();
    slots.dedup();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for s in slots {
        match runs.last_mut() {
            Some(r) if r.1 == s => r.1 = s + 1,
            _ => runs.push((s, s + 1)),
        }
    }
    runs
}

/// What a slot source saw during a session.
#[derive(Clone, Debug, Default)]
pub struct SlotLog {
    /// `(slot, CLOCK_MONOTONIC ns)` at which the slot was seen to start.
    pub starts: Vec<(u64, u64)>,
    pub epochs: Vec<EpochSchedule>,
    /// Problems with the source, in plain words (each said once).
    pub warnings: Vec<String>,
    /// Calls of the uprobe'd slot-start function: `(CLOCK_MONOTONIC ns,
    /// first argument)`.
    pub marks: Vec<(u64, u64)>,
    /// The RPC source gives slots now (false while it fails, and for the
    /// other sources).
    pub healthy: bool,
    /// The node's identity pubkey, as the RPC's getIdentity gave it.
    pub identity: Option<String>,
}

/// A [`SlotLog`] shared between a source task and the session.
pub type SharedSlotLog = Arc<Mutex<SlotLog>>;

impl SlotLog {
    /// Forgets slot starts and marks before `ts_ns` (always-on mode), but
    /// keeps the last `keep` of each: they measure the slot length.
    pub fn forget_before(&mut self, ts_ns: u64, keep: usize) {
        fn trim(v: &mut Vec<(u64, u64)>, at: impl Fn(&(u64, u64)) -> u64, ts_ns: u64, keep: usize) {
            let old = v.iter().filter(|e| at(e) < ts_ns).count();
            let drop = old.min(v.len().saturating_sub(keep));
            if drop > 0 {
                v.sort_unstable_by_key(&at);
                v.drain(..drop);
            }
        }
        trim(&mut self.starts, |e| e.1, ts_ns, keep);
        trim(&mut self.marks, |e| e.0, ts_ns, keep);
    }

    /// Whether this node leads `slot`, per the schedules fetched.
    pub fn is_leader(&self, slot: u64) -> bool {
        self.epochs.iter().any(|e| {
            e.contains(slot) && {
                let i = e.leader_runs.partition_point(|r| r.1 <= slot);
                e.leader_runs.get(i).is_some_and(|r| r.0 <= slot)
            }
        })
    }

    /// First slot of the leader window holding `slot` (windows are 4-slot
    /// groups aligned to the epoch start).
    fn window_of(&self, slot: u64) -> u64 {
        let first = self
            .epochs
            .iter()
            .find(|e| e.contains(slot))
            .map_or(0, |e| e.first_slot);
        slot - (slot - first) % SLOTS_PER_WINDOW
    }

    /// The timeline from uprobe marks: each call starts a slot, numbered
    /// by the function's first argument, by the RPC slot that started
    /// closest to it (within half a slot), or by counting on from the
    /// previous one (back from the first the RPC numbers; from 0 when it
    /// numbers none).
    pub fn uprobe_timeline(
        &self,
        numbers: crate::slot_sources::SlotNumbers,
        session_end_ns: u64,
    ) -> Timeline {
        let rpc_len = self.measured_slot_ns();
        let rpc = self.sorted_starts();
        let mut marks = self.marks.clone();
        marks.sort_unstable();
        let from_rpc: Vec<Option<u64>> = marks
            .iter()
            .map(|&(t, _)| {
                rpc_len.and_then(|len| {
                    rpc.iter()
                        .min_by_key(|(_, rt)| rt.abs_diff(t))
                        .filter(|(_, rt)| rt.abs_diff(t) < len / 2)
                        .map(|(slot, _)| *slot)
                })
            })
            .collect();
        // Marks before the first one the RPC numbers count back from it
        // (counting them on from 0 made a run of slots the node never had
        // when the RPC's first answers came late: a node just out of load).
        let first_numbered = from_rpc.iter().enumerate().find_map(|(i, n)| n.map(|n| (i, n)));
        let mut starts = Vec::with_capacity(marks.len());
        let mut prev: Option<u64> = None;
        for (i, (t, arg0)) in marks.into_iter().enumerate() {
            let n = match numbers {
                // The target's own memory: a number past any real slot
                // is no slot's (issue 42, case 8).
                crate::slot_sources::SlotNumbers::FirstArgument if arg0 > MAX_SLOT => continue,
                crate::slot_sources::SlotNumbers::FirstArgument => arg0,
                crate::slot_sources::SlotNumbers::Counter => match (from_rpc[i], prev, first_numbered) {
                    (Some(n), _, _) => n,
                    (None, Some(p), _) => p + 1,
                    (None, None, Some((j, n))) => match n.checked_sub((j - i) as u64) {
                        Some(n) => n,
                        None => continue,
                    },
                    (None, None, None) => 0,
                },
            };
            starts.push((n, t));
            prev = Some(n);
        }
        SlotLog {
            starts,
            epochs: self.epochs.clone(),
            warnings: Vec::new(),
            marks: Vec::new(),
            healthy: self.healthy,
            identity: None,
        }
        .timeline(session_end_ns)
    }

    /// Median slot length seen, in ns.
    pub fn measured_slot_ns(&self) -> Option<u64> {
        let starts = self.sorted_starts();
        let mut lens: Vec<u64> = starts
            .windows(2)
            .filter(|w| w[1].1 > w[0].1 && plausible_advance(w[1].0 - w[0].0, w[1].1 - w[0].1))
            .map(|w| (w[1].1 - w[0].1) / (w[1].0 - w[0].0))
            .collect();
        lens.sort_unstable();
        lens.get(lens.len() / 2).copied()
    }

    /// Starts sorted by slot, one per slot (the first sighting), with times
    /// increasing.
    fn sorted_starts(&self) -> Vec<(u64, u64)> {
        let mut s = self.starts.clone();
        s.sort_unstable();
        s.dedup_by_key(|(slot, _)| *slot);
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(s.len());
        for (slot, t) in s {
            if out.last().is_none_or(|&(_, prev)| t > prev) {
                out.push((slot, t));
            }
        }
        out
    }

    /// The timeline up to `session_end_ns`. Slots whose start and end were
    /// both seen are aligned; slots filled in between sightings (missed
    /// notifications) or after the source went quiet are estimated with the
    /// measured slot length and marked unaligned.
    pub fn timeline(&self, session_end_ns: u64) -> Timeline {
        let starts = self.sorted_starts();
        let Some(&(last_slot, last_t)) = starts.last() else {
            return Timeline::default();
        };
        let len = self.measured_slot_ns();
        let mut slots = Vec::new();
        let mut push = |number: u64, start_ns: u64, end_ns: u64, aligned: bool| {
            let leader = self.is_leader(number);
            slots.push(Slot {
                number,
                start_ns,
                end_ns,
                leader,
                window: leader.then(|| self.window_of(number)),
                aligned,
            });
        };
        for w in starts.windows(2) {
            let ((s0, t0), (s1, t1)) = (w[0], w[1]);
            let gap = s1 - s0;
            if !plausible_advance(gap, t1 - t0) {
                // A discontinuity: the slot seen last lasts until the next
                // sighting, unaligned; nothing is made up in between.
                push(s0, t0, t1, false);
                continue;
            }
            for k in 0..gap {
                let start = t0 + (t1 - t0) * k / gap;
                let end = t0 + (t1 - t0) * (k + 1) / gap;
                push(s0 + k, start, end, gap == 1);
            }
        }
        match len {
            // The source was heard from until the session ended (the next
            // start was not due yet): the last slot is real, cut at the end.
            Some(len) if session_end_ns <= last_t + len + len / 2 => {
                push(last_slot, last_t, session_end_ns.max(last_t + 1), true);
            }
            // It went quiet: estimate the rest with the measured length.
            Some(len) => {
                let len = len.max(MIN_SLOT_NS);
                let mut n = last_slot;
                let mut t = last_t;
                while t < session_end_ns && n - last_slot < MAX_FILL_SLOTS {
                    push(n, t, t + len, false);
                    n += 1;
                    t += len;
                }
            }
            None => push(last_slot, last_t, session_end_ns.max(last_t + 1), false),
        }
        Timeline::new(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_takes_new_slots_and_drops_repeats_floods_backwards_and_impossible_numbers() {
        let ms = 1_000_000;
        let mut a = Admission::default();
        assert_eq!(a.admit(100, 0), (Admitted::Take, None));
        assert_eq!(a.admit(100, 10 * ms).0, Admitted::Same);
        // Case 3: a flood (faster than one slot a millisecond) is dropped.
        assert_eq!(a.admit(101, ms / 2).0, Admitted::TooSoon);
        assert_eq!(a.admit(101, 400 * ms), (Admitted::Take, None));
        // Case 6: backwards, said once, dropped each time.
        let (v, w) = a.admit(50, 800 * ms);
        assert_eq!(v, Admitted::Backwards { last: 101 });
        assert!(w.unwrap().contains("went backwards, from slot 101 to 50"));
        assert_eq!(a.admit(51, 1200 * ms), (Admitted::Backwards { last: 101 }, None));
        // Case 8: u64::MAX is no slot, said once; the last taken stays.
        let (v, w) = a.admit(u64::MAX, 1600 * ms);
        assert_eq!(v, Admitted::Implausible);
        assert!(w.unwrap().contains("past any real slot"));
        assert_eq!(a.admit(MAX_SLOT + 1, 2000 * ms), (Admitted::Implausible, None));
        assert_eq!(a.admit(102, 2000 * ms), (Admitted::Take, None));
        // A jump is taken, said once as a discontinuity.
        let (v, w) = a.admit(1_000_000, 2400 * ms);
        assert_eq!(v, Admitted::Take);
        assert!(w.unwrap().starts_with(JUMP_WARNING));
        assert_eq!(a.admit(2_000_000, 2800 * ms), (Admitted::Take, None));
        assert_eq!(a.dropped, 5);
    }

    #[test]
    fn case_8_a_slot_functions_argument_past_any_real_slot_starts_no_slot() {
        let log = SlotLog {
            marks: vec![(1_000, 7), (400_000_000, u64::MAX), (800_000_000, 9)],
            ..Default::default()
        };
        let t = log.uprobe_timeline(SlotNumbers::FirstArgument, 1_200_000_000);
        let numbers: Vec<u64> = t.slots().iter().map(|s| s.number).collect();
        assert!(!numbers.iter().any(|&n| n > MAX_SLOT), "{numbers:?}");
        assert!(numbers.contains(&7) && numbers.contains(&9), "{numbers:?}");
    }

    const MS: u64 = 1_000_000;

    fn log(starts: &[(u64, u64)]) -> SlotLog {
        SlotLog {
            starts: starts.to_vec(),
            epochs: vec![EpochSchedule {
                first_slot: 1000,
                slots_in_epoch: 432_000,
                leader_runs: leader_runs(vec![1004, 1005, 1006, 1007]),
            }],
            warnings: vec![],
            marks: vec![],
            healthy: true,
            identity: None,
        }
    }

    #[test]
    fn leader_slots_are_kept_as_runs_and_looked_up_exactly() {
        assert_eq!(
            leader_runs(vec![9, 4, 5, 6, 7, 20, 21, 5]),
            vec![(4, 8), (9, 10), (20, 22)]
        );
        assert_eq!(leader_runs(vec![]), vec![]);
        let l = SlotLog {
            epochs: vec![EpochSchedule {
                first_slot: 0,
                slots_in_epoch: 100,
                leader_runs: leader_runs(vec![4, 5, 6, 7, 9, 20, 21]),
            }],
            ..log(&[])
        };
        let leads: Vec<u64> = (0..30).filter(|&s| l.is_leader(s)).collect();
        assert_eq!(leads, vec![4, 5, 6, 7, 9, 20, 21]);
        assert!(!l.is_leader(100), "outside the epoch");
    }

    #[test]
    fn uprobe_marks_take_numbers_from_rpc_or_count() {
        use crate::slot_sources::SlotNumbers;
        let mut l = log(&[(1004, 2 * MS), (1005, 402 * MS), (1006, 801 * MS)]);
        l.marks = vec![(0, 77), (400 * MS, 78), (800 * MS, 79), (1200 * MS, 80)];
        let t = l.uprobe_timeline(SlotNumbers::Counter, 1500 * MS);
        let nums: Vec<u64> = t.slots().iter().map(|s| s.number).collect();
        // The last mark has no RPC slot near it: counted on.
        assert_eq!(nums, [1004, 1005, 1006, 1007]);
        assert_eq!(t.slots()[0].start_ns, 0);
        assert!(t.slots()[0].leader);
        let t = l.uprobe_timeline(SlotNumbers::FirstArgument, 1500 * MS);
        assert_eq!(t.slots()[0].number, 77);
        // The RPC's first answer came late: earlier marks count back from
        // the first it numbers, not on from 0.
        let mut late = log(&[(1006, 801 * MS), (1007, 1201 * MS), (1008, 1601 * MS)]);
        late.marks = vec![(0, 0), (400 * MS, 0), (800 * MS, 0), (1200 * MS, 0)];
        let t = late.uprobe_timeline(SlotNumbers::Counter, 1500 * MS);
        assert_eq!(
            t.slots().iter().map(|s| s.number).collect::<Vec<_>>(),
            [1004, 1005, 1006, 1007]
        );
        l.starts.clear();
        let t = l.uprobe_timeline(SlotNumbers::Counter, 1500 * MS);
        assert_eq!(
            t.slots().iter().map(|s| s.number).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
    }

    #[test]
    fn seen_slots_are_aligned_and_leaders_form_windows() {
        let l = log(&[
            (1004, 0),
            (1005, 400 * MS),
            (1006, 800 * MS),
            (1007, 1200 * MS),
            (1008, 1600 * MS),
        ]);
        assert_eq!(l.measured_slot_ns(), Some(400 * MS));
        let t = l.timeline(1700 * MS);
        let s = t.slots();
        assert_eq!(s.len(), 5);
        assert!(s.iter().all(|s| s.aligned));
        assert_eq!(s[1].start_ns, 400 * MS);
        assert_eq!(s[1].end_ns, 800 * MS);
        assert_eq!(s.iter().filter(|s| s.leader).count(), 4);
        assert!(s.iter().filter(|s| s.leader).all(|s| s.window == Some(1004)));
        assert_eq!(s[4].end_ns, 1700 * MS);
    }

    #[test]
    fn missed_and_silent_slots_are_estimated_and_unaligned() {
        // 1002 was never announced; the source went quiet after 1004.
        let l = log(&[
            (1004, 1200 * MS),
            (1000, 0),
            (1001, 400 * MS),
            (1003, 1200 * MS - 400 * MS),
            (1001, 450 * MS),
        ]);
        let t = l.timeline(3000 * MS);
        let by_num = |n: u64| t.slots().iter().find(|s| s.number == n).unwrap().clone();
        assert!(by_num(1000).aligned);
        assert!(!by_num(1001).aligned && !by_num(1002).aligned);
        assert_eq!(by_num(1002).start_ns, 600 * MS);
        assert!(by_num(1003).aligned);
        assert!(!by_num(1004).aligned && !by_num(1007).aligned);
        assert_eq!(t.slots().last().unwrap().number, 1008);
        assert!(t.slots().last().unwrap().end_ns >= 3000 * MS);
    }

    #[test]
    fn a_slot_number_that_jumps_is_a_discontinuity_not_a_trillion_slots() {
        let jump = 1_000_000_000_000;
        let l = log(&[
            (1000, 0),
            (1001, 400 * MS),
            (1002 + jump, 800 * MS),
            (1003 + jump, 1200 * MS),
        ]);
        assert_eq!(l.measured_slot_ns(), Some(400 * MS));
        let t = l.timeline(1500 * MS);
        let numbers: Vec<u64> = t.slots().iter().map(|s| s.number).collect();
        assert_eq!(numbers, [1000, 1001, 1002 + jump, 1003 + jump]);
        let s1001 = &t.slots()[1];
        assert!(!s1001.aligned && s1001.end_ns == 800 * MS, "{s1001:?}");
        // Quiet for a day after a jump: estimated slots stop at the bound.
        assert!(l.timeline(86_400_000 * MS).slots().len() as u64 <= 4 + MAX_FILL_SLOTS);
        // Schedules from a hostile reply cannot overflow the lookup.
        let e = EpochSchedule {
            first_slot: u64::MAX - 5,
            slots_in_epoch: u64::MAX,
            leader_runs: vec![],
        };
        assert!(e.contains(u64::MAX) && !e.contains(0));
        assert!(plausible_advance(1, 0) && plausible_advance(3, 400 * MS));
        assert!(!plausible_advance(jump, 400 * MS) && !plausible_advance(500, 400 * MS));
    }

    #[test]
    fn nothing_seen_means_no_slots() {
        assert!(SlotLog::default().timeline(5).slots().is_empty());
    }
}
