//! User stacks from a copy of the top of the stack and three registers,
//! unwound in userspace with each module's own call-frame information
//! (`.eh_frame` with its `.eh_frame_hdr` index, or `.debug_frame`), the way
//! `perf --call-graph dwarf` does. Frame pointers are the fallback where no
//! CFI covers an address (JIT and anonymous code, a module without CFI, a
//! module whose CFI is corrupt); the per-module statistics say which was used.
//!
//! No table is built: `.eh_frame_hdr` already is a sorted index of the
//! module's FDEs, so a module costs the bytes of those two sections (read
//! once per file, shared by every process that maps it) and a lookup is a
//! binary search. [framehop] does the CFI evaluation.

use foldhash::{HashMap, HashMapExt};
use std::{
    ops::Range,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use framehop::{
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
    FrameAddress, Module, Unwinder as _,
};

pub use crate::cfi::Cfi;
use crate::cfi::ModuleData;
use crate::maps::{Mapping, ProcessMaps};

/// Frames kept per user stack; a deeper stack ends in [`marker::TRUNCATED`].
pub const MAX_FRAMES: usize = 128;

/// Bounds of the wait between two reads of a process's memory map for
/// unknown code.
const REFRESH_MIN: Duration = Duration::from_millis(10);
const REFRESH_MAX: Duration = Duration::from_secs(10);

/// Values that end an unwound stack to say why it ended there. They sit
/// above the canonical user address range, so no real frame has them;
/// [`marker::name`] renders them.
pub mod marker {
    /// More than [`super::MAX_FRAMES`] frames: the rest was dropped.
    pub const TRUNCATED: u64 = 0xffff_ffff_ffff_ff01;
    /// The frame before it is in code with neither CFI nor a usable frame
    /// pointer chain: nothing above it can be found.
    pub const NO_UNWIND_INFO: u64 = 0xffff_ffff_ffff_ff02;
    /// The copy of the stack ended before the stack did.
    pub const STACK_COPY_END: u64 = 0xffff_ffff_ffff_ff03;
    /// The unwinder stopped on an inconsistent frame (a corrupt stack, or
    /// CFI that does not describe the code).
    pub const UNWIND_ERROR: u64 = 0xffff_ffff_ffff_ff04;
    /// No user stack was taken for this event (the thread never returned
    /// to user space to have it copied, or the copy failed).
    pub const NOT_TAKEN: u64 = 0xffff_ffff_ffff_ff05;

    /// Whether `addr` is one of the markers.
    pub const fn is_marker(addr: u64) -> bool {
        addr >= TRUNCATED && addr <= NOT_TAKEN
    }

    /// The frame name of a marker (`previous` is the frame before it,
    /// leaf side, already named `module+0xoff` by the caller when needed).
    pub fn name(addr: u64) -> &'static str {
        match addr {
            TRUNCATED => "[truncated]",
            NO_UNWIND_INFO => "[no unwind info]",
            STACK_COPY_END => "[stack copy ended]",
            UNWIND_ERROR => "[unwind error]",
            _ => "[user stack not taken]",
        }
    }
}

/// Identity of a mapped file (or of a process's vDSO).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum FileKey {
    File {
        dev: u64,
        ino: u64,
        size: u64,
        mtime: i64,
    },
    Vdso,
}

/// How the frames of one module were unwound, for the summary.
#[derive(Clone, Debug, Default)]
pub struct ModuleStats {
    /// `cfi`, or which frame-pointer fallback and why.
    pub unwinding: String,
    pub build_id: Option<String>,
    /// Frames found in this module.
    pub frames: u64,
    /// Stacks that ended in this module for want of unwind information.
    pub no_unwind_info: u64,
    /// Bytes of unwind sections held for it.
    pub table_bytes: usize,
    /// Why its CFI was not used, when it was not.
    pub note: Option<String>,
}

