//! The ring buffer's reader: a thread of its own that only copies records
//! out of the kernel's ring into a bounded queue in memory.
//!
//! The loop that decodes, unwinds, aggregates and writes slots can stop
//! for a while: the first symbolization of a new binary, an `fsync` of
//! the export on a slow disk, a CPU the validator keeps busy. With the
//! reader on that loop, the 4 MiB ring filled during such a pause (a
//! 30-minute run on the real node lost 5,426 records to a full ring).
//! Copying a record out takes microseconds and never waits on anything
//! else, so the kernel's ring stays near empty; a pause costs memory here,
//! up to [`BACKLOG_BYTES`], and only a pause long enough to fill that
//! loses records, counted as `backlog_full`.
//!
//! Batches are chunks of [`CHUNK_BYTES`], a drain filling as many as it
//! needs, and what the queue counts against its bound is their capacity:
//! memory held is what was copied, never a fixed buffer per drain. (With
//! one 1 MiB buffer per drain, a drain of ~200 KB held 1 MiB: a 0.7 s
//! pause of the loop at start, while it read the validator's unwind
//! tables, queued 68 MiB of buffers for 14 MiB of records, the heap's
//! peak for the rest of the run, heaptrack on `run` on the real node.)
//! Taken chunks go back to the reader, up to [`SPARE_CHUNKS`] kept: a
//! steady stream reuses them instead of allocating and freeing ~20 MiB/s.
//! The reader drains the ring every [`PACE_MS`]: a 4 MiB ring at a loaded
//! node's ~20 MiB/s takes ~200 ms to fill, and each wakeup of the reader
//! (and of the loop it hands batches to) is a context switch: at 10 ms,
//! the reader thread was 8.9% of `run`'s CPU on the real node, nearly all
//! of it in the switch itself. A drain that found the ring over a quarter
//! full goes again at once instead of waiting (a burst never waits a pace
//! with the ring filling).

use std::{
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    thread::JoinHandle,
};

use aya::maps::{MapData, RingBuf};
use tokio::sync::mpsc;

/// What the queue may hold before records are dropped: several seconds of
/// a busy validator's records (stack copies included).
pub const BACKLOG_BYTES: usize = 64 << 20;

/// A batch is sent before it would hold more than this (or once the ring
/// is empty); its buffer is allocated at this size once. Larger than the
/// largest record the kernel side makes (a 32 KiB stack copy and its
/// header).
const CHUNK_BYTES: usize = 64 << 10;

/// Empty chunks kept for reuse (the rest are freed): 40 ms of a loaded
/// node's records.
const SPARE_CHUNKS: usize = 16;

/// The time between two drains of the ring (unless the last one found it
/// over [`BURST_BYTES`]).
const PACE_MS: u64 = 25;

/// A drain that took this much does not wait [`PACE_MS`] for the next.
const BURST_BYTES: usize = (profiler_ebpf::RING_BYTES / 4) as usize;

/// How long the reader sleeps in `poll` before it looks at its stop flag.
const POLL_MS: i32 = 50;

/// Records copied out of the ring, in order: each a native-endian `u32`
/// length, then that many bytes.
pub struct Batch {
    bytes: Vec<u8>,
    /// What this batch counts in the queue's bytes (its capacity).
    counted: usize,
    queued: Arc<AtomicUsize>,
    spare: Spare,
}

/// Empty buffers for the next batches.
type Spare = Arc<std::sync::Mutex<Vec<Vec<u8>>>>;

impl Batch {
    /// The records, oldest first.
    pub fn records(&self) -> Records<'_> {
        Records { rest: &self.bytes }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.counted, Ordering::Relaxed);
        let mut bytes = std::mem::take(&mut self.bytes);
        if bytes.capacity() == CHUNK_BYTES {
            bytes.clear();
            if let Ok(mut spare) = self.spare.lock() {
                if spare.len() < SPARE_CHUNKS {
                    spare.push(bytes);
                }
            }
        }
    }
}

/// Iterator over a [`Batch`]'s records.
pub struct Records<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Records<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let (len, rest) = self.rest.split_first_chunk::<4>()?;
        let len = u32::from_ne_bytes(*len) as usize;
        let (record, rest) = rest.split_at_checked(len)?;
        self.rest = rest;
        Some(record)
    }
}

/// Appends records to batches and sends them while the queue has room.
struct Batcher {
    tx: mpsc::UnboundedSender<Batch>,
    queued: Arc<AtomicUsize>,
    dropped: Arc<AtomicU64>,
    limit: usize,
    bytes: Vec<u8>,
    /// Records in `bytes`.
    records: u64,
    spare: Spare,
}

