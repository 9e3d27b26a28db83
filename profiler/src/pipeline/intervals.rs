//! Every off-CPU interval of a session, kept off the heap.
//!
//! A busy node makes thousands of intervals a second (the real validator
//! ~7,500/s across 166 threads), and a session needs all of them at its
//! end: the profiles split them at slot boundaries, the gap detector reads
//! its thread's, the trace lists them. Kept as they come they cost 64
//! bytes each and grow without bound. Here each is 56 bytes (its thread
//! and stacks interned once), the newest [`IN_MEMORY`] stay in memory,
//! and older ones go to an unnamed temporary file ([`super::spill`]), read
//! back in order when the session ends.

use std::{collections::HashMap, io};

use super::spill::{Record, SpillLog};
use crate::records::{Folded, Interval, Runner, StackKey};

/// Intervals kept in memory before they go to the file (3.5 MiB).
pub const IN_MEMORY: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Packed {
    start_ns: u64,
    end_ns: u64,
    woken_ns: u64,
    key: u32,
    preempted: bool,
    /// Index of the task that had the CPU in `IntervalStore::runners`.
    ran: u16,
    /// Folded waits: how many plus one (0: one interval, not folded),
    /// their off-CPU and runnable time.
    folded: u32,
    folded_ns: u64,
    folded_runnable_ns: u64,
}

impl Record for Packed {
    const BYTES: usize = 56;

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.start_ns.to_le_bytes());
        out.extend_from_slice(&self.end_ns.to_le_bytes());
        out.extend_from_slice(&self.woken_ns.to_le_bytes());
        out.extend_from_slice(&self.key.to_le_bytes());
        out.extend_from_slice(&[self.preempted as u8, 0]);
        out.extend_from_slice(&self.ran.to_le_bytes());
        out.extend_from_slice(&self.folded.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.folded_ns.to_le_bytes());
        out.extend_from_slice(&self.folded_runnable_ns.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Self {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Self {
            start_ns: u64_at(0),
            end_ns: u64_at(8),
            woken_ns: u64_at(16),
            key: u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")),
            preempted: b[28] != 0,
            ran: u16::from_le_bytes([b[30], b[31]]),
            folded: u32::from_le_bytes(b[32..36].try_into().expect("4 bytes")),
            folded_ns: u64_at(40),
            folded_runnable_ns: u64_at(48),
        }
    }
}

impl Packed {
    fn folded(&self) -> Option<Folded> {
        (self.folded != 0).then(|| Folded {
            intervals: self.folded - 1,
            offcpu_ns: self.folded_ns,
            runnable_ns: self.folded_runnable_ns,
        })
    }
}

/// The intervals, in the order they were pushed.
pub struct IntervalStore {
    keys: Vec<StackKey>,
    index: HashMap<StackKey, u32>,
    /// The tasks that had the CPU at intervals' ends, interned like the
    /// keys; entry 0 is "not known", which is also where any past the
    /// 65,536th go (counted).
    runners: Vec<Runner>,
    runner_index: HashMap<Runner, u16>,
    runners_over: u64,
    log: SpillLog<Packed>,
}

impl Default for IntervalStore {
    fn default() -> Self {
        Self {
            keys: Vec::new(),
            index: HashMap::new(),
            runners: Vec::new(),
            runner_index: HashMap::new(),
            runners_over: 0,
            log: SpillLog::new("off-CPU intervals", IN_MEMORY),
        }
    }
}

