//! Decoding ring-buffer records.

use profiler_ebpf::{
    CacheWork, CpuSample, EventKind, FutexWait, HostEvent, LoopMark, MadviseCall, MemStall, OffCpuFold,
    OffCpuInterval, SlotMark, UserRegs,
};

/// One record from the kernel.
#[derive(Clone, Copy, Debug)]
pub enum Event {
    Sample(CpuSample),
    OffCpu(OffCpuInterval),
    /// Short waits of one thread folded in the kernel.
    OffCpuFold(OffCpuFold),
    SlotMark(SlotMark),
    Madvise(MadviseCall),
    MemStall(MemStall),
    CacheWork(CacheWork),
    FutexWait(FutexWait),
    LoopMark(LoopMark),
    UserRegs(UserRegs),
    Host(HostEvent),
}

impl Event {
    /// The record's bytes as the kernel writes them ([`decode`] reads them
    /// back): the `replay` recordings.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            Event::Sample(s) => record_bytes(s),
            Event::OffCpu(o) => record_bytes(o),
            Event::OffCpuFold(f) => record_bytes(f),
            Event::SlotMark(m) => record_bytes(m),
            Event::Madvise(m) => record_bytes(m),
            Event::MemStall(m) => record_bytes(m),
            Event::CacheWork(w) => record_bytes(w),
            Event::FutexWait(f) => record_bytes(f),
            Event::LoopMark(m) => record_bytes(m),
            Event::UserRegs(r) => record_bytes(r),
            Event::Host(h) => record_bytes(h),
        }
    }

    /// The stack ids the event refers to (errors and markers included; the
    /// caller keeps the ones it can read).
    pub fn stack_ids(&self) -> Vec<i32> {
        match self {
            Event::Sample(s) => vec![s.user_stack_id, s.kernel_stack_id],
            Event::OffCpu(o) => vec![o.user_stack_id, o.kernel_stack_id],
            Event::OffCpuFold(f) => vec![f.user_stack_id, f.kernel_stack_id],
            Event::Madvise(m) => vec![m.user_stack_id],
            Event::FutexWait(f) => vec![f.user_stack_id, f.waker_user_stack_id],
            Event::Host(h) => vec![h.kernel_stack_id],
            Event::SlotMark(_)
            | Event::LoopMark(_)
            | Event::UserRegs(_)
            | Event::MemStall(_)
            | Event::CacheWork(_) => Vec::new(),
        }
    }
}

/// Decodes one record; `None` for a record of unknown kind or short length
/// (counted by the caller, never trusted).
pub fn decode(bytes: &[u8]) -> Option<Event> {
    let kind = u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?);
    if kind == EventKind::CpuSample as u32 {
        read::<CpuSample>(bytes).map(Event::Sample)
    } else if kind == EventKind::OffCpu as u32 {
        read::<OffCpuInterval>(bytes).map(Event::OffCpu)
    } else if kind == EventKind::OffCpuFold as u32 {
        read::<OffCpuFold>(bytes).map(Event::OffCpuFold)
    } else if kind == EventKind::SlotMark as u32 {
        read::<SlotMark>(bytes).map(Event::SlotMark)
    } else if kind == EventKind::Madvise as u32 {
        read::<MadviseCall>(bytes).map(Event::Madvise)
    } else if kind == EventKind::MemStall as u32 {
        read::<MemStall>(bytes).map(Event::MemStall)
    } else if kind == EventKind::CacheWork as u32 {
        read::<CacheWork>(bytes).map(Event::CacheWork)
    } else if kind == EventKind::FutexWait as u32 {
        read::<FutexWait>(bytes).map(Event::FutexWait)
    } else if kind == EventKind::LoopMark as u32 {
        read::<LoopMark>(bytes).map(Event::LoopMark)
    } else if kind == EventKind::UserRegs as u32 {
        read::<UserRegs>(bytes).map(Event::UserRegs)
    } else if kind == EventKind::Host as u32 {
        read::<HostEvent>(bytes).map(Event::Host)
    } else {
        None
    }
}

/// Appends one raw record to a saved event stream: its length (u32, little
/// endian), then its bytes as the kernel wrote them.
pub fn write_raw(w: &mut impl std::io::Write, record: &[u8]) -> std::io::Result<()> {
    w.write_all(&(record.len() as u32).to_le_bytes())?;
    w.write_all(record)
}

/// The records of a saved event stream, in order.
pub fn read_raw(mut bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while bytes.len() >= 4 {
        let n = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        let Some(record) = bytes.get(4..4 + n) else { break };
        out.push(record);
        bytes = &bytes[4 + n..];
    }
    out
}

