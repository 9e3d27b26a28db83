//! Address to frame names, cached.

use foldhash::{HashMap, HashMapExt};
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use blazesym::symbolize::{
    source::{Elf, Kernel, Source},
    Input, Symbolized, Symbolizer as Blaze,
};

use crate::maps::ProcessMaps;

/// Where the kernel's uretprobe trampoline is on x86-64 (the first slot
/// of the `[uprobes]` page, one page below the top of user space): a
/// function with a uretprobe pending (slotprof's own program-cache probes,
/// or another tool's) returns there instead of to its caller, so a stack
/// walked through it has this address where the caller's should be (and a
/// DWARF walk stops there).
pub const URETPROBE_TRAMPOLINE: u64 = 0x7fff_ffff_e000;
/// The frame name of the trampoline.
pub const URETPROBE_FRAME: &str = "[uretprobe trampoline]";

/// Entries per generation of a [`Bounded`] cache: the caches hold at most
/// twice this many (a few MiB), what an always-on profiler can afford.
const CACHE_GENERATION: usize = 8192;

/// A cache of bounded size: when the newer generation is full, the older
/// one is dropped and the newer takes its place. An entry found in the
/// older generation moves to the newer, so what is in use stays; what has
/// not been used for a whole generation goes.
struct Bounded<K, V> {
    new: HashMap<K, V>,
    old: HashMap<K, V>,
    generation: usize,
}

impl<K: std::hash::Hash + Eq, V: Clone> Bounded<K, V> {
    fn new(generation: usize) -> Self {
        Self {
            new: HashMap::new(),
            old: HashMap::new(),
            generation,
        }
    }

    fn get(&mut self, k: &K) -> Option<V> {
        if let Some(v) = self.new.get(k) {
            return Some(v.clone());
        }
        let (k, v) = self.old.remove_entry(k)?;
        self.insert(k, v.clone());
        Some(v)
    }

    fn insert(&mut self, k: K, v: V) {
        if self.new.len() >= self.generation {
            self.old = std::mem::take(&mut self.new);
        }
        self.new.insert(k, v);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.new.len() + self.old.len()
    }
}

/// A user address's file mapping (see [`Symbolizer::module_of`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
    pub path: Arc<str>,
    /// Hex, empty if the file has none.
    pub build_id: Arc<str>,
}

/// The GNU build ID of an ELF file, as hex: read through
/// `/proc/PID/map_files` (the very file mapped, even if deleted, replaced
/// or in another mount namespace) while the process lives, else from its
/// path.
fn read_build_id(path: &std::path::Path, pid: u32, start: u64, end: u64) -> Option<String> {
    use object::read::elf::{FileHeader, ProgramHeader};
    // The ELF header, the program headers and the note segments only (a
    // whole-file parse reads the symbol table: hundreds of MB of a
    // validator's, for 20 bytes).
    let open = |p: &std::path::Path| -> Option<String> {
        let data = crate::functions::read_cache(p).ok()?;
        let header = object::elf::FileHeader64::<object::Endianness>::parse(&data).ok()?;
        let endian = header.endian().ok()?;
        for segment in header.program_headers(endian, &data).ok()? {
            let Ok(Some(mut notes)) = segment.notes(endian, &data) else {
                continue;
            };
            while let Ok(Some(note)) = notes.next() {
                if note.name() == object::elf::ELF_NOTE_GNU
                    && note.n_type(endian) == object::elf::NT_GNU_BUILD_ID
                {
                    return Some(note.desc().iter().map(|b| format!("{b:02x}")).collect());
                }
            }
        }
        None
    };
    open(std::path::Path::new(&format!(
        "/proc/{pid}/map_files/{start:x}-{end:x}"
    )))
    .or_else(|| open(path))
}

/// The frames at one address, innermost first: shared with the cache, so
/// a hit costs a reference count, not a copy of every name.
pub type Frames = Arc<[String]>;

