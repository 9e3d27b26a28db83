//! Memory pressure with a known cause: a hot thread that reads through a
//! file larger than its cgroup's memory limit in some slots, and the fixed
//! twin without the limit.
//!
//! Slots are the program's own (`--slot-ms`, 400, from CLOCK_MONOTONIC 0,
//! what `slotprof --slot-source clock=400ms,origin=0` cuts). The process
//! moves itself into a new memory cgroup under its own (cgroup v2:
//! `memory.high`; v1: `memory.limit_in_bytes`) of `--limit-mib` (48; 0:
//! no cgroup, the fixed twin). The `hot` thread iterates every ~1 ms; from
//! the third slot on, at 100 ms into every `--every`-th slot (3; counted
//! from the slot the last pass ended in, where a pass is long), it
//! touches every page of a private `--file-mib` (160) file on disk through
//! a mapping: under the limit the pages the last pass read were reclaimed,
//! so each pass reads them in again (major faults), charged to the cgroup
//! and over the limit reclaimed by the hot thread itself (the kernel's
//! cgroup reclaim). The twin reads the file once before and keeps it in
//! the page cache: its passes touch memory. The file is made in the temporary
//! directory, which must be on a disk filesystem (tmpfs pages cannot be
//! reclaimed without swap: the program says so and exits 3).
//!
//! The report: the pids, the hot thread's tid, the cgroup version used,
//! each pressure phase (`start_ns`, `end_ns`, the kernel's memory pressure
//! over it: `/proc/pressure/memory` "some" total, in ns; the program's
//! own cgroup's, `group_psi_some_ns`, null without a v2 cgroup with PSI;
//! the CPU time each CPU ran meanwhile and the thread's own, `busy`
//! (`cpu_busy_ns`, `own_cpu_ns`; null without cgroup v1's cpuacct: the
//! machine's PSI is an average over CPUs weighted by their busy time, what
//! dilutes it); and the thread's major faults,
//! getrusage) and per slot the
//! same pressure count (the independent witness of every stall). The
//! cgroup is removed at exit and the process moved back.

use std::{
    collections::BTreeMap,
    hint::black_box,
    io::Write,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    time::Duration,
};

use slotprof_tests::{monotonic_ns, name_thread, write_report, Flags};

// The hot thread's iteration is the main loop's of the other stall
// programs (its lock helpers are not used here).
#[allow(dead_code)]
#[path = "../stall_loop.rs"]
mod stall_loop;

use stall_loop::stall_loop_iteration;

/// `/proc/pressure/memory`'s "some" total, in ns (0 without PSI).
fn psi_some_ns() -> u64 {
    psi_some_ns_of(Path::new("/proc/pressure/memory")).unwrap_or(0)
}

/// The "some" total of a PSI file (`/proc/pressure/memory` or a v2
/// cgroup's `memory.pressure`), in ns.
fn psi_some_ns_of(file: &Path) -> Option<u64> {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|t| {
            let some = t.lines().find(|l| l.starts_with("some"))?;
            let total = some.split_whitespace().find_map(|w| w.strip_prefix("total="))?;
            total.parse::<u64>().ok()
        })
        .map(|us| us * 1000)
}

/// CPU time run on each CPU of the machine, in ns: the root cpuacct
/// cgroup's `cpuacct.usage_percpu` (v1; v2's root has no per-CPU figure,
/// and v2 has the cgroup's own PSI instead).
fn cpu_busy_ns() -> Option<Vec<u64>> {
    [
        "/sys/fs/cgroup/cpuacct/cpuacct.usage_percpu",
        "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage_percpu",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .and_then(|t| t.split_whitespace().map(|w| w.parse().ok()).collect())
}

/// The calling thread's time on a CPU, in ns (`/proc/thread-self/schedstat`).
fn thread_cpu_ns() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    t.split_whitespace().next()?.parse().ok()
}

/// The calling thread's major page faults (getrusage).
fn major_faults() -> u64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    u.ru_majflt as u64
}

/// The memory cgroup this process is in: (version, its directory).
fn own_memory_cgroup() -> Option<(u32, PathBuf)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            return dir.is_dir().then_some((1, dir));
        }
    }
    // v2: the unified hierarchy, if it has the memory controller.
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let controllers =
            std::fs::read_to_string(Path::new(root).join("cgroup.controllers")).unwrap_or_default();
        if controllers.split_whitespace().any(|c| c == "memory") {
            return Some((2, Path::new(root).join(path.trim_start_matches('/'))));
        }
    }
    None
}

/// A cgroup this process moved into, undone on drop.
struct Cgroup {
    dir: PathBuf,
    back: PathBuf,
    /// `cgroup.subtree_control` of the parent, if memory had to be enabled
    /// there (put back on drop).
    enabled_in: Option<PathBuf>,
}