/// Totals over every stack unwound.
#[derive(Clone, Debug, Default)]
pub struct UnwindTotals {
    pub stacks: u64,
    /// Reached the thread's first frame (CFI said so, or a null frame pointer).
    pub complete: u64,
    pub truncated: u64,
    pub stack_copy_end: u64,
    pub no_unwind_info: u64,
    pub errors: u64,
    /// Frames in code that no file backs (JIT, anonymous): unwound with frame pointers.
    pub anonymous_frames: u64,
    /// Stack bytes unwound from.
    pub stack_bytes: u64,
    /// Stacks that began as a remembered walk and held the same words
    /// where it read: its frames, without walking again.
    pub remembered: u64,
}

/// Why a stack ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Complete,
    Truncated,
    StackCopyEnd,
    NoUnwindInfo,
    Error,
}

struct ProcessUnwinder {
    signature: u64,
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    /// Sorted by start.
    ranges: Vec<ModuleRange>,
}

/// A code mapping of a process: which module's statistics its frames count
/// in, and whether its CFI is used.
struct ModuleRange {
    range: Range<u64>,
    stats: usize,
    cfi: bool,
    file: FileKey,
}

/// Unwinds the user stacks of the processes it is told about.
pub struct Unwinder {
    files: HashMap<FileKey, Arc<ModuleData>>,
    processes: HashMap<u32, ProcessUnwinder>,
    cache: CacheX86_64,
    /// Per module label, in first-seen order; `stats_index` finds one.
    stats: Vec<(String, ModuleStats)>,
    stats_index: HashMap<String, usize>,
    /// When each process's memory map was last read here, and how long
    /// until it may be read again.
    refreshed: HashMap<u32, (Instant, Duration)>,
    pub totals: UnwindTotals,
    /// Warnings not yet said (a corrupt module's CFI, once per file).
    warnings: Vec<String>,
    /// Recent walks by where they began (see [`Remembered`]).
    walks: HashMap<WalkKey, Remembered>,
}

/// Where a walk began: the process and the three registers.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct WalkKey {
    pid: u32,
    ip: u64,
    sp: u64,
    bp: u64,
}

/// A walk as it went: every stack word it read (offset from `sp`, value)
/// in order, and the read that failed, if one ended it. A walk is a
/// function of the registers, the modules and the words it read, so a new
/// stack that begins with the same registers and holds the same values at
/// those offsets walks to the same frames; only the words are compared,
/// not the frames re-derived. A thread that waits again where it waited
/// before (most waits of a validator's 160 threads) costs a few compares
/// instead of a walk through the CFI of a 77 MB binary.
struct Remembered {
    offsets: Box<[u32]>,
    values: Box<[u64]>,
    failed_at: Option<u64>,
    frames: Box<[u64]>,
    end: End,
    reach: u64,
}

/// Walks remembered at most; past it the memory starts over (a validator
/// has a few hundred distinct wait sites).
const REMEMBERED_WALKS: usize = 8192;

impl Remembered {
    /// Whether `stack` (from `sp`, the key's) holds what this walk read.
    fn holds(&self, sp: u64, stack: &[u8]) -> bool {
        self.offsets
            .iter()
            .zip(self.values.iter())
            .all(|(&off, &v)| read_word(sp, stack, sp + off as u64) == Some(v))
            && self
                .failed_at
                .is_none_or(|addr| read_word(sp, stack, addr).is_none())
    }
}

/// A walk's read offsets and the values found there.
type Words = (Box<[u32]>, Box<[u64]>);

/// The words one walk read.
#[derive(Default)]
struct Reads {
    words: Vec<(u64, u64)>,
    failed_at: Option<u64>,
}

impl Reads {
    /// Offsets and values apart (12 bytes a word, not 16), unless an
    /// offset is past 4 GiB.
    fn compact(&self) -> Option<Words> {
        let offsets = self
            .words
            .iter()
            .map(|&(off, _)| u32::try_from(off).ok())
            .collect::<Option<Box<[u32]>>>()?;
        Some((offsets, self.words.iter().map(|&(_, v)| v).collect()))
    }
}

