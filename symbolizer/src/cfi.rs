//! A module's call-frame information: which sections its frames are
//! unwound with ([`Cfi`]), read once per file and checked when loaded (a
//! corrupt `.eh_frame` falls back to frame pointers, said once), and where
//! the file is mapped (its bias).

use std::{ops::Range, sync::Arc};

use framehop::ExplicitModuleSectionInfo;
use object::{Object, ObjectSection, ObjectSegment};

/// What a module's frames are unwound with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cfi {
    /// `.eh_frame` indexed by `.eh_frame_hdr` (the usual case; survives `strip`).
    EhFrameHdr,
    /// `.eh_frame` without an index (framehop indexes it when loaded).
    EhFrame,
    /// `.debug_frame` only.
    DebugFrame,
    /// Neither: frame pointers only.
    None,
    /// The CFI did not parse: frame pointers only (said once).
    Corrupt(String),
    /// The file could not be read (gone, unreadable): frame pointers only.
    Unreadable(String),
}

impl Cfi {
    pub fn label(&self) -> &'static str {
        match self {
            Cfi::EhFrameHdr | Cfi::EhFrame | Cfi::DebugFrame => "cfi",
            Cfi::None => "frame pointers (no CFI)",
            Cfi::Corrupt(_) => "frame pointers (corrupt CFI)",
            Cfi::Unreadable(_) => "frame pointers (file unreadable)",
        }
    }

    pub(crate) fn usable(&self) -> bool {
        matches!(self, Cfi::EhFrameHdr | Cfi::EhFrame | Cfi::DebugFrame)
    }
}

/// Unwind sections of one file, shared by every mapping of it.
pub(crate) struct ModuleData {
    pub(crate) cfi: Cfi,
    pub(crate) build_id: Option<String>,
    /// (file offset, vaddr, file size) of each PT_LOAD.
    pub(crate) segments: Vec<(u64, u64, u64)>,
    pub(crate) eh_frame: Option<(Range<u64>, Arc<[u8]>)>,
    pub(crate) eh_frame_hdr: Option<(Range<u64>, Arc<[u8]>)>,
    pub(crate) debug_frame: Option<Arc<[u8]>>,
    pub(crate) text: Option<Range<u64>>,
    pub(crate) got: Option<Range<u64>>,
    /// Bytes held for this module.
    pub(crate) bytes: usize,
}

impl ModuleData {
    /// Reads a module's unwind sections from its file: only the headers
    /// and those sections are read (a validator's text is 100+ MB).
    pub(crate) fn from_file(file: std::io::Result<std::fs::File>) -> Self {
        match file {
            Ok(f) => Self::parse(&object::read::ReadCache::new(f)),
            Err(e) => Self::without(Cfi::Unreadable(e.to_string())),
        }
    }

    pub(crate) fn without(cfi: Cfi) -> Self {
        ModuleData {
            cfi,
            build_id: None,
            segments: Vec::new(),
            eh_frame: None,
            eh_frame_hdr: None,
            debug_frame: None,
            text: None,
            got: None,
            bytes: 0,
        }
    }

