//! Every futex wait of a session over the reporting minimum, kept off the
//! heap.
//!
//! On the real node under load the target waits on futexes ~2,700 times a
//! second for 1 ms or more (idle workers parked, channels, locks): kept as
//! they came, 112 bytes each, they made a 600 s attach peak at 250 MiB
//! and a 30-minute one would pass half a GiB. As with the off-CPU
//! intervals ([`super::intervals`]), the newest [`IN_MEMORY`] stay in
//! memory and older ones go to an unnamed temporary file ([`super::spill`]), read back in
//! order, a chunk at a time, by whoever iterates them at the session's
//! end (the detectors stream them: nothing puts them all back in memory).

use profiler_ebpf::FutexWait;

use super::spill::{Iter, Record, SpillLog};
use crate::detectors::{FutexSource, FutexWaits};

/// Waits kept in memory before they go to the file (3.5 MiB).
pub const IN_MEMORY: usize = 32_768;

/// A wait as stored: the kernel's record as it came.
impl Record for FutexWait {
    const BYTES: usize = std::mem::size_of::<FutexWait>();

    fn encode(&self, out: &mut Vec<u8>) {
        // SAFETY: FutexWait is repr(C) plain data (integers and byte
        // arrays) without padding (the assertion below).
        let bytes =
            unsafe { std::slice::from_raw_parts((self as *const FutexWait).cast::<u8>(), Self::BYTES) };
        out.extend_from_slice(bytes);
    }

    fn decode(b: &[u8]) -> Self {
        assert_eq!(b.len(), Self::BYTES);
        // SAFETY: length checked; every bit pattern is a valid FutexWait.
        unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) }
    }
}

// Its fields fill it with no padding (padding bytes would be copied
// uninitialized): a change to the record shows here first.
const _: () = assert!(<FutexWait as Record>::BYTES == 112);

/// The waits, in the order they were pushed.
pub struct FutexStore {
    log: SpillLog<FutexWait>,
}

impl Default for FutexStore {
    fn default() -> Self {
        Self {
            log: SpillLog::new("futex waits", IN_MEMORY),
        }
    }
}

impl FutexStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, f: &FutexWait) {
        self.log.push(*f);
    }

    /// How many waits there are.
    pub fn len(&self) -> u64 {
        self.log.len()
    }

    pub fn is_empty(&self) -> bool {
        self.log.is_empty()
    }

    /// Why waits stay in memory, when they do.
    pub fn file_error(&self) -> Option<&str> {
        self.log.file_error()
    }

    /// Why an iteration stopped early, if one did (the file could not be
    /// read back): whoever reports the session says so.
    pub fn read_error(&self) -> Option<String> {
        self.log.read_error()
    }

    /// Every wait, in the order they were pushed.
    pub fn iter(&self) -> Iter<'_, FutexWait> {
        self.log.iter()
    }
}

/// The detectors read a session's waits from here, streamed.
impl FutexSource for FutexStore {
    fn waits(&self) -> Box<dyn Iterator<Item = FutexWait> + '_> {
        Box::new(self.iter())
    }
}

impl<'a> From<&'a FutexStore> for FutexWaits<'a> {
    fn from(s: &'a FutexStore) -> Self {
        FutexWaits::Source(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(n: u64) -> FutexWait {
        FutexWait {
            kind: profiler_ebpf::EventKind::FutexWait as u32,
            cpu: (n % 2) as u32,
            start_ns: n * 10,
            end_ns: n * 10 + 7,
            tgid: 1,
            tid: (n % 5) as u32,
            uaddr: 0x1000 + n * 8,
            op: 128,
            user_stack_id: (n % 3) as i32,
            ret: -(n as i64 % 2) * 110,
            waker_tid: (n % 7) as u32,
            waker_user_stack_id: -1,
            waker_context: 2,
            _pad: 0,
            waker_woken_ns: n * 10 + 5,
            comm: [b'a' + (n % 26) as u8; profiler_ebpf::COMM_LEN],
            waker_comm: [b'w'; profiler_ebpf::COMM_LEN],
        }
    }

    fn same(a: &FutexWait, b: &FutexWait) -> bool {
        let mut x = Vec::new();
        let mut y = Vec::new();
        a.encode(&mut x);
        b.encode(&mut y);
        x == y
    }

    #[test]
    fn waits_past_the_memory_bound_go_to_the_file_and_come_back_in_order() {
        let mut s = FutexStore::new();
        let n = (IN_MEMORY * 2 + 4096 + 17) as u64;
        for i in 0..n {
            s.push(&wait(i));
        }
        assert_eq!(s.len(), n);
        assert!(s.file_error().is_none(), "{:?}", s.file_error());
        assert_eq!(s.log.file_bytes(), (IN_MEMORY * 2 * FutexWait::BYTES) as u64);
        let back: Vec<FutexWait> = s.iter().collect();
        assert_eq!(back.len() as u64, n);
        assert!(back.iter().enumerate().all(|(i, f)| same(f, &wait(i as u64))));
        // Again (the detectors go over them twice).
        assert_eq!(s.iter().count() as u64, n);
        assert!(s.read_error().is_none());
    }

    #[test]
    fn a_slice_and_a_store_read_the_same() {
        let waits: Vec<FutexWait> = (0..100).map(wait).collect();
        let mut s = FutexStore::new();
        waits.iter().for_each(|w| s.push(w));
        let a: Vec<FutexWait> = FutexWaits::from(&waits[..]).iter().collect();
        let b: Vec<FutexWait> = FutexWaits::from(&s).iter().collect();
        assert!(a.iter().zip(&b).all(|(x, y)| same(x, y)) && a.len() == b.len());
        assert_eq!(FutexWaits::default().iter().count(), 0);
    }
}
