//! The slot timeline: which slot (and leader window) every nanosecond of a
//! session belongs to.
//!
//! Everything slotprof reports per slot is cut along this timeline. It is a
//! plain sorted list of [`Slot`]s in CLOCK_MONOTONIC nanoseconds (the clock
//! of `bpf_ktime_get_ns`), built by a slot source; bucketing against it is
//! a pure function, tested without a kernel.

use std::{str::FromStr, time::Duration};

use serde::Serialize;

/// CLOCK_MONOTONIC now, in ns: the clock of `bpf_ktime_get_ns` and so of
/// every timestamp in a session.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Slots in a leader window.
pub const SLOTS_PER_WINDOW: u64 = 4;

/// One slot as seen from this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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

/// Where slot boundaries come from (`--slot-source`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotSourceSpec {
    /// `clock=400ms[,origin=NS][,leader=K/M]`: fixed-length slots from
    /// `origin` (CLOCK_MONOTONIC ns; default: session start). With
    /// `leader=K/M`, the first K slots of every M are this node's (K a
    /// multiple of 4 gives whole leader windows).
    Clock {
        slot: Duration,
        origin_ns: Option<u64>,
        leader: Option<(u64, u64)>,
    },
    /// `rpc=http://HOST:PORT`: the validator's JSON-RPC (websocket at PORT+1).
    Rpc(crate::slot_sources::rpc::RpcEndpoint),
    /// `uprobe=BINARY:FUNCTION[,slot=arg0][,rpc=http://HOST:PORT]`: a slot
    /// starts whenever the target calls FUNCTION (matched by demangled
    /// name, e.g. `PohRecorder::set_bank`). Slot numbers come from the RPC
    /// when given, from the function's first argument with `slot=arg0`,
    /// else from a counter.
    Uprobe {
        binary: std::path::PathBuf,
        function: String,
        numbers: SlotNumbers,
        rpc: Option<crate::slot_sources::rpc::RpcEndpoint>,
    },
}

/// Where a uprobe slot source takes slot numbers from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotNumbers {
    /// Counting from 0 at the first call, or matched to the RPC's slots.
    Counter,
    /// The probed function's first argument.
    FirstArgument,
}