impl Batcher {
    fn push(&mut self, record: &[u8]) {
        let len = 4 + record.len();
        if self.bytes.len() + len > CHUNK_BYTES {
            self.send();
        }
        if self.bytes.capacity() == 0 {
            self.bytes = self
                .spare
                .lock()
                .ok()
                .and_then(|mut s| s.pop())
                .unwrap_or_else(|| Vec::with_capacity(CHUNK_BYTES));
        }
        // (A record over CHUNK_BYTES, which the kernel side never makes,
        // would grow this one buffer; it is then not kept.)
        self.bytes.extend_from_slice(&(record.len() as u32).to_ne_bytes());
        self.bytes.extend_from_slice(record);
        self.records += 1;
    }

    /// Sends what has been collected, or drops it (counted) when the queue
    /// is at its bound or its receiver has gone.
    fn send(&mut self) {
        if self.bytes.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut self.bytes);
        let records = std::mem::take(&mut self.records);
        let counted = bytes.capacity();
        if self.queued.load(Ordering::Relaxed) + counted > self.limit {
            self.dropped.fetch_add(records, Ordering::Relaxed);
            // The chunk itself is reused.
            self.bytes = bytes;
            self.bytes.clear();
            return;
        }
        self.queued.fetch_add(counted, Ordering::Relaxed);
        let batch = Batch {
            bytes,
            counted,
            queued: self.queued.clone(),
            spare: self.spare.clone(),
        };
        if let Err(e) = self.tx.send(batch) {
            // Dropping the batch gives its bytes back to the count.
            drop(e);
            self.dropped.fetch_add(records, Ordering::Relaxed);
        }
    }
}

/// The reader thread and its queue.
pub struct RingReader {
    rx: mpsc::UnboundedReceiver<Batch>,
    /// CLOCK_MONOTONIC ns at which the reader's last complete drain of the
    /// ring began: every record committed before it is queued.
    synced: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    dropped: Arc<AtomicU64>,
    queued: Arc<AtomicUsize>,
    thread: Option<JoinHandle<RingBuf<MapData>>>,
}

impl RingReader {
    /// Starts reading `ring` on a thread of its own.
    pub fn start(ring: RingBuf<MapData>) -> anyhow::Result<Self> {
        Self::with_limit(ring, BACKLOG_BYTES)
    }

