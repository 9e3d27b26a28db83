//! A real KVM guest whose memory the host's compaction can migrate: the
//! shape of the reference incident (a validator VM with mlocked memory on a
//! host where kcompactd runs), small enough for a test.
//!
//! The guest is one vCPU running ring-3 64-bit code (it runs natively under
//! this machine's paravirtual KVM; ring-0 code would be emulated). It writes
//! one word in every 4 KiB page of its memory, round and round, and counts
//! page touches in guest memory. The host side samples that counter every
//! 100 ms, so the report shows the guest's own rate over time.
//!
//! Where the guest memory lives is arranged so compaction reaches it: free
//! memory outside the DMA32 zone is filled first, the guest pages are
//! faulted in interleaved with junk pages, the filler and the junk are
//! freed (leaving the guest pages scattered over a fragmented zone), and the
//! guest memory is mlocked with transparent huge pages off — the incident's
//! VM. Ground truth for "how many guest pages moved": the page frame number
//! of every guest page from /proc/self/pagemap, at start and at the end.
//!
//! Flags: `--mem-mib N` (1024), `--duration S` (until SIGTERM/SIGINT),
//! `--no-placement` (skip the fragmenting), `--report FILE`.
//! Prints `ready` on stdout once the guest runs, and on each SIGUSR1
//! `moved N`: guest pages whose page frame changed since the last one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_segment, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuExit};
use slotprof_tests::{monotonic_ns, name_thread, write_report, Flags};

const PAGE: usize = 4096;
const GDT: usize = 0x1000;
const PML4: usize = 0x2000;
const PDPT: usize = 0x3000;
const PD: usize = 0x4000; // four page directories: up to 4 GiB of guest memory
const CODE: usize = 0x10000;
const COUNTER: usize = 0x20000; // page touches; the stop flag is the next word
const STACK_TOP: usize = 0x30000;
const DATA: usize = 0x200000; // the pages the loop touches start at 2 MiB
const EXIT_PORT: u16 = 0x10;

/// The guest loop (x86-64, position independent; rbx = first data page,
/// rcx = end of memory, r8 = counter address):
///
/// ```text
/// 0:  mov  rsi, rbx
/// 3:  add  qword [rsi], 1      ; touch the page (a write)
/// 7:  add  rsi, 0x1000
/// e:  inc  qword [r8]          ; one more page touched
/// 11: cmp  rsi, rcx
/// 14: jb   3
/// 16: cmp  qword [r8+8], 0     ; stop flag
/// 1b: je   0
/// 1d: out  0x10, al            ; tell the host we stopped
/// 1f: jmp  0
/// ```
const GUEST_CODE: &[u8] = &[
    0x48, 0x89, 0xde, 0x48, 0x83, 0x06, 0x01, 0x48, 0x81, 0xc6, 0x00, 0x10, 0x00, 0x00, 0x49, 0xff, 0x00,
    0x48, 0x39, 0xce, 0x72, 0xed, 0x49, 0x83, 0x78, 0x08, 0x00, 0x74, 0xe3, 0xe6, 0x10, 0xeb, 0xdf,
];

static STOP: AtomicBool = AtomicBool::new(false);
static SNAPSHOT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGUSR1 {
        SNAPSHOT.store(true, Ordering::SeqCst);
    } else {
        STOP.store(true, Ordering::SeqCst);
    }
}

fn moved(before: &[u64], after: &[u64]) -> usize {
    before.iter().zip(after).filter(|(a, b)| a != b).count()
}