impl Cgroup {
    fn enter(version: u32, parent: &Path, limit: u64) -> Result<Cgroup, String> {
        let dir = parent.join(format!(
            "slotprof-stall-{}-{}",
            std::process::id(),
            monotonic_ns() % 1_000_000
        ));
        let mut enabled_in = None;
        if version == 2 {
            let control = parent.join("cgroup.subtree_control");
            let now = std::fs::read_to_string(&control).unwrap_or_default();
            if !now.split_whitespace().any(|c| c == "memory") {
                std::fs::write(&control, "+memory").map_err(|e| format!("{}: {e}", control.display()))?;
                enabled_in = Some(control);
            }
        }
        std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let cg = Cgroup {
            dir: dir.clone(),
            back: parent.to_path_buf(),
            enabled_in,
        };
        let knob = if version == 2 {
            "memory.high"
        } else {
            "memory.limit_in_bytes"
        };
        std::fs::write(dir.join(knob), limit.to_string()).map_err(|e| format!("{knob}: {e}"))?;
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .map_err(|e| format!("joining {}: {e}", dir.display()))?;
        Ok(cg)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.back.join("cgroup.procs"), std::process::id().to_string());
        // The kernel frees the charged page cache lazily: retry briefly.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(c) = &self.enabled_in {
            let _ = std::fs::write(c, "-memory");
        }
    }
}

/// A private file of `bytes` in `dir`, written, synced, unlinked (the
/// mapping keeps it), its pages out of the page cache.
fn big_file(dir: &Path, bytes: usize) -> std::io::Result<std::fs::File> {
    let path = dir.join(format!(
        "slotprof-stall-memory-{}-{}",
        std::process::id(),
        monotonic_ns()
    ));
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    std::fs::remove_file(&path)?;
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..bytes >> 20 {
        f.write_all(&chunk)?;
    }
    f.sync_all()?;
    Ok(f)
}

fn drop_cache(fd: i32, bytes: usize) {
    unsafe { libc::posix_fadvise(fd, 0, bytes as i64, libc::POSIX_FADV_DONTNEED) };
}

/// Touches every page of the mapping (the pressure the finding must show).
#[inline(never)]
fn read_through_mapping(map: *const u8, bytes: usize) -> u64 {
    let mut sum = 0u64;
    for off in (0..bytes).step_by(4096) {
        sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(map.add(off)) } as u64);
    }
    black_box(sum)
}