    fn with_limit(mut ring: RingBuf<MapData>, limit: usize) -> anyhow::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicU64::new(0));
        let queued = Arc::new(AtomicUsize::new(0));
        let mut batcher = Batcher {
            tx,
            queued: queued.clone(),
            dropped: dropped.clone(),
            limit,
            bytes: Vec::new(),
            records: 0,
            spare: Spare::default(),
        };
        let stopping = stop.clone();
        let synced = Arc::new(AtomicU64::new(0));
        let synced_by_reader = synced.clone();
        let thread = std::thread::Builder::new()
            .name("slotprof-ring".into())
            .spawn(move || {
                let fd = ring.as_raw_fd();
                loop {
                    let last = stopping.load(Ordering::Acquire);
                    let began = crate::slots::monotonic_ns();
                    let mut drained = 0;
                    while let Some(item) = ring.next() {
                        drained += item.len();
                        batcher.push(&item);
                    }
                    batcher.send();
                    synced_by_reader.store(began, Ordering::Release);
                    if last {
                        return ring;
                    }
                    if drained < BURST_BYTES {
                        std::thread::sleep(std::time::Duration::from_millis(PACE_MS));
                        crate::sys::wait_readable(fd, POLL_MS);
                    }
                }
            })
            .map_err(|e| anyhow::anyhow!("cannot start the ring buffer's reader thread: {e}"))?;
        Ok(Self {
            rx,
            synced,
            stop,
            dropped,
            queued,
            thread: Some(thread),
        })
    }

    /// The next batch; `None` once the reader has stopped and every batch
    /// has been taken.
    pub async fn recv(&mut self) -> Option<Batch> {
        self.rx.recv().await
    }

    /// A batch already queued, without waiting.
    pub fn try_recv(&mut self) -> Option<Batch> {
        self.rx.try_recv().ok()
    }

    /// Every record committed before this CLOCK_MONOTONIC time is queued
    /// (read it before taking the queued batches): the reader drains the
    /// ring only every [`PACE_MS`], so a slot may be cut only up to here.
    pub fn synced_ns(&self) -> u64 {
        self.synced.load(Ordering::Acquire)
    }

    /// Records dropped because the queue was at its bound.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Bytes queued now (the batches' buffers, not only their records).
    pub fn queued_bytes(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Stops the thread after one last read of the ring and gives the ring
    /// back; what it read stays queued for [`Self::try_recv`].
    pub fn finish(&mut self) -> Option<RingBuf<MapData>> {
        self.stop.store(true, Ordering::Release);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for RingReader {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher(limit: usize) -> (Batcher, mpsc::UnboundedReceiver<Batch>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Batcher {
                tx,
                queued: Arc::new(AtomicUsize::new(0)),
                dropped: Arc::new(AtomicU64::new(0)),
                limit,
                bytes: Vec::new(),
                records: 0,
                spare: Spare::default(),
            },
            rx,
        )
    }

    #[test]
    fn records_come_back_whole_and_in_order() {
        let (mut b, mut rx) = batcher(1 << 20);
        let records: Vec<Vec<u8>> = vec![vec![1, 2, 3], vec![], vec![9; 1000], vec![7]];
        for r in &records {
            b.push(r);
        }
        b.send();
        let batch = rx.try_recv().unwrap();
        assert_eq!(batch.records().map(<[u8]>::to_vec).collect::<Vec<_>>(), records);
        assert!(rx.try_recv().is_err(), "one batch");
        assert_eq!(b.dropped.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_batch_is_sent_before_it_would_outgrow_its_chunk_and_the_chunk_comes_back() {
        let (mut b, mut rx) = batcher(16 << 20);
        let big = vec![0u8; CHUNK_BYTES / 2 - 4];
        b.push(&big);
        b.push(&big);
        assert!(rx.try_recv().is_err(), "exactly full: not sent yet");
        b.push(&[1]);
        let first = rx.try_recv().unwrap();
        assert_eq!(first.records().count(), 2);
        assert_eq!(first.bytes.capacity(), CHUNK_BYTES, "never grown");
        let buffers = [first.bytes.as_ptr()];
        drop(first);
        assert_eq!(b.spare.lock().unwrap().len(), 1, "its chunk is kept");
        b.send();
        let second = rx.try_recv().unwrap();
        assert_eq!(second.records().next().unwrap(), &[1]);
        let buffers = [buffers[0], second.bytes.as_ptr()];
        drop(second);
        assert_eq!(b.spare.lock().unwrap().len(), 2);
        b.push(&[2]);
        b.send();
        let third = rx.try_recv().unwrap();
        assert!(buffers.contains(&third.bytes.as_ptr()), "a spare chunk is reused");
        assert_eq!(b.spare.lock().unwrap().len(), 1);
    }

    #[test]
    fn at_most_spare_chunks_are_kept() {
        let (mut b, mut rx) = batcher(64 << 20);
        let mut held = Vec::new();
        for _ in 0..SPARE_CHUNKS + 3 {
            b.push(&[0; 8]);
            b.send();
            held.push(rx.try_recv().unwrap());
        }
        drop(held);
        assert_eq!(b.spare.lock().unwrap().len(), SPARE_CHUNKS);
    }

    #[test]
    fn the_queue_counts_the_chunks_it_holds_not_only_their_records() {
        // One small record a drain, as an idle target gives: each batch
        // holds a whole chunk, and that is what the bound must see.
        let (mut b, mut rx) = batcher(3 * CHUNK_BYTES);
        for _ in 0..3 {
            b.push(&[5; 10]);
            b.send();
        }
        assert_eq!(b.queued.load(Ordering::Relaxed), 3 * CHUNK_BYTES);
        b.push(&[6; 10]);
        b.send();
        assert_eq!(
            b.dropped.load(Ordering::Relaxed),
            1,
            "a fourth chunk passes the bound"
        );
        let held: Vec<Batch> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(held.len(), 3);
    }

    #[test]
    fn past_the_bound_records_are_dropped_and_counted_and_room_comes_back() {
        let (mut b, mut rx) = batcher(CHUNK_BYTES + 100);
        b.push(&[0; 60]);
        b.send();
        // One chunk queued: a second would pass the bound.
        b.push(&[1; 30]);
        b.push(&[2; 30]);
        b.send();
        assert_eq!(b.dropped.load(Ordering::Relaxed), 2);
        assert_eq!(b.queued.load(Ordering::Relaxed), CHUNK_BYTES);
        let first = rx.try_recv().unwrap();
        assert_eq!(first.records().next().unwrap(), &[0; 60]);
        drop(first);
        assert_eq!(
            b.queued.load(Ordering::Relaxed),
            0,
            "a batch taken frees its bytes"
        );
        b.push(&[3; 30]);
        b.send();
        assert_eq!(rx.try_recv().unwrap().records().next().unwrap(), &[3; 30]);
        assert_eq!(b.dropped.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_receiver_that_has_gone_counts_as_dropped() {
        let (mut b, rx) = batcher(1 << 20);
        drop(rx);
        b.push(&[1]);
        b.send();
        assert_eq!(b.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(b.queued.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_truncated_batch_ends_its_records_instead_of_reading_past() {
        let bytes = [5u8, 0, 0, 0, 1, 2];
        let r = Records { rest: &bytes };
        assert_eq!(r.count(), 0);
    }
}