impl FromStr for SlotSourceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, rest) = s.split_once('=').ok_or_else(|| {
            format!("--slot-source {s:?}: expected rpc=http://127.0.0.1:8899 or clock=400ms")
        })?;
        match kind {
            "clock" => {
                let mut parts = rest.split(',');
                let slot = crate::duration::parse(parts.next().unwrap_or(""))?;
                if slot < Duration::from_millis(1) {
                    return Err(format!("--slot-source {s:?}: a slot must last at least 1ms"));
                }
                let mut origin_ns = None;
                let mut leader = None;
                for p in parts {
                    match p.split_once('=') {
                        Some(("origin", v)) => {
                            origin_ns = Some(v.parse().map_err(|_| {
                                format!("--slot-source: origin={v:?} is not a CLOCK_MONOTONIC time in ns")
                            })?)
                        }
                        Some(("leader", v)) => {
                            let (k, m) = v
                                .split_once('/')
                                .and_then(|(k, m)| Some((k.parse().ok()?, m.parse().ok()?)))
                                .filter(|&(k, m): &(u64, u64)| k <= m && m > 0)
                                .ok_or_else(|| {
                                    format!("--slot-source: leader={v:?}: expected K/M, e.g. 4/16")
                                })?;
                            leader = Some((k, m));
                        }
                        _ => {
                            return Err(format!(
                                "--slot-source: unknown clock option {p:?} (origin=NS, leader=K/M)"
                            ))
                        }
                    }
                }
                Ok(Self::Clock {
                    slot,
                    origin_ns,
                    leader,
                })
            }
            "rpc" => Ok(Self::Rpc(crate::slot_sources::rpc::RpcEndpoint::parse(rest)?)),
            "uprobe" => {
                let mut parts = rest.split(',');
                let target = parts.next().unwrap_or("");
                let (binary, function) = target
                    .split_once(':')
                    .filter(|(b, f)| !b.is_empty() && !f.is_empty())
                    .ok_or_else(|| format!("--slot-source {s:?}: expected uprobe=BINARY:FUNCTION"))?;
                let mut numbers = SlotNumbers::Counter;
                let mut rpc = None;
                for p in parts {
                    match p.split_once('=') {
                        Some(("slot", "arg0")) => numbers = SlotNumbers::FirstArgument,
                        Some(("rpc", url)) => rpc = Some(crate::slot_sources::rpc::RpcEndpoint::parse(url)?),
                        _ => {
                            return Err(format!(
                                "--slot-source: unknown uprobe option {p:?} (slot=arg0, rpc=http://HOST:PORT)"
                            ))
                        }
                    }
                }
                Ok(Self::Uprobe {
                    binary: binary.into(),
                    function: function.to_string(),
                    numbers,
                    rpc,
                })
            }
            _ => Err(format!(
                "--slot-source {s:?}: unknown source {kind:?}; use rpc=http://127.0.0.1:8899 or clock=400ms"
            )),
        }
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

    /// Fixed-length slots covering `[from_ns, to_ns)`.
    pub fn clock(
        slot: Duration,
        origin_ns: u64,
        leader: Option<(u64, u64)>,
        from_ns: u64,
        to_ns: u64,
    ) -> Self {
        let len = slot.as_nanos() as u64;
        let first = from_ns.saturating_sub(origin_ns) / len;
        let mut slots = Vec::new();
        let mut n = first;
        loop {
            let start = origin_ns + n * len;
            if start >= to_ns {
                break;
            }
            let is_leader = leader.is_some_and(|(k, m)| n % m < k);
            slots.push(Slot {
                number: n,
                start_ns: start,
                end_ns: start + len,
                leader: is_leader,
                window: is_leader.then(|| n - n % SLOTS_PER_WINDOW),
                aligned: true,
            });
            n += 1;
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
    fn parses_clock_specs_and_explains_bad_ones() {
        assert_eq!(
            "clock=400ms".parse::<SlotSourceSpec>().unwrap(),
            SlotSourceSpec::Clock {
                slot: Duration::from_millis(400),
                origin_ns: None,
                leader: None
            }
        );
        assert_eq!(
            "clock=250ms,origin=5,leader=4/16"
                .parse::<SlotSourceSpec>()
                .unwrap(),
            SlotSourceSpec::Clock {
                slot: Duration::from_millis(250),
                origin_ns: Some(5),
                leader: Some((4, 16))
            }
        );
        assert!("clock=fast"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("30s"));
        assert!("clock=400ms,leader=5"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("K/M"));
        assert!("ntp=1"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("unknown source"));
        match "uprobe=/usr/bin/agave-validator:PohRecorder::set_bank,rpc=http://127.0.0.1:8899"
            .parse::<SlotSourceSpec>()
            .unwrap()
        {
            SlotSourceSpec::Uprobe {
                binary,
                function,
                numbers,
                rpc,
            } => {
                assert_eq!(binary, std::path::PathBuf::from("/usr/bin/agave-validator"));
                assert_eq!(function, "PohRecorder::set_bank");
                assert_eq!(numbers, SlotNumbers::Counter);
                assert_eq!(rpc.unwrap().ws, "ws://127.0.0.1:8900");
            }
            other => panic!("{other:?}"),
        }
        assert!("uprobe=/bin/x"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("BINARY:FUNCTION"));
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
    fn clock_and_uprobe_options_are_checked_at_their_edges() {
        let err = |s: &str| s.parse::<SlotSourceSpec>().unwrap_err();
        assert!("clock=1ms".parse::<SlotSourceSpec>().is_ok());
        assert!(err("clock=999us").contains("at least 1ms"));
        assert!("clock=400ms,leader=4/4".parse::<SlotSourceSpec>().is_ok());
        assert!(err("clock=400ms,leader=5/4").contains("K/M"));
        assert!(err("clock=400ms,leader=0/0").contains("K/M"));
        assert!(err("clock=400ms,origin=soon").contains("origin"));
        assert!(err("clock=400ms,jitter=1").contains("unknown clock option"));
        assert!(err("uprobe=:set_bank").contains("BINARY:FUNCTION"));
        assert!(err("uprobe=/bin/x:").contains("BINARY:FUNCTION"));
        assert!(err("uprobe=/bin/x:f,slot=arg1").contains("unknown uprobe option"));
        match "uprobe=/bin/x:f,slot=arg0".parse::<SlotSourceSpec>().unwrap() {
            SlotSourceSpec::Uprobe { numbers, rpc, .. } => {
                assert_eq!(numbers, SlotNumbers::FirstArgument);
                assert!(rpc.is_none());
            }
            other => panic!("{other:?}"),
        }
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
}