fn main() {
    let flags = Flags::from_env();
    let mem_bytes = (flags.num("mem-mib", 1024.0) as usize) << 20;
    if !(8 << 20..=4 << 30).contains(&mem_bytes) {
        eprintln!("--mem-mib must be between 8 and 4096");
        std::process::exit(2);
    }
    let duration = flags.get("duration").map(|_| flags.secs("duration", 0.0));
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGUSR1,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }

    let place_start = Instant::now();
    let mut placement = if std::env::args().any(|a| a == "--no-placement") {
        None
    } else {
        Some(Placement::fragment_first(2 * mem_bytes + (512 << 20)))
    };
    let guest = map_anonymous(mem_bytes);
    unsafe { libc::madvise(guest as *mut _, mem_bytes, libc::MADV_NOHUGEPAGE) };
    match &mut placement {
        Some(p) => p.fault_in_interleaved(guest, mem_bytes),
        None => touch_pages(guest, mem_bytes),
    }
    drop(placement); // frees the filler and the junk: the zone is now full of holes
    if unsafe { libc::mlock(guest as *const _, mem_bytes) } != 0 {
        eprintln!(
            "mlock of {} MiB failed: {} (run as root or raise RLIMIT_MEMLOCK)",
            mem_bytes >> 20,
            std::io::Error::last_os_error()
        );
        std::process::exit(1);
    }
    let placement_secs = place_start.elapsed().as_secs_f64();
    let frames_before = page_frames(guest, mem_bytes);
    let dma32_share = frames_before
        .iter()
        .filter(|&&f| f != 0 && f < DMA32_END_PFN)
        .count() as f64
        / frames_before.len() as f64;

    let kvm = Kvm::new().unwrap_or_else(|e| {
        eprintln!("open /dev/kvm: {e}");
        std::process::exit(1)
    });
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    build_guest(guest, mem_bytes);
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: mem_bytes as u64,
        userspace_addr: guest as u64,
        flags: 0,
    };
    unsafe { vm.set_user_memory_region(region) }.expect("KVM_SET_USER_MEMORY_REGION");
    let mut vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    set_long_mode_ring3(&vcpu, mem_bytes);

    let counter = (guest as usize + COUNTER) as *const u64;
    let stop_flag = (guest as usize + COUNTER + 8) as *mut u64;
    let vcpu_thread = std::thread::spawn(move || {
        name_thread("vcpu0");
        loop {
            match vcpu.run() {
                Ok(VcpuExit::IoOut(EXIT_PORT, _)) => return Ok(()),
                Ok(VcpuExit::Intr) => continue,
                Ok(other) => return Err(format!("unexpected guest exit: {other:?}")),
                Err(e) if e.errno() == libc::EINTR => continue,
                Err(e) => return Err(format!("KVM_RUN: {e}")),
            }
        }
    });

    let start = Instant::now();
    let start_ns = monotonic_ns();
    let mut series = Vec::new(); // (ms since start, page touches so far)
    println!("ready");
    // Snapshots reuse two buffers: freeing memory here would show up as
    // invalidations of this process's own (non-guest) memory.
    let mut snapshot = frames_before.clone();
    let mut now = frames_before.clone();
    let mut pagemap_buf = vec![0u8; mem_bytes / PAGE * 8];
    let mut next = start;
    loop {
        if SNAPSHOT.swap(false, Ordering::SeqCst) {
            read_page_frames(guest, &mut pagemap_buf, &mut now);
            println!("moved {}", moved(&snapshot, &now));
            std::mem::swap(&mut snapshot, &mut now);
        }
        next += Duration::from_millis(100);
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let touches = unsafe { std::ptr::read_volatile(counter) };
        series.push((start.elapsed().as_millis() as u64, touches));
        if STOP.load(Ordering::SeqCst) || duration.is_some_and(|d| start.elapsed() >= d) {
            break;
        }
        if vcpu_thread.is_finished() {
            break;
        }
    }
    unsafe { std::ptr::write_volatile(stop_flag, 1) };
    let outcome = vcpu_thread.join().expect("vcpu thread");
    if let Err(e) = outcome {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let end_ns = monotonic_ns();
    let frames_after = page_frames(guest, mem_bytes);
    let moved = moved(&frames_before, &frames_after);

    let series_json: Vec<String> = series.iter().map(|(ms, n)| format!("[{ms},{n}]")).collect();
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"guest_mib\":{},\"guest_host_addr\":{},\"pages\":{},\
             \"dma32_share\":{:.4},\"placement_secs\":{:.2},\"pages_moved\":{},\
             \"start_ns\":{},\"end_ns\":{},\"touches\":[{}]}}",
            std::process::id(),
            mem_bytes >> 20,
            guest as usize,
            mem_bytes / PAGE,
            dma32_share,
            placement_secs,
            moved,
            start_ns,
            end_ns,
            series_json.join(",")
        ),
    );
}

/// Page frames below 4 GiB are in ZONE_DMA32 (or ZONE_DMA) on x86-64.
const DMA32_END_PFN: u64 = (4u64 << 30) / PAGE as u64;

/// Filler that pushes the next allocations into the DMA32 zone, and the
/// junk pages interleaved with the guest's. Dropping it frees both.
struct Placement {
    chunks: Vec<(*mut u8, usize)>,
}

/// Filler is faulted in this many bytes at a time.
const FILL_CHUNK: usize = 256 << 20;

impl Placement {
    /// Fills free memory outside DMA32 (the Normal zone), so the guest's
    /// pages come from DMA32, where compaction then has work to do. Filling
    /// goes chunk by chunk until a chunk lands mostly in DMA32: the Normal
    /// zone's size is not knowable up front here (memory is plugged and
    /// page structures initialised on demand). Stops early, keeping
    /// `reserve` bytes available, whatever happens.
    fn fragment_first(reserve: usize) -> Self {
        let mut chunks = Vec::new();
        while slotprof_tests::mem_available_bytes() as usize > reserve + FILL_CHUNK {
            let p = map_anonymous(FILL_CHUNK);
            touch_pages(p, FILL_CHUNK);
            chunks.push((p, FILL_CHUNK));
            let frames = page_frames(p, FILL_CHUNK);
            let low = frames.iter().filter(|&&f| f != 0 && f < DMA32_END_PFN).count();
            if low * 2 > frames.len() {
                break;
            }
        }
        Self { chunks }
    }

