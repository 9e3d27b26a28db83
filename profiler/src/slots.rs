//! The slot timeline: which slot (and leader window) every nanosecond of a
//! session belongs to.
//!
//! Everything slotprof reports per slot is cut along this timeline. It is a
//! plain sorted list of [`Slot`]s in CLOCK_MONOTONIC nanoseconds (the clock
//! of `bpf_ktime_get_ns`), built by a slot source; bucketing against it is
//! a pure function, tested without a kernel.

use std::time::Duration;

use serde::Serialize;

/// CLOCK_MONOTONIC now, in ns: the clock of `bpf_ktime_get_ns` and so of
/// every timestamp in a session.
pub use crate::sys::monotonic_ns;

/// Slots in a leader window.
pub const SLOTS_PER_WINDOW: u64 = 4;

/// One slot as seen from this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Slot {
    pub number: u64,
    /// CLOCK_MONOTONIC ns.
    pub start_ns: u64,
    pub end_ns: u64,
    /// This node is the leader for the slot.
    pub leader: bool,
    /// First slot of the leader window this slot belongs to, if leader.
    pub window: Option<u64>,
    /// The boundaries come from the source (false: guessed, e.g. while the
    /// slot source was unreachable).
    pub aligned: bool,
}

impl Slot {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// The slots of a session, sorted by start, not overlapping.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Timeline {
    slots: Vec<Slot>,
}

impl Timeline {
    /// A timeline from slots in any order; overlapping slots are cut at the
    /// next one's start.
    pub fn new(mut slots: Vec<Slot>) -> Self {
        slots.sort_by_key(|s| s.start_ns);
        for i in 1..slots.len() {
            let next_start = slots[i].start_ns;
            if slots[i - 1].end_ns > next_start {
                slots[i - 1].end_ns = next_start;
            }
        }
        Self { slots }
    }

    /// Fixed-length slots covering `[from_ns, to_ns)`, numbered from 0 at
    /// `origin_ns`.
    pub fn clock(
        slot: Duration,
        origin_ns: u64,
        leader: Option<(u64, u64)>,
        from_ns: u64,
        to_ns: u64,
    ) -> Self {
        Self::clock_from(slot, (origin_ns, 0), leader, from_ns, to_ns)
    }

    /// [`Timeline::clock`] with the slot at `origin_ns` numbered `base`
    /// (an always-on export continues the numbers already on its disk).
    pub fn clock_from(
        slot: Duration,
        (origin_ns, base): (u64, u64),
        leader: Option<(u64, u64)>,
        from_ns: u64,
        to_ns: u64,
    ) -> Self {
        let len = slot.as_nanos() as u64;
        let first = from_ns.saturating_sub(origin_ns) / len;
        let mut slots = Vec::new();
        let mut i = first;
        loop {
            let start = origin_ns + i * len;
            if start >= to_ns {
                break;
            }
            let n = base + i;
            i += 1;
            let is_leader = leader.is_some_and(|(k, m)| n % m < k);
            slots.push(Slot {
                number: n,
                start_ns: start,
                end_ns: start + len,
                leader: is_leader,
                window: is_leader.then(|| n - n % SLOTS_PER_WINDOW),
                aligned: true,
            });
        }
        Self { slots }
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Index of the slot holding `ts`, if any.
    pub fn slot_at(&self, ts: u64) -> Option<usize> {
        let i = self.slots.partition_point(|s| s.start_ns <= ts);
        let i = i.checked_sub(1)?;
        (ts < self.slots[i].end_ns).then_some(i)
    }

    /// How `[start, end)` divides among slots: `(slot index, ns)` for each
    /// slot it overlaps. Time outside every slot is left out.
    pub fn split(&self, start: u64, end: u64) -> impl Iterator<Item = (usize, u64)> + '_ {
        let first = if end <= start {
            self.slots.len()
        } else {
            self.slots.partition_point(|s| s.end_ns <= start)
        };
        self.slots[first..]
            .iter()
            .take_while(move |s| s.start_ns < end)
            .enumerate()
            .filter_map(move |(k, s)| {
                let overlap = end.min(s.end_ns).saturating_sub(start.max(s.start_ns));
                (overlap > 0).then_some((first + k, overlap))
            })
    }
}

/// The time buckets findings are cut along: the session's slots, or
/// nominal 400 ms windows when there is no slot source.
pub struct Buckets<'a> {
    timeline: Option<&'a Timeline>,
    origin_ns: u64,
}

/// Bucket length without a slot source: one mainnet slot.
const NOMINAL_SLOT_NS: u64 = 400_000_000;

impl<'a> Buckets<'a> {
    pub fn new(timeline: Option<&'a Timeline>, origin_ns: u64) -> Self {
        Self {
            timeline: timeline.filter(|t| !t.slots().is_empty()),
            origin_ns,
        }
    }