/// The little-endian word at `addr` of a stack copied from `sp`, if the
/// copy holds it.
fn read_word(sp: u64, stack: &[u8], addr: u64) -> Option<u64> {
    let off = usize::try_from(addr.checked_sub(sp)?).ok()?;
    let b = stack.get(off..off.checked_add(8)?)?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

impl Default for Unwinder {
    fn default() -> Self {
        Self::new()
    }
}

impl Unwinder {
    pub fn new() -> Self {
        Self {
            files: HashMap::new(),
            processes: HashMap::new(),
            cache: CacheX86_64::new(),
            stats: Vec::new(),
            stats_index: HashMap::new(),
            refreshed: HashMap::new(),
            totals: UnwindTotals::default(),
            warnings: Vec::new(),
            walks: HashMap::new(),
        }
    }

    /// Brings the modules known for `pid` in line with `maps` (cheap when
    /// its code mappings did not change).
    fn sync(&mut self, pid: u32, maps: &ProcessMaps) {
        let code: Vec<&Mapping> = maps.mappings().iter().filter(|m| m.executable).collect();
        let signature = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for m in &code {
                (m.start, m.end, m.file_offset, &m.path, &m.label).hash(&mut h);
            }
            h.finish()
        };
        if self.processes.get(&pid).is_some_and(|p| p.signature == signature) {
            return;
        }
        // Its modules change: a remembered walk may no longer hold.
        self.walks.retain(|k, _| k.pid != pid);
        let mut unwinder = UnwinderX86_64::new();
        let mut ranges = Vec::new();
        for m in code {
            let Some((key, data)) = self.module_for(pid, m) else {
                continue;
            };
            let Some(bias) = data.bias(m.start, m.file_offset) else {
                continue;
            };
            let name = m.label.clone();
            let index = *self.stats_index.entry(name.clone()).or_insert_with(|| {
                self.stats.push((name.clone(), ModuleStats::default()));
                self.stats.len() - 1
            });
            let stats = &mut self.stats[index].1;
            stats.unwinding = data.cfi.label().to_string();
            stats.build_id = data.build_id.clone();
            stats.table_bytes = data.bytes;
            stats.note = match &data.cfi {
                Cfi::Corrupt(e) | Cfi::Unreadable(e) => Some(e.clone()),
                _ => None,
            };
            unwinder.add_module(Module::new(
                name.clone(),
                m.start..m.end,
                bias,
                data.section_info(),
            ));
            ranges.push(ModuleRange {
                range: m.start..m.end,
                stats: index,
                cfi: data.cfi.usable(),
                file: key,
            });
        }
        ranges.sort_by_key(|r| r.range.start);
        self.processes.insert(
            pid,
            ProcessUnwinder {
                signature,
                unwinder,
                ranges,
            },
        );
        // Files no process maps any more (a library unloaded, a restart).
        let live: std::collections::HashSet<&FileKey> = self
            .processes
            .values()
            .flat_map(|p| p.ranges.iter().map(|r| &r.file))
            .collect();
        self.files.retain(|k, _| live.contains(k));
    }

    fn module_for(&mut self, pid: u32, m: &Mapping) -> Option<(FileKey, Arc<ModuleData>)> {
        if m.label == "[vdso]" {
            let key = FileKey::Vdso;
            if let Some(d) = self.files.get(&key) {
                return Some((key, d.clone()));
            }
            let mut image = vec![0u8; (m.end - m.start).min(1 << 20) as usize];
            let n = read_memory(pid, m.start, &mut image);
            let data = Arc::new(ModuleData::parse(&image[..n]));
            self.note_once(&m.label, &data);
            self.files.insert(key.clone(), data.clone());
            return Some((key, data));
        }
        let path = m.path.as_ref()?;
        let open = open_mapped(pid, m, path)?;
        let meta = open.metadata().ok()?;
        use std::os::unix::fs::MetadataExt;
        let key = FileKey::File {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: meta.mtime(),
        };
        if let Some(d) = self.files.get(&key) {
            return Some((key, d.clone()));
        }
        let data = Arc::new(ModuleData::from_file(Ok(open)));
        self.note_once(&m.label, &data);
        self.files.insert(key.clone(), data.clone());
        Some((key, data))
    }

    fn note_once(&mut self, label: &str, data: &ModuleData) {
        if let Cfi::Corrupt(e) = &data.cfi {
            self.warnings.push(format!(
                "{label}: its unwind information (.eh_frame) is corrupt ({e}); its frames are \
                 unwound with frame pointers"
            ));
        }
    }

    /// Warnings to say once (and then forget).
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    /// Per module (by label, in first-seen order): how its frames were unwound.
    pub fn module_stats(&self) -> impl Iterator<Item = (&str, &ModuleStats)> {
        self.stats.iter().map(|(m, s)| (m.as_str(), s))
    }

    /// Bytes of unwind sections held now.
    pub fn table_bytes(&self) -> usize {
        self.files.values().map(|d| d.bytes).sum()
    }

    /// Unwinds one user stack of `pid`: `stack` is a copy of its memory from
    /// `sp` up. Returns the frames, leaf first (the first is `ip`, the rest
    /// return addresses), ending in a [`marker`] unless the stack was
    /// complete; and the end of the highest stack word read (for a complete
    /// stack: where the thread's outermost frame ends).
    ///
    /// The process's modules are read from its /proc/PID/maps the first
    /// time, and again when a stack leads into code no known module holds:
    /// a library mapped since, or the first moments of a command that is
    /// still loading its libraries.
    pub fn unwind(&mut self, pid: u32, ip: u64, sp: u64, bp: u64, stack: &[u8]) -> (Vec<u64>, End, u64) {
        self.totals.stacks += 1;
        self.totals.stack_bytes += stack.len() as u64;
        if !self.processes.contains_key(&pid) {
            self.refresh(pid);
        }
        let key = WalkKey { pid, ip, sp, bp };
        let walked = match self.walks.get(&key).filter(|r| r.holds(sp, stack)) {
            Some(r) => {
                self.totals.remembered += 1;
                (r.frames.to_vec(), r.end, r.reach)
            }
            None => self.walk_and_remember(key, stack),
        };
        let (mut frames, end, reach) = walked;
        self.account(pid, &mut frames, end);
        let end = end_of(&frames);
        (frames, end, reach)
    }

    /// Walks a stack not remembered (or no longer the same), reading the
    /// map again where it leads into unknown code, and remembers it.
    fn walk_and_remember(&mut self, key: WalkKey, stack: &[u8]) -> (Vec<u64>, End, u64) {
        let WalkKey { pid, ip, sp, bp } = key;
        let mut reads = Reads::default();
        let mut walked = self.walk(pid, ip, sp, bp, stack, &mut reads);
        if self.stopped_in_unknown_code(pid, &walked.0) && self.refresh(pid) {
            reads = Reads::default();
            walked = self.walk(pid, ip, sp, bp, stack, &mut reads);
            // Code no file backs (a JIT) stays unknown however often the
            // map is read: back off (10 ms, doubling to 10 s) until a read
            // helps again.
            let helped = !self.stopped_in_unknown_code(pid, &walked.0);
            if let Some((_, every)) = self.refreshed.get_mut(&pid) {
                *every = if helped {
                    REFRESH_MIN
                } else {
                    (*every * 2).min(REFRESH_MAX)
                };
            }
        }
        // A walk that ended in unknown code is not remembered: the next
        // one may find the code mapped. Nor one whose offsets do not fit.
        if !self.stopped_in_unknown_code(pid, &walked.0) && self.processes.contains_key(&pid) {
            if let Some((offsets, values)) = reads.compact() {
                if self.walks.len() >= REMEMBERED_WALKS {
                    self.walks.clear();
                }
                self.walks.insert(
                    key,
                    Remembered {
                        offsets,
                        values,
                        failed_at: reads.failed_at,
                        frames: walked.0.clone().into(),
                        end: walked.1,
                        reach: walked.2,
                    },
                );
            }
        }
        walked
    }

    fn stopped_in_unknown_code(&self, pid: u32, frames: &[u64]) -> bool {
        frames.last().is_some_and(|&a| {
            let lookup = if frames.len() == 1 { a } else { a.wrapping_sub(1) };
            self.module_of(pid, lookup).is_none()
        })
    }

    /// Reads `pid`'s memory map again and syncs its modules, unless the
    /// last read was too recent (see [`Self::unwind`]). Returns whether it
    /// was read.
    fn refresh(&mut self, pid: u32) -> bool {
        let now = Instant::now();
        if let Some((last, every)) = self.refreshed.get(&pid) {
            if now.duration_since(*last) < *every {
                return false;
            }
        }
        if self.refreshed.len() >= 4096 {
            self.refreshed.clear();
        }
        let every = self.refreshed.get(&pid).map_or(REFRESH_MIN, |(_, e)| *e);
        self.refreshed.insert(pid, (now, every));
        match ProcessMaps::read(pid) {
            Ok(maps) => {
                self.sync(pid, &maps);
                true
            }
            Err(_) => false,
        }
    }

    /// The frames of one stack and why the walk ended (before accounting).
    fn walk(
        &mut self,
        pid: u32,
        ip: u64,
        sp: u64,
        bp: u64,
        stack: &[u8],
        reads: &mut Reads,
    ) -> (Vec<u64>, End, u64) {
        let mut reach = sp;
        let mut read_stack = |addr: u64| -> Result<u64, ()> {
            match read_word(sp, stack, addr) {
                Some(v) => {
                    reach = reach.max(addr + 8);
                    reads.words.push((addr - sp, v));
                    Ok(v)
                }
                None => {
                    reads.failed_at = Some(addr);
                    Err(())
                }
            }
        };
        let mut frames = Vec::with_capacity(32);
        let end = match self.processes.get(&pid) {
            Some(p) => {
                let mut it = p.unwinder.iter_frames(
                    ip,
                    UnwindRegsX86_64::new(ip, sp, bp),
                    &mut self.cache,
                    &mut read_stack,
                );
                loop {
                    match it.next() {
                        Ok(Some(f)) => {
                            if frames.len() == MAX_FRAMES {
                                break End::Truncated;
                            }
                            frames.push(match f {
                                FrameAddress::InstructionPointer(a) => a,
                                FrameAddress::ReturnAddress(a) => a.get(),
                            });
                        }
                        Ok(None) => break End::Complete,
                        Err(framehop::Error::CouldNotReadStack(_)) => break End::StackCopyEnd,
                        Err(_) => break End::Error,
                    }
                }
            }
            None => {
                frames.push(ip);
                End::NoUnwindInfo
            }
        };
        (frames, end, reach)
    }

    /// Counts a walked stack in the statistics, and ends it with the
    /// marker that says why it ended.
    fn account(&mut self, pid: u32, frames: &mut Vec<u64>, end: End) {
        // Attribute frames to modules; a stack that stopped in a module
        // without usable CFI stopped for want of unwind information.
        let mut last_usable = true;
        for (i, &a) in frames.iter().enumerate() {
            let lookup = if i == 0 { a } else { a.wrapping_sub(1) };
            match self.module_of(pid, lookup) {
                Some((index, usable)) => {
                    last_usable = usable;
                    self.stats[index].1.frames += 1;
                }
                None => {
                    last_usable = false;
                    self.totals.anonymous_frames += 1;
                }
            }
        }
        // Stopping in a module without usable CFI (frame pointers were all
        // there was, and they ended or failed) is for want of unwind info.
        let end = match end {
            End::Error | End::StackCopyEnd | End::Complete if !last_usable => End::NoUnwindInfo,
            e => e,
        };
        match end {
            End::Complete => self.totals.complete += 1,
            End::Truncated => {
                self.totals.truncated += 1;
                frames.push(marker::TRUNCATED);
            }
            End::StackCopyEnd => {
                self.totals.stack_copy_end += 1;
                frames.push(marker::STACK_COPY_END);
            }
            End::NoUnwindInfo => {
                self.totals.no_unwind_info += 1;
                if let Some(&last) = frames.last() {
                    let lookup = if frames.len() == 1 {
                        last
                    } else {
                        last.wrapping_sub(1)
                    };
                    if let Some((index, _)) = self.module_of(pid, lookup) {
                        self.stats[index].1.no_unwind_info += 1;
                    }
                }
                frames.push(marker::NO_UNWIND_INFO);
            }
            End::Error => {
                self.totals.errors += 1;
                frames.push(marker::UNWIND_ERROR);
            }
        }
    }

    /// The statistics index of the module holding `addr` in `pid`, and
    /// whether its CFI is used.
    fn module_of(&self, pid: u32, addr: u64) -> Option<(usize, bool)> {
        let p = self.processes.get(&pid)?;
        let i = p.ranges.partition_point(|r| r.range.start <= addr);
        let r = p.ranges.get(i.checked_sub(1)?)?;
        (addr < r.range.end).then_some((r.stats, r.cfi))
    }
}

