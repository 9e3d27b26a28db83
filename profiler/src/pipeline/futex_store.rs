//! Every futex wait of a session over the reporting minimum, kept off the
//! heap.
//!
//! On the real node under load the target waits on futexes ~2,700 times a
//! second for 1 ms or more (idle workers parked, channels, locks): kept as
//! they came, 112 bytes each, they made a 600 s attach peak at 250 MiB
//! and a 30-minute one would pass half a GiB. As with the off-CPU
//! intervals ([`super::intervals`]), the newest [`IN_MEMORY`] stay in
//! memory and older ones go to an unnamed temporary file, read back in
//! order, a chunk at a time, by whoever iterates them at the session's
//! end (the detectors stream them: nothing puts them all back in memory).

use std::{
    cell::RefCell,
    fs::File,
    io::{self, Write},
    os::unix::fs::FileExt,
};

use profiler_ebpf::FutexWait;

use crate::detectors::{FutexSource, FutexWaits};

/// Waits kept in memory before they go to the file (3.5 MiB).
pub const IN_MEMORY: usize = 32_768;

/// Waits read back from the file at a time.
const CHUNK: usize = 4096;

/// One wait as stored: the kernel's record as it came.
const RECORD: usize = std::mem::size_of::<FutexWait>();

// Its fields fill it with no padding (padding bytes would be copied
// uninitialized): a change to the record shows here first.
const _: () = assert!(RECORD == 112);

fn encode(f: &FutexWait, out: &mut Vec<u8>) {
    // SAFETY: FutexWait is repr(C) plain data (integers and byte arrays)
    // without padding (the assertion on RECORD).
    let bytes = unsafe { std::slice::from_raw_parts((f as *const FutexWait).cast::<u8>(), RECORD) };
    out.extend_from_slice(bytes);
}

fn decode(b: &[u8]) -> FutexWait {
    assert_eq!(b.len(), RECORD);
    // SAFETY: length checked; every bit pattern is a valid FutexWait.
    unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) }
}

/// The waits, in the order they were pushed.
#[derive(Default)]
pub struct FutexStore {
    /// The newest waits, not yet in the file.
    tail: Vec<FutexWait>,
    file: Option<File>,
    /// Waits in the file.
    in_file: u64,
    /// Why the file could not be made or written, if it could not: then
    /// everything stays in memory (nothing is dropped).
    file_error: Option<String>,
    /// The first error reading the file back (the iterator stops there).
    read_error: RefCell<Option<String>>,
}

impl FutexStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, f: &FutexWait) {
        self.tail.push(*f);
        if self.tail.len() >= IN_MEMORY && self.file_error.is_none() {
            if let Err(e) = self.spill() {
                self.file_error = Some(format!(
                    "futex waits could not go to a temporary file in {} ({e}); they stay in memory: \
                     set TMPDIR to a writable directory on a local filesystem",
                    std::env::temp_dir().display()
                ));
            }
        }
    }

    fn spill(&mut self) -> io::Result<()> {
        if self.file.is_none() {
            self.file = Some(super::intervals::unnamed_file(&std::env::temp_dir())?);
        }
        let file = self.file.as_mut().expect("just made");
        let mut bytes = Vec::with_capacity(self.tail.len() * RECORD);
        for f in &self.tail {
            encode(f, &mut bytes);
        }
        file.write_all(&bytes)?;
        self.in_file += self.tail.len() as u64;
        self.tail.clear();
        Ok(())
    }

    /// How many waits there are.
    pub fn len(&self) -> u64 {
        self.in_file + self.tail.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of waits in the temporary file.
    pub fn file_bytes(&self) -> u64 {
        self.in_file * RECORD as u64
    }

    /// Why waits stay in memory, when they do.
    pub fn file_error(&self) -> Option<&str> {
        self.file_error.as_deref()
    }

    /// Why an iteration stopped early, if one did (the file could not be
    /// read back): whoever reports the session says so.
    pub fn read_error(&self) -> Option<String> {
        self.read_error.borrow().clone()
    }

    /// Every wait, in the order they were pushed: those in the file a
    /// chunk at a time, then those in memory.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            store: self,
            next_in_file: 0,
            chunk: Vec::new(),
            at: 0,
            in_tail: 0,
        }
    }
}

/// See [`FutexStore::iter`].
pub struct Iter<'a> {
    store: &'a FutexStore,
    /// The next wait of the file to read.
    next_in_file: u64,
    chunk: Vec<FutexWait>,
    at: usize,
    in_tail: usize,
}

impl Iter<'_> {
    /// Reads the next chunk of the file; false at its end or on an error
    /// (kept in the store's `read_error`).
    fn refill(&mut self) -> bool {
        let Some(file) = &self.store.file else {
            return false;
        };
        let left = self.store.in_file - self.next_in_file;
        if left == 0 {
            return false;
        }
        let n = (left as usize).min(CHUNK);
        let mut bytes = vec![0u8; n * RECORD];
        if let Err(e) = file.read_exact_at(&mut bytes, self.next_in_file * RECORD as u64) {
            let mut err = self.store.read_error.borrow_mut();
            err.get_or_insert_with(|| format!("the futex waits' temporary file could not be read back: {e}"));
            self.next_in_file = self.store.in_file;
            return false;
        }
        self.chunk.clear();
        self.chunk.extend(bytes.chunks_exact(RECORD).map(decode));
        self.at = 0;
        self.next_in_file += n as u64;
        true
    }
}

impl Iterator for Iter<'_> {
    type Item = FutexWait;

    fn next(&mut self) -> Option<FutexWait> {
        if self.at < self.chunk.len() || self.refill() {
            self.at += 1;
            return Some(self.chunk[self.at - 1]);
        }
        let f = self.store.tail.get(self.in_tail).copied();
        self.in_tail += 1;
        f
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
        encode(a, &mut x);
        encode(b, &mut y);
        x == y
    }

    #[test]
    fn waits_past_the_memory_bound_go_to_the_file_and_come_back_in_order() {
        let mut s = FutexStore::new();
        let n = (IN_MEMORY * 2 + CHUNK + 17) as u64;
        for i in 0..n {
            s.push(&wait(i));
        }
        assert_eq!(s.len(), n);
        assert!(s.file_error().is_none(), "{:?}", s.file_error());
        assert_eq!(s.file_bytes(), (IN_MEMORY * 2) as u64 * RECORD as u64);
        assert!(s.tail.len() < IN_MEMORY);
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