    /// `(slot number if any, bucket key)` of time `ts`; None outside every slot.
    pub fn of(&self, ts: u64) -> Option<(Option<u64>, u64)> {
        match self.timeline {
            Some(t) => t.slot_at(ts).map(|i| {
                let n = t.slots()[i].number;
                (Some(n), n)
            }),
            None => Some((None, ts.saturating_sub(self.origin_ns) / NOMINAL_SLOT_NS)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn slot(number: u64, start_ns: u64, end_ns: u64) -> Slot {
        Slot {
            number,
            start_ns,
            end_ns,
            leader: false,
            window: None,
            aligned: true,
        }
    }

    #[test]
    fn clock_slots_cover_the_session_with_leader_windows() {
        let t = Timeline::clock(
            Duration::from_millis(400),
            1_000 * MS,
            Some((4, 8)),
            1_500 * MS,
            4_900 * MS,
        );
        let nums: Vec<u64> = t.slots().iter().map(|s| s.number).collect();
        assert_eq!(nums, (1..=9).collect::<Vec<_>>());
        assert_eq!(t.slots()[0].start_ns, 1_400 * MS);
        let leaders: Vec<u64> = t.slots().iter().filter(|s| s.leader).map(|s| s.number).collect();
        assert_eq!(leaders, [1, 2, 3, 8, 9]);
        assert_eq!(t.slots().iter().find(|s| s.number == 9).unwrap().window, Some(8));
    }

    #[test]
    fn intervals_split_at_boundaries_and_gaps_drop_out() {
        // A gap between 20 and 30 (no slot known there).
        let t = Timeline::new(vec![slot(2, 30, 40), slot(0, 0, 10), slot(1, 10, 20)]);
        assert_eq!(t.slot_at(0), Some(0));
        assert_eq!(t.slot_at(19), Some(1));
        assert_eq!(t.slot_at(25), None);
        assert_eq!(t.slot_at(40), None);
        assert_eq!(t.split(5, 35).collect::<Vec<_>>(), vec![(0, 5), (1, 10), (2, 5)]);
        assert_eq!(t.split(21, 29).collect::<Vec<_>>(), vec![]);
        let total: u64 = t.split(0, 40).map(|(_, ns)| ns).sum();
        assert_eq!(total, 30);
    }

    #[test]
    fn a_slot_lasts_from_start_to_end_and_never_less_than_nothing() {
        assert_eq!(slot(0, 10, 25).duration_ns(), 15);
        assert_eq!(slot(0, 25, 10).duration_ns(), 0);
    }

    #[test]
    fn monotonic_ns_is_clock_monotonic_in_nanoseconds() {
        // Across a second boundary (so that seconds and nanoseconds both
        // count), its advance matches std's monotonic Instant to a
        // millisecond.
        let before = std::time::Instant::now();
        let a = monotonic_ns();
        std::thread::sleep(Duration::from_millis(1100));
        let b = monotonic_ns();
        let outer = before.elapsed().as_nanos() as u64;
        let d = b - a;
        assert!(d <= outer && d + MS >= outer, "{d} ns vs {outer} ns");
        // And it is the kernel's CLOCK_MONOTONIC, which never runs ahead
        // of CLOCK_BOOTTIME (/proc/uptime, 10 ms resolution).
        let uptime: f64 = std::fs::read_to_string("/proc/uptime")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let now = monotonic_ns() as f64 / 1e9;
        assert!(now <= uptime + 0.02 && now > 1.0, "{now} s vs uptime {uptime} s");
    }

    #[test]
    fn a_slot_of_no_length_takes_no_share() {
        let t = Timeline::new(vec![slot(0, 0, 10), slot(1, 10, 10), slot(2, 10, 20)]);
        assert_eq!(t.split(5, 15).collect::<Vec<_>>(), vec![(0, 5), (2, 5)]);
        assert_eq!(t.split(7, 7).collect::<Vec<_>>(), vec![]);
    }

    #[test]
    fn overlapping_slots_are_cut() {
        let t = Timeline::new(vec![slot(0, 0, 15), slot(1, 10, 20)]);
        assert_eq!(t.slots()[0].end_ns, 10);
    }

    #[test]
    fn buckets_are_slots_or_nominal_400_ms_windows() {
        let b = Buckets::new(None, 100);
        assert_eq!(b.of(100), Some((None, 0)));
        assert_eq!(b.of(100 + 400 * MS), Some((None, 1)));
        assert_eq!(b.of(50), Some((None, 0)));
        let t = Timeline::clock(std::time::Duration::from_millis(400), 0, None, 0, 800 * MS);
        let b = Buckets::new(Some(&t), 0);
        assert_eq!(b.of(401 * MS), Some((Some(1), 1)));
        assert_eq!(b.of(900 * MS), None);
        // An empty timeline is no timeline.
        let empty = Timeline::new(Vec::new());
        assert_eq!(Buckets::new(Some(&empty), 0).of(5), Some((None, 0)));
    }
}