impl IntervalStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn runner(&mut self, r: &Runner) -> u16 {
        if self.runners.is_empty() {
            self.runners.push(Runner::default());
            self.runner_index.insert(Runner::default(), 0);
        }
        if let Some(&i) = self.runner_index.get(r) {
            return i;
        }
        let Ok(i) = u16::try_from(self.runners.len()) else {
            self.runners_over += 1;
            return 0;
        };
        self.runners.push(*r);
        self.runner_index.insert(*r, i);
        i
    }

    /// Intervals whose runner was not kept (more than 65,536 distinct).
    pub fn runners_over(&self) -> u64 {
        self.runners_over
    }

    pub fn push(&mut self, i: &Interval) {
        let next = self.keys.len() as u32;
        let key = *self.index.entry(i.key).or_insert_with(|| {
            self.keys.push(i.key);
            next
        });
        let ran = self.runner(&i.ran);
        let f = i.folded.map_or(
            Folded {
                intervals: 0,
                offcpu_ns: 0,
                runnable_ns: 0,
            },
            |f| Folded {
                intervals: f.intervals.saturating_add(1),
                ..f
            },
        );
        self.log.push(Packed {
            start_ns: i.start_ns,
            end_ns: i.end_ns,
            woken_ns: i.woken_ns,
            key,
            preempted: i.preempted,
            ran,
            folded: f.intervals,
            folded_ns: f.offcpu_ns,
            folded_runnable_ns: f.runnable_ns,
        });
    }

    /// How many intervals there are.
    pub fn len(&self) -> u64 {
        self.log.len()
    }

    pub fn is_empty(&self) -> bool {
        self.log.is_empty()
    }

    /// Bytes of intervals in the temporary file.
    pub fn file_bytes(&self) -> u64 {
        self.log.file_bytes()
    }

    /// Why intervals stay in memory, when they do.
    pub fn file_error(&self) -> Option<&str> {
        self.log.file_error()
    }

    /// Calls `f` with every interval, in the order they were pushed.
    pub fn for_each(&self, mut f: impl FnMut(&Interval)) -> io::Result<()> {
        let mut it = self.log.iter();
        for p in it.by_ref() {
            let Some(&key) = self.keys.get(p.key as usize) else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the intervals' temporary file changed under slotprof",
                ));
            };
            f(&Interval {
                start_ns: p.start_ns,
                end_ns: p.end_ns,
                key,
                preempted: p.preempted,
                woken_ns: p.woken_ns,
                ran: self.runners.get(p.ran as usize).copied().unwrap_or_default(),
                folded: p.folded(),
            });
        }
        match it.error() {
            Some(e) => Err(io::Error::other(e.to_string())),
            None => Ok(()),
        }
    }

    /// The intervals of the threads in `tids`, in memory: one by one,
    /// not folded ones (the detectors' threads fold none: the kernel is
    /// told which they are).
    pub fn of_threads(&self, tids: &[u32]) -> io::Result<Vec<Interval>> {
        let mut out = Vec::new();
        self.for_each(|i| {
            if i.folded.is_none() && tids.contains(&i.key.tid) {
                out.push(*i);
            }
        })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interval(n: u64) -> Interval {
        Interval {
            start_ns: n * 10,
            end_ns: n * 10 + 7,
            key: StackKey {
                tgid: 1,
                tid: (n % 5) as u32,
                comm: [b'a'; profiler_ebpf::COMM_LEN],
                user_stack_id: (n % 3) as i32,
                kernel_stack_id: -1,
            },
            preempted: n.is_multiple_of(2),
            woken_ns: n * 10 + 3,
            ran: Runner {
                tid: (n % 7) as u32,
                tgid: 3,
                comm: [b'r'; profiler_ebpf::COMM_LEN],
                kthread: n % 7 == 2,
            },
            folded: (n % 4 == 1).then_some(Folded {
                intervals: n as u32 + 1,
                offcpu_ns: 5,
                runnable_ns: n % 3,
            }),
        }
    }

    fn all(s: &IntervalStore) -> Vec<Interval> {
        let mut v = Vec::new();
        s.for_each(|i| v.push(*i)).unwrap();
        v
    }

    fn same(a: &Interval, b: &Interval) -> bool {
        (
            a.start_ns,
            a.end_ns,
            a.key,
            a.preempted,
            a.woken_ns,
            a.ran,
            a.folded,
        ) == (
            b.start_ns,
            b.end_ns,
            b.key,
            b.preempted,
            b.woken_ns,
            b.ran,
            b.folded,
        )
    }

    #[test]
    fn gives_back_what_was_pushed_in_order_across_the_file() {
        let mut s = IntervalStore::new();
        let n = IN_MEMORY as u64 * 2 + 123;
        for i in 0..n {
            s.push(&interval(i));
        }
        assert_eq!(s.len(), n);
        assert_eq!(
            s.file_bytes(),
            IN_MEMORY as u64 * 2 * Packed::BYTES as u64,
            "{:?}",
            s.file_error()
        );
        let back = all(&s);
        assert_eq!(back.len() as u64, n);
        assert!(back.iter().enumerate().all(|(i, b)| same(b, &interval(i as u64))));
        // 5 threads x 3 user stacks: 15 keys, not one per interval.
        assert_eq!(s.keys.len(), 15);
    }

    #[test]
    fn small_sessions_never_make_a_file() {
        let mut s = IntervalStore::new();
        for i in 0..100 {
            s.push(&interval(i));
        }
        assert_eq!(s.file_bytes(), 0);
        assert_eq!(all(&s).len(), 100);
    }

    #[test]
    fn picks_out_threads() {
        let mut s = IntervalStore::new();
        for i in 0..IN_MEMORY as u64 + 10 {
            s.push(&interval(i));
        }
        let of = s.of_threads(&[3]).unwrap();
        assert!(!of.is_empty());
        assert!(of.iter().all(|i| i.key.tid == 3 && i.folded.is_none()));
        // Folded waits are not the detectors': left out.
        let expected = (0..IN_MEMORY as u64 + 10)
            .filter(|i| i % 5 == 3 && i % 4 != 1)
            .count();
        assert_eq!(of.len(), expected);
    }
}
