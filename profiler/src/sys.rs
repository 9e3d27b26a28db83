//! Every libc call of slotprof's library, each behind a safe function with
//! its SAFETY comment. (Not here: aya's and tokio's own, and the held
//! child's fork-exec dance in `main.rs`, which must stay async-signal-safe
//! between fork and exec; the tests' own fork of themselves.)

use std::{
    ffi::CString,
    fs::File,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, RawFd},
    path::{Path, PathBuf},
};

/// CLOCK_MONOTONIC in nanoseconds (the clock of `bpf_ktime_get_ns`).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The wall clock (CLOCK_REALTIME) in nanoseconds since the Unix epoch.
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos().min(u64::MAX as u128) as u64)
}

/// The wall clock in milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    unix_ns() / 1_000_000
}

/// 8 random bytes from the kernel, or None when getrandom fails.
pub fn random_u64() -> Option<u64> {
    let mut r = [0u8; 8];
    // SAFETY: writes at most r.len() bytes into r.
    let n = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    (n == r.len() as isize).then(|| u64::from_ne_bytes(r))
}

/// The effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// The running kernel's release (`uname -r`), or "unknown".
pub fn kernel_release() -> String {
    // SAFETY: a zeroed utsname is valid for uname to fill.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname writes the struct it is given.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "unknown".into();
    }
    let bytes: Vec<u8> = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Whether a process `pid` exists (signal 0: sends nothing). A process of
/// another user counts as existing (EPERM).
pub fn process_exists(pid: u32) -> bool {
    // SAFETY: signal 0 sends nothing; it only checks the pid.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether `pid` is a process that has not exited (a zombie, exited and
/// not yet reaped by its parent, has not run since).
pub fn is_running(pid: u32) -> bool {
    if !process_exists(pid) {
        return false;
    }
    // `pid (comm) S ...`: the state follows the last ')' (comm may hold one).
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(e) => !is_gone(&e),
    }
}

/// Pins the calling thread to `cpu`; false when the kernel refused.
pub fn pin_to_cpu(cpu: u32) -> bool {
    // A cpu_set_t holds CPU_SETSIZE CPUs; CPU_SET past it panics (in a
    // thread that cannot unwind: the daemon aborted, issue 42 case 1).
    if cpu as usize >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_setaffinity
    // reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Bytes free to an unprivileged writer on the file system holding `p`.
pub fn free_bytes(p: &Path) -> Option<u64> {
    let c = CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a zeroed statvfs is valid for statvfs to fill.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a statvfs to fill.
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0).then(|| s.f_bavail * s.f_frsize)
}

/// Gives freed heap memory back to the system (glibc keeps it otherwise).
pub fn malloc_trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory; nothing is borrowed.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// glibc's heap: (bytes in use, bytes free but held), all arenas.
pub fn heap_bytes() -> Option<(u64, u64)> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 only reads the allocator's counters.
        let m = unsafe { libc::mallinfo2() };
        Some(((m.uordblks + m.hblkhd) as u64, m.fordblks as u64))
    }
    #[cfg(not(target_env = "gnu"))]
    None
}

/// Allocations of at least `bytes` get mappings of their own (returned to
/// the system when freed). Call before other threads exist.
pub fn set_mmap_threshold(bytes: i32) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt changes the allocator's parameter; called while no
    // other thread allocates.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, bytes);
    }
}

/// Clock ticks per second (for /proc's CPU times) and the page size.
pub fn clock_ticks_and_page_size() -> (f64, u64) {
    // SAFETY: sysconf has no side effects.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    (ticks, page)
}

/// Mounts tracefs on /sys/kernel/tracing.
pub fn mount_tracefs() -> io::Result<()> {
    // SAFETY: valid C strings; no data argument.
    let rc = unsafe {
        libc::mount(
            c"nodev".as_ptr(),
            c"/sys/kernel/tracing".as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A new file in `dir` with a random name (mkostemp: O_EXCL, close on
/// exec), and its path.
pub fn temp_file(dir: &Path, prefix: &str) -> io::Result<(File, PathBuf)> {
    use std::os::unix::ffi::OsStrExt;
    let mut template = dir
        .join(format!("{prefix}XXXXXX"))
        .as_os_str()
        .as_bytes()
        .to_vec();
    template.push(0);
    // SAFETY: `template` is a NUL-terminated buffer mkostemp may rewrite.
    let fd = unsafe { libc::mkostemp(template.as_mut_ptr().cast(), libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: mkostemp returned a new descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    template.pop();
    Ok((file, PathBuf::from(std::ffi::OsStr::from_bytes(&template))))
}

/// The soft limit on open descriptors (0 when unknown).
pub fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a local struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim.rlim_cur
}

/// Lifts the soft limit on open descriptors to the hard one.
pub fn raise_nofile_limit() {
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct; setrlimit reads it.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) == 0 && nofile.rlim_cur < nofile.rlim_max {
            nofile.rlim_cur = nofile.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &nofile);
        }
    }
}

/// Lifts RLIMIT_MEMLOCK; a failure is fine on kernels that account BPF
/// memory to the cgroup.
pub fn raise_memlock_limit() {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };
}

/// Waits until `fd` is readable or `timeout_ms` has passed (an error such
/// as EINTR only ends the wait early).
pub fn wait_readable(fd: RawFd, timeout_ms: i32) {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, timeout_ms) };
}

/// Writes one byte to `fd`.
pub fn write_byte(fd: BorrowedFd<'_>, byte: u8) -> io::Result<()> {
    let b = [byte];
    // SAFETY: one byte from a live buffer to a descriptor we borrow.
    let n = unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), 1) };
    if n == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether an error says the process is gone (ENOENT from /proc, ESRCH).
pub fn is_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_10_an_exited_process_is_not_running_while_a_zombie_or_after() {
        assert!(is_running(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited, not reaped: a zombie.
        let t = std::time::Instant::now();
        while is_running(pid) && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(process_exists(pid) && !is_running(pid), "a zombie is not running");
        child.wait().unwrap();
        assert!(!is_running(pid));
    }

    #[test]
    fn case_1_pinning_to_a_cpu_past_the_cpu_set_fails_instead_of_aborting() {
        // In a thread of its own: a success would pin the test's thread.
        let pinned = std::thread::spawn(|| [64, 4096, 99_999, u32::MAX].map(pin_to_cpu))
            .join()
            .expect("pin_to_cpu panicked");
        assert_eq!(pinned, [false; 4]);
    }

    #[test]
    fn the_safe_wrappers_answer_sensibly() {
        let a = monotonic_ns();
        assert!(monotonic_ns() >= a);
        assert!(process_exists(std::process::id()));
        assert!(!kernel_release().is_empty());
        assert!(free_bytes(Path::new("/")).is_some());
        assert!(free_bytes(Path::new("/no/such/dir")).is_none());
        let (ticks, page) = clock_ticks_and_page_size();
        assert!(ticks >= 1.0 && page >= 4096);
        let dir = tempfile::tempdir().unwrap();
        let (_f, path) = temp_file(dir.path(), "x-").unwrap();
        assert!(path.exists() && path.file_name().unwrap().len() == 8);
        assert!(is_gone(&io::Error::from_raw_os_error(libc::ESRCH)));
    }
}