/// Symbolizes user addresses of tracked processes and kernel addresses.
///
/// Results are cached per `(file, offset)` and per kernel address, so each
/// distinct frame is resolved once however many stacks share it; the
/// caches are bounded (an always-on session meets ever more addresses).
pub struct Symbolizer {
    blaze: Blaze,
    /// When blazesym was last asked, if it was since it was (re)made: its
    /// parsed files (a validator's decompressed debug sections, the
    /// kernel's symbol table, their mapped pages) are released after a
    /// while without a lookup (see [`Self::release_idle`]).
    blaze_used: Option<Instant>,
    /// How often blazesym's state was released.
    pub releases: u64,
    processes: HashMap<u32, ProcessMaps>,
    user_cache: Bounded<(PathBuf, u64), Frames>,
    kernel_cache: Bounded<u64, Frames>,
    /// Build IDs by file (hex; empty where the file has none or cannot be
    /// read).
    build_ids: HashMap<PathBuf, Arc<str>>,
    /// Modules by (pid, mapping start), shared by their frames.
    modules: HashMap<(u32, u64), Arc<Module>>,
    /// Our copy of the vDSO image, made on first need: an anonymous memory
    /// file (never a name in a shared directory), read through its
    /// `/proc/self/fd` path, gone when the symbolizer is dropped.
    vdso: Option<Option<VdsoImage>>,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Symbolizer {
    pub fn new() -> Self {
        Self {
            blaze: new_blaze(),
            blaze_used: None,
            releases: 0,
            processes: HashMap::new(),
            user_cache: Bounded::new(CACHE_GENERATION),
            kernel_cache: Bounded::new(CACHE_GENERATION),
            build_ids: HashMap::new(),
            modules: HashMap::new(),
            vdso: None,
        }
    }

    /// Drops blazesym's parsed files if it has not been asked for `idle`
    /// (the caches of resolved frames stay). An always-on session meets
    /// new addresses rarely once warm, and a validator's symbols cost tens
    /// of MiB held (decompressed DWARF, the kernel's symbols, mapped
    /// pages); a later miss parses the file again. True if released.
    pub fn release_idle(&mut self, idle: Duration) -> bool {
        match self.blaze_used {
            Some(t) if t.elapsed() >= idle => {
                self.blaze = new_blaze();
                self.blaze_used = None;
                self.releases += 1;
                true
            }
            _ => false,
        }
    }

    /// blazesym, noting the use for [`Self::release_idle`].
    fn blaze(&mut self) -> &Blaze {
        self.blaze_used = Some(Instant::now());
        &self.blaze
    }

    /// Takes (or refreshes) the memory map of `pid`. Call it when the
    /// session starts and now and then while the process runs; after it
    /// exits, the last snapshot is what its addresses are resolved against.
    pub fn track_process(&mut self, pid: u32) -> std::io::Result<()> {
        let snapshot = ProcessMaps::read(pid)?;
        self.processes.entry(pid).or_default().merge(snapshot);
        Ok(())
    }

    /// The memory map known for `pid`, if it was tracked.
    pub fn process_maps(&self, pid: u32) -> Option<&ProcessMaps> {
        self.processes.get(&pid)
    }

    /// Frames for user addresses of `pid`, in the order given (leaf first
    /// for a stack). An address with inlined calls yields several frames,
    /// innermost first. Pass `is_return_address` for every address but a
    /// stack's first: a return address points after the call, so one byte
    /// back is looked up to stay inside the caller's call instruction.
    pub fn user_frame(&mut self, pid: u32, addr: u64, is_return_address: bool) -> Frames {
        if addr == URETPROBE_TRAMPOLINE {
            return Arc::new([URETPROBE_FRAME.to_string()]);
        }
        let Some((mapping, file_offset)) = self.locate(pid, addr, is_return_address) else {
            return Arc::new([format!("[unknown] {addr:#x}")]);
        };
        if mapping.label == "[uprobes]" {
            return Arc::new([URETPROBE_FRAME.to_string()]);
        }
        let label = mapping.label.clone();
        let path = match &mapping.path {
            Some(p) => p.clone(),
            // The vDSO is the same image in every process on this kernel:
            // our own copy names its functions (clock_gettime & co.).
            None if mapping.label == "[vdso]" => match self.vdso.get_or_insert_with(VdsoImage::new) {
                Some(image) => image.path.clone(),
                None => return Arc::new([format!("[unknown] [vdso]+{file_offset:#x}")]),
            },
            None => return Arc::new([format!("[unknown] {}+{file_offset:#x}", mapping.label)]),
        };
        let key = (path, file_offset);
        if let Some(frames) = self.user_cache.get(&key) {
            return frames;
        }
        let src = Source::Elf(Elf::new(&key.0));
        let frames: Frames = match self
            .blaze()
            .symbolize_single(&src, Input::FileOffset(file_offset))
        {
            Ok(Symbolized::Sym(sym)) => names(&sym).into(),
            _ => Arc::new([format!("[unknown] {label}+{file_offset:#x}")]),
        };
        self.user_cache.insert(key, frames.clone());
        frames
    }

    /// The file mapping holding a user address of `pid`, with its file's
    /// build ID, and the address to look up (one byte back for a return
    /// address, inside the call): what a pprof profile's Mapping and
    /// Location carry, for symbolizing after the fact. None for anonymous
    /// memory (JIT code), the vDSO and other pseudo mappings.
    pub fn module_of(&mut self, pid: u32, addr: u64, is_return_address: bool) -> Option<(Arc<Module>, u64)> {
        if addr == URETPROBE_TRAMPOLINE {
            return None;
        }
        let (m, _) = self.locate(pid, addr, is_return_address)?;
        let (start, end, file_offset) = (m.start, m.end, m.file_offset);
        let address = if is_return_address {
            addr.saturating_sub(1)
        } else {
            addr
        };
        // One shared Module per mapping (a validator's stacks hold
        // millions of frames in a few dozen mappings).
        if let Some(known) = self.modules.get(&(pid, start)) {
            if known.end == end
                && known.file_offset == file_offset
                && m.path
                    .as_deref()
                    .is_some_and(|p| *known.path == *p.to_string_lossy())
            {
                return Some((known.clone(), address));
            }
        }
        let path = m.path.clone()?;
        let build_id = match self.build_ids.get(&path) {
            Some(id) => id.clone(),
            None => {
                let id: Arc<str> = read_build_id(&path, pid, start, end).unwrap_or_default().into();
                self.build_ids.insert(path.clone(), id.clone());
                id
            }
        };
        let module = Arc::new(Module {
            start,
            end,
            file_offset,
            path: path.to_string_lossy().into(),
            build_id,
        });
        self.modules.insert((pid, start), module.clone());
        Some((module, address))
    }

    /// `module+0xoffset` (file offset) of a user address of `pid`.
    pub fn module_offset(&self, pid: u32, addr: u64, is_return_address: bool) -> String {
        match self.locate(pid, addr, is_return_address) {
            Some((m, file_offset)) => format!("{}+{file_offset:#x}", m.label),
            None => format!("{addr:#x}"),
        }
    }

    /// The mapping holding a user address of `pid` and the file offset
    /// looked up (a return address points after its call: one byte back
    /// stays inside the caller's call instruction).
    fn locate(&self, pid: u32, addr: u64, is_return_address: bool) -> Option<(&crate::maps::Mapping, u64)> {
        let lookup = if is_return_address {
            addr.saturating_sub(1)
        } else {
            addr
        };
        let m = self.processes.get(&pid)?.find(lookup)?;
        Some((m, lookup - m.start + m.file_offset))
    }

    /// Where the function holding user address `addr` of `pid` starts
    /// (an address in the same process), if its symbol is known.
    pub fn function_start(&mut self, pid: u32, addr: u64) -> Option<u64> {
        let m = self.processes.get(&pid)?.find(addr)?;
        let path = m.path.clone()?;
        let file_offset = addr - m.start + m.file_offset;
        let src = Source::Elf(Elf::new(&path));
        match self
            .blaze()
            .symbolize_single(&src, Input::FileOffset(file_offset))
        {
            Ok(Symbolized::Sym(sym)) => addr.checked_sub(sym.offset as u64),
            _ => None,
        }
    }

    /// `len` bytes of the file behind user address `addr` of `pid` (code,
    /// for decoding), read from the file, so it works after the process
    /// exited; shorter at the end of the mapping.
    pub fn code_at(&self, pid: u32, addr: u64, len: usize) -> Option<Vec<u8>> {
        use std::io::{Read, Seek, SeekFrom};
        let m = self.processes.get(&pid)?.find(addr)?;
        let path = m.path.as_ref()?;
        let len = len.min((m.end - addr) as usize);
        let mut f = std::fs::File::open(path).ok()?;
        f.seek(SeekFrom::Start(addr - m.start + m.file_offset)).ok()?;
        let mut buf = vec![0; len];
        let n = f.read(&mut buf).ok()?;
        buf.truncate(n);
        Some(buf)
    }

    /// Names a data address of `pid`: `symbol+0xoff` when it falls in a
    /// global of a mapped ELF file (its .data or .bss), else the mapping
    /// (`[heap]`, `[anon]`, `[stack]`) and the offset into it.
    pub fn data_name(&self, pid: u32, addr: u64) -> String {
        let Some(maps) = self.processes.get(&pid) else {
            return format!("{addr:#x}");
        };
        // Each mapped file's load bias, from its mapping at file offset 0.
        let mut files: Vec<(&std::path::Path, u64)> = maps
            .mappings()
            .iter()
            .filter(|m| m.file_offset == 0)
            .filter_map(|m| Some((m.path.as_deref()?, m.start)))
            .collect();
        files.dedup_by_key(|(p, _)| *p);
        for (path, base) in files {
            if let Some(name) = crate::functions::data_symbol(path, base, addr) {
                return name;
            }
        }
        match maps.find(addr) {
            Some(m) => format!("{}+{:#x}", m.label, addr - m.start),
            None => format!("{addr:#x}"),
        }
    }

    /// Frames for a kernel address, innermost first (see [`Self::user_frame`]).
    pub fn kernel_frame(&mut self, addr: u64, is_return_address: bool) -> Frames {
        let lookup = if is_return_address {
            addr.saturating_sub(1)
        } else {
            addr
        };
        if let Some(frames) = self.kernel_cache.get(&lookup) {
            return frames;
        }
        let src = Source::Kernel(Kernel::default());
        let frames: Frames = match self.blaze().symbolize_single(&src, Input::AbsAddr(lookup)) {
            Ok(Symbolized::Sym(sym)) => names(&sym).into(),
            _ => Arc::new([format!("[unknown] [kernel]+{addr:#x}")]),
        };
        self.kernel_cache.insert(lookup, frames.clone());
        frames
    }
}

fn new_blaze() -> Blaze {
    Blaze::builder()
        .enable_demangling(true)
        .enable_inlined_fns(true)
        .enable_code_info(false)
        .build()
}

/// This process's vDSO image in an anonymous memory file (memfd): the same
/// image as every process's on this kernel.
struct VdsoImage {
    _file: std::fs::File,
    path: PathBuf,
}

impl VdsoImage {
    fn new() -> Option<Self> {
        use std::{io::Write, os::fd::FromRawFd};
        let maps = crate::maps::ProcessMaps::read(std::process::id()).ok()?;
        let vdso = maps.mappings().iter().find(|m| m.label == "[vdso]")?;
        // SAFETY: the vDSO mapping is readable for its whole length for the
        // life of the process.
        let bytes =
            unsafe { std::slice::from_raw_parts(vdso.start as *const u8, (vdso.end - vdso.start) as usize) };
        // SAFETY: a NUL-terminated name and valid flags; the returned
        // descriptor is new and owned by the File made from it.
        let fd = unsafe { libc::memfd_create(c"slotprof-vdso".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: fd is a new descriptor that nothing else owns.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.write_all(bytes).ok()?;
        Some(Self {
            path: PathBuf::from(format!("/proc/self/fd/{fd}")),
            _file: file,
        })
    }
}

/// A symbol's name and the functions inlined into it at that address,
/// innermost first.
fn names(sym: &blazesym::symbolize::Sym<'_>) -> Vec<String> {
    let mut frames: Vec<String> = sym
        .inlined
        .iter()
        .rev()
        .map(|f| without_parameters(&f.name))
        .collect();
    frames.push(without_parameters(&sym.name));
    frames
}

/// A demangled C++ name without its parameter list and the qualifiers
/// after it (`rocksdb::DBImpl::Get(rocksdb::ReadOptions const&, ...) const`
/// is `rocksdb::DBImpl::Get`), as flamegraphs name frames: the same
/// function is one frame, and names stay short. A `[clone ...]` suffix is
/// kept. Rust names (no parameter lists) pass unchanged.
pub fn without_parameters(name: &str) -> String {
    let (body, clone) = match name.find(" [clone") {
        Some(i) => name.split_at(i),
        None => (name, ""),
    };
    let mut end = body.trim_end();
    for q in [" const", " volatile", " &&", " &", "&&", "&"] {
        if let Some(rest) = end.strip_suffix(q) {
            if rest.ends_with(')') || rest.ends_with(" const") || rest.ends_with(" volatile") {
                end = rest.trim_end();
            }
        }
    }
    let end = end.strip_suffix(" const").unwrap_or(end);
    if !end.ends_with(')') {
        return name.to_string();
    }
    // The '(' that opens the last parenthesised group.
    let mut depth = 0i32;
    for (i, c) in end.char_indices().rev() {
        match c {
            ')' => depth += 1,
            '(' => {
                depth -= 1;
                if depth == 0 {
                    let head = &end[..i];
                    // "(anonymous namespace)" alone, or nothing before:
                    // not a parameter list.
                    if head.is_empty() {
                        return name.to_string();
                    }
                    return format!("{head}{clone}");
                }
            }
            _ => {}
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_id_from_the_note_segments_is_the_whole_files() {
        use object::Object;
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let bytes = std::fs::read(&exe).unwrap();
        let whole = object::File::parse(&bytes[..]).unwrap().build_id().unwrap();
        let hex = whole.map(|id| id.iter().map(|b| format!("{b:02x}")).collect::<String>());
        // By path (the process's own map_files entry does not exist for a
        // range of 0..0).
        assert_eq!(read_build_id(&exe, std::process::id(), 0, 0), hex);
        assert!(
            hex.is_some_and(|h| h.len() >= 16),
            "test binaries are linked with a build ID"
        );
    }

    #[test]
    fn vdso_functions_are_named_from_a_copy_that_has_no_name_on_disk() {
        use object::{Object, ObjectSegment, ObjectSymbol};
        let pid = std::process::id();
        let maps = crate::maps::ProcessMaps::read(pid).unwrap();
        let Some(vdso) = maps.mappings().iter().find(|m| m.label == "[vdso]").cloned() else {
            eprintln!("SKIPPED: this process has no vDSO mapping");
            return;
        };
        // SAFETY: the vDSO stays mapped and readable for the process's life.
        let image =
            unsafe { std::slice::from_raw_parts(vdso.start as *const u8, (vdso.end - vdso.start) as usize) };
        let elf = object::File::parse(image).unwrap();
        let base = elf.segments().map(|s| s.address()).min().unwrap();
        let sym = elf
            .dynamic_symbols()
            .find(|s| s.name() == Ok("__vdso_clock_gettime"))
            .expect("the vDSO exports __vdso_clock_gettime");
        let addr = vdso.start + (sym.address() - base) + 1;
        let mut s = Symbolizer::new();
        s.track_process(pid).unwrap();
        let frames = s.user_frame(pid, addr, false);
        assert!(frames.iter().any(|f| f.contains("clock_gettime")), "{frames:?}");
        let path = s.vdso.as_ref().unwrap().as_ref().unwrap().path.clone();
        assert!(path.starts_with("/proc/self/fd"), "{path:?}");
        let planted = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy() == format!("slotprof-vdso-{pid}.so"))
            .count();
        assert_eq!(planted, 0, "no vDSO copy in the temporary directory");
    }

    #[test]
    fn cpp_names_lose_their_parameter_lists_and_rust_names_stay() {
        for (full, short) in [
            (
                "rocksdb::DBImpl::Get(rocksdb::ReadOptions const&, rocksdb::Slice const&, std::string*)",
                "rocksdb::DBImpl::Get",
            ),
            ("rocksdb::Version::Get(int) const", "rocksdb::Version::Get"),
            ("foo::bar() &&", "foo::bar"),
            (
                "(anonymous namespace)::Worker::run(int)",
                "(anonymous namespace)::Worker::run",
            ),
            (
                "std::function<void (int)>::operator()(int) const",
                "std::function<void (int)>::operator()",
            ),
            ("compress(char*, int) [clone .cold]", "compress [clone .cold]"),
            ("__futex_abstimed_wait_common", "__futex_abstimed_wait_common"),
            ("(anonymous namespace)", "(anonymous namespace)"),
            (
                "<solana_poh::poh_recorder::PohRecorder>::set_bank",
                "<solana_poh::poh_recorder::PohRecorder>::set_bank",
            ),
            (
                "core::ptr::drop_in_place<(u32, alloc::string::String)>",
                "core::ptr::drop_in_place<(u32, alloc::string::String)>",
            ),
            (
                "std::thread::Builder::spawn::{{closure}}",
                "std::thread::Builder::spawn::{{closure}}",
            ),
        ] {
            assert_eq!(without_parameters(full), short, "{full}");
        }
    }

    #[test]
    fn the_caches_stay_bounded_and_keep_what_is_in_use() {
        let mut c: Bounded<u64, u64> = Bounded::new(4);
        for k in 0..100 {
            c.insert(k, k);
            // Key 0 is used all along: it is never dropped.
            assert_eq!(c.get(&0), Some(0));
            assert!(c.len() <= 8, "{} entries", c.len());
        }
        assert_eq!(c.get(&1), None, "an entry unused for a generation goes");
        assert_eq!(c.get(&99), Some(99));
    }

    #[inline(never)]
    fn a_function_with_a_recognizable_name() -> u64 {
        std::hint::black_box(42)
    }

    #[test]
    fn names_own_function_and_marks_unmapped() {
        let pid = std::process::id();
        let mut s = Symbolizer::new();
        s.track_process(pid).unwrap();
        let addr = a_function_with_a_recognizable_name as *const () as u64;
        let frames = s.user_frame(pid, addr, false);
        assert!(
            frames
                .iter()
                .any(|f| f.contains("a_function_with_a_recognizable_name")),
            "{frames:?}"
        );
        assert_eq!(
            *s.user_frame(pid, 0x10, false),
            *vec!["[unknown] 0x10".to_string()]
        );
    }

    #[inline(never)]
    fn another_function_with_a_recognizable_name() -> u64 {
        std::hint::black_box(43)
    }

    #[test]
    fn idle_symbol_tables_are_released_and_parsed_again_on_the_next_miss() {
        let pid = std::process::id();
        let mut s = Symbolizer::new();
        s.track_process(pid).unwrap();
        assert!(!s.release_idle(Duration::ZERO), "nothing parsed yet");
        let a = a_function_with_a_recognizable_name as *const () as u64;
        let b = another_function_with_a_recognizable_name as *const () as u64;
        assert!(s
            .user_frame(pid, a, false)
            .iter()
            .any(|f| f.contains("a_function_with")));
        assert!(!s.release_idle(Duration::from_secs(3600)), "used just now");
        assert!(s.release_idle(Duration::ZERO));
        assert!(!s.release_idle(Duration::ZERO), "released once until used again");
        assert_eq!(s.releases, 1);
        // A cached frame needs no tables; a new one parses the file again.
        assert!(s
            .user_frame(pid, a, false)
            .iter()
            .any(|f| f.contains("a_function_with")));
        assert!(!s.release_idle(Duration::ZERO), "a cache hit is not a use");
        let frames = s.user_frame(pid, b, false);
        assert!(
            frames.iter().any(|f| f.contains("another_function_with")),
            "{frames:?}"
        );
        assert!(s.release_idle(Duration::ZERO));
    }
}
