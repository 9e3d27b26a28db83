//! A log of fixed-size records kept off the heap: the newest stay in
//! memory, older ones go to an unnamed temporary file (`O_TMPFILE`: no
//! path anyone can guess or race, gone when slotprof exits however it
//! exits), read back in order, a chunk at a time, by whoever iterates.
//!
//! A session keeps every off-CPU interval ([`super::intervals`]) and every
//! futex wait over the reporting minimum ([`super::futex_store`]) to its
//! end; on the real node under load those come at ~7,500 and ~2,700 a
//! second, and kept on the heap they made a 600 s attach peak at 250 MiB.

use std::{
    cell::RefCell,
    fs::File,
    io::{self, Write},
    os::unix::fs::FileExt,
    path::Path,
};

/// A record as the log stores it: `BYTES` bytes, the same way back.
pub trait Record: Copy {
    const BYTES: usize;
    fn encode(&self, out: &mut Vec<u8>);
    fn decode(bytes: &[u8]) -> Self;
}

/// Records read back from the file at a time.
const CHUNK: usize = 4096;

/// The records, in the order they were pushed.
pub struct SpillLog<R> {
    /// What the records are, for messages ("off-CPU intervals").
    what: &'static str,
    /// Records kept in memory before they go to the file.
    in_memory: usize,
    /// The newest records, not yet in the file.
    tail: Vec<R>,
    file: Option<File>,
    /// Records in the file.
    in_file: u64,
    /// Why the file could not be made or written, if it could not: then
    /// everything stays in memory (nothing is dropped).
    file_error: Option<String>,
    /// The first error reading the file back (iterations stop there).
    read_error: RefCell<Option<String>>,
}

impl<R: Record> SpillLog<R> {
    pub fn new(what: &'static str, in_memory: usize) -> Self {
        Self {
            what,
            in_memory: in_memory.max(1),
            tail: Vec::new(),
            file: None,
            in_file: 0,
            file_error: None,
            read_error: RefCell::new(None),
        }
    }

    pub fn push(&mut self, r: R) {
        self.tail.push(r);
        if self.tail.len() >= self.in_memory && self.file_error.is_none() {
            if let Err(e) = self.spill() {
                self.file_error = Some(format!(
                    "{} could not go to a temporary file in {} ({e}); they stay in memory: \
                     set TMPDIR to a writable directory on a local filesystem",
                    self.what,
                    std::env::temp_dir().display()
                ));
            }
        }
    }

    fn spill(&mut self) -> io::Result<()> {
        if self.file.is_none() {
            self.file = Some(unnamed_file(&std::env::temp_dir())?);
        }
        let file = self.file.as_mut().expect("just made");
        let mut bytes = Vec::with_capacity(self.tail.len() * R::BYTES);
        for r in &self.tail {
            r.encode(&mut bytes);
        }
        debug_assert_eq!(bytes.len(), self.tail.len() * R::BYTES);
        file.write_all(&bytes)?;
        self.in_file += self.tail.len() as u64;
        self.tail.clear();
        self.tail.shrink_to(self.in_memory);
        Ok(())
    }

    /// How many records there are.
    pub fn len(&self) -> u64 {
        self.in_file + self.tail.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of records in the temporary file.
    pub fn file_bytes(&self) -> u64 {
        self.in_file * R::BYTES as u64
    }

    /// Why records stay in memory, when they do.
    pub fn file_error(&self) -> Option<&str> {
        self.file_error.as_deref()
    }

    /// Why an iteration stopped early, if one did (the file could not be
    /// read back): whoever reports the session says so.
    pub fn read_error(&self) -> Option<String> {
        self.read_error.borrow().clone()
    }

    /// Every record, in the order they were pushed: those in the file a
    /// chunk at a time, then those in memory. An error reading the file
    /// ends the file's part (see [`Iter::error`] and [`Self::read_error`]).
    pub fn iter(&self) -> Iter<'_, R> {
        Iter {
            log: self,
            next_in_file: 0,
            bytes: Vec::new(),
            chunk: Vec::new(),
            at: 0,
            in_tail: 0,
            error: None,
        }
    }
}

/// See [`SpillLog::iter`].
pub struct Iter<'a, R> {
    log: &'a SpillLog<R>,
    /// The next record of the file to read.
    next_in_file: u64,
    bytes: Vec<u8>,
    chunk: Vec<R>,
    at: usize,
    in_tail: usize,
    error: Option<String>,
}

impl<R: Record> Iter<'_, R> {
    /// Why this iteration skipped the rest of the file, if it did.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// Reads the next chunk of the file; false at its end or on an error.
    fn refill(&mut self) -> bool {
        let Some(file) = &self.log.file else {
            return false;
        };
        let left = self.log.in_file - self.next_in_file;
        if left == 0 {
            return false;
        }
        let n = (left as usize).min(CHUNK);
        self.bytes.resize(n * R::BYTES, 0);
        if let Err(e) = file.read_exact_at(&mut self.bytes, self.next_in_file * R::BYTES as u64) {
            let msg = format!(
                "the {}' temporary file could not be read back: {e}",
                self.log.what
            );
            self.log
                .read_error
                .borrow_mut()
                .get_or_insert_with(|| msg.clone());
            self.error = Some(msg);
            self.next_in_file = self.log.in_file;
            return false;
        }
        self.chunk.clear();
        self.chunk
            .extend(self.bytes.chunks_exact(R::BYTES).map(R::decode));
        self.at = 0;
        self.next_in_file += n as u64;
        true
    }
}

