//! The one event stream every driver reads: the ring buffer's batches,
//! through the user-stack unwinder ([`UserStacks`]), as decoded events into
//! the driver's [`Sink`] (a session's aggregator, `run`'s pending slots).

use super::{
    events::Event,
    ring_reader::{Batch, RingReader},
    user_stacks::UserStacks,
};

/// Where a driver takes the stream's events.
pub trait Sink {
    /// One decoded event (its user stacks unwound).
    fn event(&mut self, event: Event);
    /// A record that did not decode (counted, never trusted).
    fn malformed(&mut self);
    /// Every raw record before it is decoded (`--save-events`); nothing by
    /// default.
    fn raw(&mut self, _record: &[u8]) {}
}

/// Feeds every batch the reader has queued.
pub fn drain(ring: &mut RingReader, user: &mut UserStacks, sink: &mut impl Sink) {
    while let Some(batch) = ring.try_recv() {
        feed(&batch, user, sink);
    }
}

/// Feeds one batch, record by record.
pub fn feed(batch: &Batch, user: &mut UserStacks, sink: &mut impl Sink) {
    user.begin_batch();
    for record in batch.records() {
        sink.raw(record);
        if user.feed(record, &mut |e| sink.event(e)).is_err() {
            sink.malformed();
        }
    }
}