    /// Reads the sections from an ELF image (in memory, or read on demand).
    pub(crate) fn parse<'data>(data: impl object::ReadRef<'data>) -> Self {
        let file = match object::File::parse(data) {
            Ok(f) => f,
            Err(e) => return Self::without(Cfi::Unreadable(format!("not an ELF file: {e}"))),
        };
        let section = |name: &str| -> Option<(Range<u64>, Arc<[u8]>)> {
            let s = file.section_by_name(name)?;
            let d = s.data().ok()?;
            if d.is_empty() {
                return None;
            }
            Some((s.address()..s.address() + s.size(), Arc::from(d)))
        };
        let range = |name: &str| {
            file.section_by_name(name)
                .map(|s| s.address()..s.address() + s.size())
        };
        let mut m = Self::without(Cfi::None);
        m.build_id = file
            .build_id()
            .ok()
            .flatten()
            .map(|b| b.iter().map(|x| format!("{x:02x}")).collect());
        m.segments = file
            .segments()
            .map(|s| {
                let (off, size) = s.file_range();
                (off, s.address(), size)
            })
            .collect();
        m.text = range(".text");
        m.got = range(".got");
        m.eh_frame = section(".eh_frame");
        m.eh_frame_hdr = section(".eh_frame_hdr");
        m.debug_frame = section(".debug_frame").map(|(_, d)| d);
        m.cfi = match (&m.eh_frame, &m.eh_frame_hdr, &m.debug_frame) {
            (Some(eh), Some(hdr), _) => match check_eh_frame_hdr(eh, hdr) {
                Ok(()) => Cfi::EhFrameHdr,
                Err(e) => Cfi::Corrupt(e),
            },
            (Some(eh), None, _) => match check_eh_frame(eh) {
                Ok(()) => Cfi::EhFrame,
                Err(e) => Cfi::Corrupt(e),
            },
            (None, _, Some(_)) => Cfi::DebugFrame,
            (None, _, None) => Cfi::None,
        };
        if !m.cfi.usable() {
            m.eh_frame = None;
            m.eh_frame_hdr = None;
            m.debug_frame = None;
        }
        m.bytes = m.eh_frame.as_ref().map_or(0, |(_, d)| d.len())
            + m.eh_frame_hdr.as_ref().map_or(0, |(_, d)| d.len())
            + m.debug_frame.as_ref().map_or(0, |d| d.len());
        m
    }

    /// The load bias of a mapping of this file at `start` from `file_offset`.
    /// A segment's mapping starts at its offset rounded down to a page, so
    /// `file_offset` may lie a little before the segment's own offset; the
    /// address of any file offset in a segment is `vaddr - offset + it`.
    pub(crate) fn bias(&self, start: u64, file_offset: u64) -> Option<u64> {
        // The segment whose own mapping starts here; else one holding the
        // offset (two segments can share the page at a boundary).
        let &(off, vaddr, _) = self
            .segments
            .iter()
            .find(|&&(off, _, _)| off & !0xfff == file_offset)
            .or_else(|| {
                self.segments
                    .iter()
                    .find(|&&(off, _, size)| off <= file_offset && file_offset < off + size.max(1))
            })?;
        Some(start.wrapping_sub(vaddr.wrapping_sub(off).wrapping_add(file_offset)))
    }

    pub(crate) fn section_info(&self) -> ExplicitModuleSectionInfo<Arc<[u8]>> {
        ExplicitModuleSectionInfo {
            base_svma: 0,
            text_svma: self.text.clone(),
            got_svma: self.got.clone(),
            eh_frame_svma: self.eh_frame.as_ref().map(|(r, _)| r.clone()),
            eh_frame: self.eh_frame.as_ref().map(|(_, d)| d.clone()),
            eh_frame_hdr_svma: self.eh_frame_hdr.as_ref().map(|(r, _)| r.clone()),
            eh_frame_hdr: self.eh_frame_hdr.as_ref().map(|(_, d)| d.clone()),
            debug_frame: self.debug_frame.clone(),
            ..Default::default()
        }
    }
}

/// Parses the `.eh_frame_hdr` table and up to 4,096 of the FDEs it points
/// to (spread over the table): a corrupt section is caught when the module
/// is loaded, not as garbage frames later.
fn check_eh_frame_hdr(
    (eh_range, eh): &(Range<u64>, Arc<[u8]>),
    (hdr_range, hdr): &(Range<u64>, Arc<[u8]>),
) -> Result<(), String> {
    use gimli::{BaseAddresses, EhFrame, EhFrameHdr, LittleEndian, UnwindSection};
    let bases = BaseAddresses::default()
        .set_eh_frame_hdr(hdr_range.start)
        .set_eh_frame(eh_range.start);
    let parsed = EhFrameHdr::new(hdr, LittleEndian)
        .parse(&bases, 8)
        .map_err(|e| format!(".eh_frame_hdr: {e}"))?;
    let table = parsed.table().ok_or(".eh_frame_hdr has no search table")?;
    let eh_frame = EhFrame::new(eh, LittleEndian);
    let mut entries = Vec::new();
    let mut iter = table.iter(&bases);
    while let Some(entry) = iter.next().map_err(|e| format!(".eh_frame_hdr table: {e}"))? {
        entries.push(entry);
    }
    if entries.is_empty() {
        return Ok(());
    }
    let step = (entries.len() / 4096).max(1);
    for (_, ptr) in entries.iter().step_by(step) {
        let offset = table
            .pointer_to_offset(*ptr)
            .map_err(|e| format!(".eh_frame_hdr entry: {e}"))?;
        eh_frame
            .fde_from_offset(&bases, offset, EhFrame::cie_from_offset)
            .map_err(|e| format!(".eh_frame FDE at {:#x}: {e}", offset.0))?;
    }
    Ok(())
}

/// Parses every CIE and FDE of an `.eh_frame` without an index.
fn check_eh_frame((eh_range, eh): &(Range<u64>, Arc<[u8]>)) -> Result<(), String> {
    use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};
    let bases = BaseAddresses::default().set_eh_frame(eh_range.start);
    let eh_frame = EhFrame::new(eh, LittleEndian);
    let mut entries = eh_frame.entries(&bases);
    while let Some(entry) = entries.next().map_err(|e| format!(".eh_frame: {e}"))? {
        if let CieOrFde::Fde(partial) = entry {
            partial
                .parse(EhFrame::cie_from_offset)
                .map_err(|e| format!(".eh_frame FDE: {e}"))?;
        }
    }
    Ok(())
}