    fn fault_in_interleaved(&mut self, guest: *mut u8, len: usize) {
        let junk = map_anonymous(len);
        unsafe { libc::madvise(junk as *mut _, len, libc::MADV_NOHUGEPAGE) };
        for off in (0..len).step_by(PAGE) {
            unsafe {
                std::ptr::write_volatile(guest.add(off), 0);
                std::ptr::write_volatile(junk.add(off), 1);
            }
        }
        self.chunks.push((junk, len));
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        for &(p, len) in &self.chunks {
            unsafe { libc::munmap(p as *mut _, len) };
        }
    }
}

fn map_anonymous(len: usize) -> *mut u8 {
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        eprintln!(
            "mmap of {} MiB failed: {}",
            len >> 20,
            std::io::Error::last_os_error()
        );
        std::process::exit(1);
    }
    p as *mut u8
}

fn touch_pages(p: *mut u8, len: usize) {
    // One system call instead of a fault per page; falls back to touching.
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    if unsafe { libc::madvise(p as *mut _, len, MADV_POPULATE_WRITE) } == 0 {
        return;
    }
    for off in (0..len).step_by(PAGE) {
        unsafe { std::ptr::write_volatile(p.add(off), 1) };
    }
}

/// The page frame number of every page (0 when not present or unreadable).
fn page_frames(p: *mut u8, len: usize) -> Vec<u64> {
    let mut out = vec![0u64; len / PAGE];
    read_page_frames(p, &mut vec![0u8; len / PAGE * 8], &mut out);
    out
}

/// [`page_frames`] into buffers the caller keeps (`buf`: 8 bytes a page).
fn read_page_frames(p: *mut u8, buf: &mut [u8], out: &mut [u64]) {
    use std::os::unix::fs::FileExt;
    out.fill(0);
    let Ok(f) = std::fs::File::open("/proc/self/pagemap") else {
        return;
    };
    let first = p as u64 / PAGE as u64;
    if f.read_exact_at(buf, first * 8).is_err() {
        return;
    }
    for (i, chunk) in buf.chunks_exact(8).enumerate() {
        let entry = u64::from_le_bytes(chunk.try_into().unwrap());
        if entry >> 63 == 1 {
            out[i] = entry & ((1 << 55) - 1);
        }
    }
}

/// Identity-mapped page tables (2 MiB pages, user-accessible), a GDT with
/// ring-3 64-bit segments, and the loop's code, written into guest memory.
fn build_guest(guest: *mut u8, len: usize) {
    let put = |off: usize, v: u64| unsafe { std::ptr::write_volatile(guest.add(off) as *mut u64, v) };
    const P_RW_US: u64 = 0x7;
    const PS: u64 = 0x80;
    let gdt = [
        0,
        0x00209a0000000000, // 0x08 ring-0 code64
        0x0000920000000000, // 0x10 ring-0 data
        0x0020fa0000000000, // 0x18 ring-3 code64 (selector 0x1b)
        0x0000f20000000000, // 0x20 ring-3 data (selector 0x23)
    ];
    for (i, d) in gdt.iter().enumerate() {
        put(GDT + i * 8, *d);
    }
    put(PML4, PDPT as u64 | P_RW_US);
    let gib = len.div_ceil(1 << 30);
    for g in 0..gib {
        put(PDPT + g * 8, (PD + g * PAGE) as u64 | P_RW_US);
    }
    for i in 0..len / (2 << 20) {
        put(PD + i * 8, (i as u64) << 21 | P_RW_US | PS);
    }
    for (i, b) in GUEST_CODE.iter().enumerate() {
        unsafe { std::ptr::write_volatile(guest.add(CODE + i), *b) };
    }
    put(COUNTER, 0);
    put(COUNTER + 8, 0);
}

fn set_long_mode_ring3(vcpu: &kvm_ioctls::VcpuFd, mem: usize) {
    let mut sregs = vcpu.get_sregs().expect("KVM_GET_SREGS");
    let seg = |selector: u16, code: bool| kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl: 3,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    sregs.cs = seg(0x1b, true);
    let data = seg(0x23, false);
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.gdt.base = GDT as u64;
    sregs.gdt.limit = 5 * 8 - 1;
    sregs.cr3 = PML4 as u64;
    sregs.cr4 = 0x20 | 0x200 | 0x400; // PAE, OSFXSR, OSXMMEXCPT
    sregs.cr0 = 0x8001_0033; // PG, WP, NE, ET, MP, PE
    sregs.efer = 0x500 | 0x1; // LMA, LME, SCE
    vcpu.set_sregs(&sregs).expect("KVM_SET_SREGS");
    let regs = kvm_bindings::kvm_regs {
        rip: CODE as u64,
        rsp: STACK_TOP as u64,
        rflags: 0x2 | 0x3000, // IOPL 3: the ring-3 `out` that ends the run is allowed
        rbx: DATA as u64,
        rcx: mem as u64,
        r8: COUNTER as u64,
        ..Default::default()
    };
    vcpu.set_regs(&regs).expect("KVM_SET_REGS");
}