impl<R: Record> Iterator for Iter<'_, R> {
    type Item = R;

    fn next(&mut self) -> Option<R> {
        if self.at < self.chunk.len() || self.refill() {
            self.at += 1;
            return Some(self.chunk[self.at - 1]);
        }
        let r = self.log.tail.get(self.in_tail).copied();
        self.in_tail += 1;
        r
    }
}

/// A file in `dir` that has no name: `O_TMPFILE`, or where the filesystem
/// has no such thing, a `mkstemp` file unlinked at once.
pub(crate) fn unnamed_file(dir: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .mode(0o600)
        .open(dir)
    {
        Ok(f) => Ok(f),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::PermissionDenied | io::ErrorKind::NotFound
            ) =>
        {
            Err(e)
        }
        // EOPNOTSUPP (the filesystem), EISDIR (a kernel without
        // O_TMPFILE): the other way.
        Err(_) => unlinked_file(dir),
    }
}

/// A new file in `dir` (mkostemp: a random name, O_EXCL), unlinked before
/// anything is written to it.
fn unlinked_file(dir: &Path) -> io::Result<File> {
    let (file, path) = crate::sys::temp_file(dir, "slotprof-spill-")?;
    std::fs::remove_file(path)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Pair(u64, u32);

    impl Record for Pair {
        const BYTES: usize = 12;
        fn encode(&self, out: &mut Vec<u8>) {
            out.extend_from_slice(&self.0.to_le_bytes());
            out.extend_from_slice(&self.1.to_le_bytes());
        }
        fn decode(b: &[u8]) -> Self {
            Pair(
                u64::from_le_bytes(b[..8].try_into().unwrap()),
                u32::from_le_bytes(b[8..12].try_into().unwrap()),
            )
        }
    }

    fn pair(i: u64) -> Pair {
        Pair(i * 3, i as u32 ^ 0x5a5a)
    }

    #[test]
    fn records_past_the_memory_bound_go_to_the_file_and_come_back_in_order_twice() {
        let mut log = SpillLog::new("pairs", 1000);
        let n = 1000 * 2 + CHUNK as u64 * 2 + 17;
        for i in 0..n {
            log.push(pair(i));
        }
        assert_eq!(log.len(), n);
        assert!(log.file_error().is_none(), "{:?}", log.file_error());
        assert!(log.file_bytes() > 0 && log.file_bytes().is_multiple_of(Pair::BYTES as u64));
        assert!(log.tail.len() < 1000);
        for _ in 0..2 {
            let mut it = log.iter();
            let back: Vec<Pair> = it.by_ref().collect();
            assert_eq!(back.len() as u64, n);
            assert!(back.iter().enumerate().all(|(i, p)| *p == pair(i as u64)));
            assert!(it.error().is_none());
        }
        assert!(log.read_error().is_none());
    }

    #[test]
    fn small_logs_never_make_a_file() {
        let mut log = SpillLog::new("pairs", 1000);
        (0..100).for_each(|i| log.push(pair(i)));
        assert!(log.file.is_none());
        assert_eq!(log.iter().count(), 100);
    }

    #[test]
    fn a_file_that_cannot_be_read_back_ends_the_iteration_there_and_says_why() {
        let mut log = SpillLog::new("pairs", 10);
        (0..25).for_each(|i| log.push(pair(i)));
        assert_eq!(log.in_file, 20);
        // Taken from under the log: the same fd, shortened.
        log.file.as_ref().unwrap().set_len(5).unwrap();
        let mut it = log.iter();
        let back: Vec<Pair> = it.by_ref().collect();
        assert_eq!(
            back,
            (20..25).map(pair).collect::<Vec<_>>(),
            "the memory part still comes"
        );
        assert!(
            it.error().unwrap().contains("pairs' temporary file"),
            "{:?}",
            it.error()
        );
        assert!(log.read_error().is_some());
    }

    #[test]
    fn the_file_has_no_name_either_way() {
        for make in [unnamed_file, unlinked_file] {
            let dir = test_dir();
            let mut f = make(&dir).unwrap();
            f.write_all(b"x").unwrap();
            assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
            drop(f);
            std::fs::remove_dir(&dir).unwrap();
        }
    }

    fn test_dir() -> std::path::PathBuf {
        let mut t = std::env::temp_dir()
            .join("slotprof-unit-XXXXXX")
            .into_os_string()
            .into_encoded_bytes();
        t.push(0);
        // SAFETY: NUL-terminated template that mkdtemp may rewrite.
        let p = unsafe { libc::mkdtemp(t.as_mut_ptr().cast()) };
        assert!(!p.is_null());
        t.pop();
        std::path::PathBuf::from(String::from_utf8(t).unwrap())
    }
}