/// Why an accounted stack ended, from its final marker.
fn end_of(frames: &[u64]) -> End {
    match frames.last() {
        Some(&marker::TRUNCATED) => End::Truncated,
        Some(&marker::STACK_COPY_END) => End::StackCopyEnd,
        Some(&marker::NO_UNWIND_INFO) => End::NoUnwindInfo,
        Some(&marker::UNWIND_ERROR) => End::Error,
        _ => End::Complete,
    }
}

/// Opens the file behind a mapping as the process sees it: through
/// `/proc/PID/map_files` (works for deleted files and other mount
/// namespaces), else `/proc/PID/root/PATH`, else the path itself.
fn open_mapped(pid: u32, m: &Mapping, path: &Path) -> Option<std::fs::File> {
    let candidates = [
        PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end)),
        Path::new(&format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path)),
        path.to_path_buf(),
    ];
    candidates.iter().find_map(|p| std::fs::File::open(p).ok())
}

/// Reads as much of `buf` as is readable in `pid`'s memory from `addr` on,
/// page by page (a stack copy stops at the end of its mapping); returns the
/// bytes read.
pub fn read_memory(pid: u32, addr: u64, buf: &mut [u8]) -> usize {
    use std::os::unix::fs::FileExt;
    let Ok(f) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return 0;
    };
    let mut done = 0;
    while done < buf.len() {
        let at = addr + done as u64;
        let want = ((4096 - (at & 4095)) as usize).min(buf.len() - done);
        match f.read_at(&mut buf[done..done + want], at) {
            Ok(n) if n > 0 => done += n,
            _ => break,
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::{Object, ObjectSection};

    #[test]
    fn markers_are_never_user_addresses() {
        for m in [
            marker::TRUNCATED,
            marker::NO_UNWIND_INFO,
            marker::STACK_COPY_END,
            marker::UNWIND_ERROR,
            marker::NOT_TAKEN,
        ] {
            assert!(marker::is_marker(m));
            assert!(m > 0x0000_7fff_ffff_ffff);
        }
        assert!(!marker::is_marker(0x5555_5555_0000));
    }

    #[test]
    fn own_binary_has_checked_cfi_and_a_bias() {
        let data = ModuleData::from_file(std::fs::File::open("/proc/self/exe"));
        assert_eq!(data.cfi, Cfi::EhFrameHdr, "{:?}", data.cfi);
        assert!(data.bytes > 0);
        // Mapped from a page-aligned offset before the segment's own (lld
        // lays text out at vaddr = offset + 0x1000): the bias still holds.
        let d = ModuleData {
            segments: vec![(0, 0, 0x15cc8), (0x15cd0, 0x16cd0, 0x41cd0)],
            ..ModuleData::without(Cfi::None)
        };
        assert_eq!(
            d.bias(0x5555_0000_0000 + 0x16000, 0x15000),
            Some(0x5555_0000_0000)
        );
        assert_eq!(d.bias(0x5555_0000_0000, 0), Some(0x5555_0000_0000));
    }

    #[test]
    fn corrupt_eh_frame_is_caught_at_load() {
        let mut image = std::fs::read("/proc/self/exe").unwrap();
        let file = object::File::parse(&*image).unwrap();
        let (off, len) = file.section_by_name(".eh_frame").unwrap().file_range().unwrap();
        drop(file);
        for b in &mut image[off as usize..(off + len) as usize] {
            *b = 0xa5;
        }
        let data = ModuleData::parse(&image[..]);
        assert!(matches!(data.cfi, Cfi::Corrupt(_)), "{:?}", data.cfi);
        assert!(
            data.eh_frame.is_none(),
            "a corrupt module falls back to frame pointers"
        );
    }

    #[inline(never)]
    fn depth3(out: &mut Vec<(u64, u64, u64, Vec<u8>)>) {
        // Copy our own stack from here, like the kernel would.
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers into locals; touches no memory.
        unsafe {
            std::arch::asm!("lea {0}, [rip]", "mov {1}, rsp", "mov {2}, rbp", out(reg) ip, out(reg) sp, out(reg) bp);
        }
        // The stack mapping may end less than 16 KiB above sp.
        let mut bytes = vec![0u8; 16384];
        let n = read_memory(std::process::id(), sp, &mut bytes);
        bytes.truncate(n);
        out.push((ip, sp, bp, bytes));
    }

    #[inline(never)]
    fn depth2(out: &mut Vec<(u64, u64, u64, Vec<u8>)>) {
        depth3(out);
        std::hint::black_box(out);
    }

    #[inline(never)]
    fn depth1(out: &mut Vec<(u64, u64, u64, Vec<u8>)>) {
        depth2(out);
        std::hint::black_box(out);
    }

    #[test]
    fn unwinds_own_stack_through_callers() {
        let mut out = Vec::new();
        std::thread::Builder::new()
            .name("unwind-test".into())
            .spawn(move || {
                depth1(&mut out);
                out
            })
            .unwrap()
            .join()
            .map(|out| {
                let pid = std::process::id();
                let maps = ProcessMaps::read(pid).unwrap();
                let mut u = Unwinder::new();
                u.sync(pid, &maps);
                let (ip, sp, bp, bytes) = &out[0];
                let (frames, end, _) = u.unwind(pid, *ip, *sp, *bp, bytes);
                let mut sym = crate::Symbolizer::new();
                sym.track_process(pid).unwrap();
                let names: Vec<String> = frames
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| !marker::is_marker(**a))
                    .flat_map(|(i, &a)| sym.user_frame(pid, a, i > 0).to_vec())
                    .collect();
                let pos = |n: &str| names.iter().position(|f| f.contains(n));
                assert!(pos("depth3").is_some(), "{names:?}");
                assert!(pos("depth2") > pos("depth3"), "{names:?}");
                assert!(pos("depth1") > pos("depth2"), "{names:?}");
                assert!(
                    pos("start_thread").is_some() || pos("clone").is_some(),
                    "{end:?} {names:?}"
                );
            })
            .unwrap();
    }

    #[test]
    fn a_repeated_stack_is_remembered_and_a_changed_word_walks_again() {
        let out = std::thread::spawn(|| {
            let mut out = Vec::new();
            depth1(&mut out);
            out
        })
        .join()
        .unwrap();
        let pid = std::process::id();
        let mut u = Unwinder::new();
        u.sync(pid, &ProcessMaps::read(pid).unwrap());
        let (ip, sp, bp, bytes) = &out[0];
        let first = u.unwind(pid, *ip, *sp, *bp, bytes);
        assert_eq!(u.totals.remembered, 0);
        assert!(first.0.len() >= 4, "{:x?}", first.0);
        let again = u.unwind(pid, *ip, *sp, *bp, bytes);
        assert_eq!(u.totals.remembered, 1);
        assert_eq!(again, first);
        // Statistics count a remembered stack like a walked one.
        assert_eq!(u.totals.stacks, 2);
        assert_eq!(u.totals.complete, 2 * (first.1 == End::Complete) as u64);

        // The first return address the walk read, changed: not the same
        // stack, walked again (and it no longer finds depth2's caller there).
        let r = u.walks.values().next().unwrap();
        let (off, value) = (r.offsets[0] as usize, r.values[0]);
        let mut changed = bytes.clone();
        changed[off..off + 8].copy_from_slice(&(value ^ 0x10).to_le_bytes());
        let walked = u.unwind(pid, *ip, *sp, *bp, &changed);
        assert_eq!(
            u.totals.remembered, 1,
            "a changed word must not be taken as the same stack"
        );
        assert_ne!(walked.0, first.0);
        // A copy cut short before a word the walk read: walked again.
        let cut = &bytes[..off];
        let short = u.unwind(pid, *ip, *sp, *bp, cut);
        assert_eq!(u.totals.remembered, 1);
        assert_eq!(short.1, End::StackCopyEnd, "{:x?}", short.0);
    }
}