/// `read_through_mapping` a MiB at a time, the cgroup's own memory
/// pressure ("some", in ns) read between MiBs and summed: the pass's
/// stall as its cgroup's PSI saw it. The machine's PSI is an average over
/// CPUs weighted by each CPU's busy time, so a busy neighbour CPU halves
/// it on a 2-CPU machine; the cgroup's counts only this program's
/// threads, and a read every MiB keeps each of the kernel's windows on the
/// one CPU the thread ran on. None without a v2 cgroup with PSI.
fn read_through_mapping_timed(map: *const u8, bytes: usize, pressure: Option<&Path>) -> Option<u64> {
    const MIB: usize = 1 << 20;
    let read = |p: &Path| psi_some_ns_of(p);
    let mut last = pressure.and_then(read);
    let mut total = last.map(|_| 0u64);
    for off in (0..bytes).step_by(MIB) {
        read_through_mapping(unsafe { map.add(off) }, MIB.min(bytes - off));
        if let (Some(p), Some(l), Some(t)) = (pressure, last, total.as_mut()) {
            let now = read(p)?;
            *t += now.saturating_sub(l);
            last = Some(now);
        }
    }
    total
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 8.0).as_nanos() as u64;
    let slot_ns = (flags.num("slot-ms", 400.0) * 1e6) as u64;
    let every = flags.num("every", 3.0) as u64;
    let limit = (flags.num("limit-mib", 48.0) as u64) << 20;
    let bytes = (flags.num("file-mib", 160.0) as usize) << 20;
    let tmp = std::env::temp_dir();
    let fs_type = {
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
        unsafe { libc::statfs(c.as_ptr(), &mut st) };
        st.f_type
    };
    // TMPFS_MAGIC, RAMFS_MAGIC: pages there are not reclaimed without swap.
    if fs_type == 0x0102_1994 || fs_type == 0x8584_58f6 {
        eprintln!(
            "stall-memory: {} is tmpfs/ramfs: its pages cannot be reclaimed without swap; set TMPDIR to a disk filesystem",
            tmp.display()
        );
        std::process::exit(3);
    }
    // Written before the cgroup is joined (its writing is not the
    // pressure measured), synced and dropped from the page cache.
    let file = big_file(&tmp, bytes).expect("the big file");
    drop_cache(file.as_raw_fd(), bytes);
    let cgroup = if limit > 0 {
        let Some((version, parent)) = own_memory_cgroup() else {
            eprintln!("stall-memory: no memory cgroup controller (v1 or v2) to limit the program with");
            std::process::exit(3);
        };
        match Cgroup::enter(version, &parent, limit) {
            Ok(c) => Some((version, c)),
            Err(e) => {
                eprintln!("stall-memory: cannot make a memory cgroup: {e} (run as root)");
                std::process::exit(3);
            }
        }
    } else {
        None
    };
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
    let map_addr = map as usize;
    if limit == 0 {
        // The fixed twin has the memory: its file is read once, before,
        // and stays in the page cache.
        read_through_mapping(map as *const u8, bytes);
    }
    // The cgroup's own PSI, where there is one (v2, CONFIG_PSI).
    let pressure = cgroup
        .as_ref()
        .filter(|(v, _)| *v == 2)
        .map(|(_, c)| c.dir.join("memory.pressure"))
        .filter(|p| psi_some_ns_of(p).is_some());
    let start = monotonic_ns();
    let end = start + run_for;
    let first = start / slot_ns + 2;
    let hot = std::thread::spawn(move || {
        name_thread("hot");
        let tid = unsafe { libc::gettid() } as u32;
        let mut phases = Vec::new();
        let mut psi: BTreeMap<u64, u64> = BTreeMap::new();
        let mut last_psi = psi_some_ns();
        let mut next = first;
        let mut i = 0u64;
        while monotonic_ns() < end {
            let now = monotonic_ns();
            if now >= next * slot_ns + 100_000_000 && now < (next + 1) * slot_ns - 100_000_000 {
                let busy0 = cpu_busy_ns().zip(thread_cpu_ns());
                let (from, psi0, maj0) = (monotonic_ns(), psi_some_ns(), major_faults());
                let group = read_through_mapping_timed(map_addr as *const u8, bytes, pressure.as_deref());
                let (to, psi1, maj1) = (monotonic_ns(), psi_some_ns(), major_faults());
                let busy1 = cpu_busy_ns().zip(thread_cpu_ns());
                // What each CPU ran meanwhile, and the thread itself.
                let busy = busy0.zip(busy1).map(|((m0, t0), (m1, t1))| {
                    let per_cpu: Vec<String> = m0
                        .iter()
                        .zip(&m1)
                        .map(|(a, b)| b.saturating_sub(*a).to_string())
                        .collect();
                    format!(
                        "{{\"cpu_busy_ns\":[{}],\"own_cpu_ns\":{}}}",
                        per_cpu.join(","),
                        t1 - t0
                    )
                });
                phases.push((next, from, to, psi1 - psi0, maj1 - maj0, group, busy));
                // Counted from the slot the pass ended in: under TCG a
                // pass takes several slots, and the next must not start
                // in the slot this one ended in.
                next = (next + every).max(to / slot_ns + every);
            } else if now >= (next + 1) * slot_ns {
                next += every;
            }
            black_box(stall_loop_iteration(i));
            i += 1;
            let p = psi_some_ns();
            *psi.entry(monotonic_ns() / slot_ns).or_default() += p - last_psi;
            last_psi = p;
        }
        (tid, phases, psi)
    });
    let (tid, phases, psi) = hot.join().expect("the hot thread");
    unsafe { libc::munmap(map, bytes) };
    drop(file);
    let version = cgroup.as_ref().map_or(0, |c| c.0);
    drop(cgroup);
    let phases: Vec<String> = phases
        .iter()
        .map(|(slot, a, b, p, m, g, e)| {
            let or_null = |v: &Option<u64>| v.map_or("null".to_string(), |v| v.to_string());
            format!(
                "{{\"slot\":{slot},\"start_ns\":{a},\"end_ns\":{b},\"psi_some_ns\":{p},\
                 \"group_psi_some_ns\":{},\"busy\":{},\"major_faults\":{m}}}",
                or_null(g),
                e.clone().unwrap_or_else(|| "null".to_string())
            )
        })
        .collect();
    let slots: Vec<String> = psi
        .iter()
        .map(|(s, p)| format!("{{\"slot\":{s},\"psi_some_ns\":{p}}}"))
        .collect();
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"hot_tid\":{tid},\"cgroup_version\":{version},\"limit_bytes\":{limit},\
             \"file_bytes\":{bytes},\"slot_ms\":{},\"phases\":[{}],\"slots\":[{}]}}",
            std::process::id(),
            slot_ns / 1_000_000,
            phases.join(","),
            slots.join(",")
        ),
    );
}