/// Reads a plain-data record from the start of `bytes`.
fn read<T: Copy>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: length checked; T is a repr(C) plain-data record (every bit
    // pattern valid) and read_unaligned copes with the ring's alignment.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// A kernel `comm` as text: up to the first NUL, lossy UTF-8.
pub fn comm_str(comm: &[u8]) -> String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

/// A record's bytes as the kernel writes them (for tests).
#[cfg(test)]
pub(crate) fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
    record_bytes(v)
}

/// The bytes of a plain-data record.
fn record_bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: the records are repr(C) plain data laid out without implicit
    // padding (the eBPF side writes every byte: the verifier rejects
    // uninitialized stack bytes in a ring-buffer output), read as bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }.to_vec()
}

#[cfg(test)]
mod tests {

    /// `Event::to_bytes` reads whole records as bytes: none may have
    /// padding. Each size here is the sum of the record's field sizes (as
    /// declared in profiler-ebpf), so a size_of that differs means padding
    /// (or a changed record: then this table and replay recordings change).
    #[test]
    fn replayed_records_have_no_padding_and_round_trip() {
        use std::mem::size_of;
        assert_eq!(size_of::<CpuSample>(), 4 + 4 + 8 + 4 + 4 + 4 + 4 + 16);
        assert_eq!(size_of::<OffCpuInterval>(), 128);
        assert_eq!(size_of::<SlotMark>(), 32);
        assert_eq!(size_of::<MadviseCall>(), 80);
        assert_eq!(size_of::<MemStall>(), 4 + 4 + 8 + 8 + 4 + 4 + 4 + 4 + 8 + 16);
        assert_eq!(size_of::<CacheWork>(), 4 + 4 + 8 + 8 + 4 + 4 + 4 + 4 + 16);
        assert_eq!(size_of::<FutexWait>(), 112);
        assert_eq!(size_of::<LoopMark>(), 32);
        assert_eq!(size_of::<UserRegs>(), 4 + 4 + 8 + 4 + 4 + 21 * 8);
        assert_eq!(
            size_of::<OffCpuFold>(),
            4 + 4 + 8 + 8 + 4 + 4 + 8 + 8 + 4 + 4 + 4 + 4 + 8 + 8 + 8 + 16
        );
        assert_eq!(size_of::<profiler_ebpf::FoldState>(), 7 * 8 + 4 * 4);
        // SAFETY: a plain-data record (integers and byte arrays): all zeros is a valid value.
        let mut s: CpuSample = unsafe { std::mem::zeroed() };
        (s.kind, s.ts_ns, s.tid) = (EventKind::CpuSample as u32, 77, 5);
        match decode(&Event::Sample(s).to_bytes()) {
            Some(Event::Sample(back)) => assert_eq!((back.ts_ns, back.tid), (77, 5)),
            other => panic!("{other:?}"),
        }
    }

    use super::*;

    #[test]
    fn stack_ids_carry_their_epoch_and_stay_positive() {
        use profiler_ebpf::{split_stack_id, stack_id_with_epoch, STACK_EPOCH_MASK, STACK_MAP_ENTRIES};
        for epoch in [0, 1, 2, 77, STACK_EPOCH_MASK] {
            for index in [0, 1, STACK_MAP_ENTRIES - 1] {
                let id = stack_id_with_epoch(index, epoch);
                assert!(id >= 0, "{epoch} {index}");
                assert_eq!(split_stack_id(id), (epoch, index));
            }
        }
        // Epochs wrap: the one after the last is 0 again.
        assert_eq!(stack_id_with_epoch(5, STACK_EPOCH_MASK + 1), 5);
    }

    #[test]
    fn decodes_by_kind_and_rejects_short_or_unknown() {
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"main");
        let s = CpuSample {
            kind: EventKind::CpuSample as u32,
            cpu: 1,
            ts_ns: 5,
            tgid: 10,
            tid: 11,
            user_stack_id: 3,
            kernel_stack_id: -14,
            comm,
        };
        let b = bytes_of(&s);
        match decode(&b) {
            Some(Event::Sample(d)) => {
                assert_eq!((d.tid, d.user_stack_id, d.kernel_stack_id), (11, 3, -14));
                assert_eq!(comm_str(&d.comm), "main");
            }
            other => panic!("{other:?}"),
        }
        assert!(decode(&b[..20]).is_none());
        let mut unknown = b.clone();
        unknown[0] = 99;
        assert!(decode(&unknown).is_none());
    }
}
