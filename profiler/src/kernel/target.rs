//! The process being profiled: what is known of it ([`Target`]), and for
//! `record` the command started held until the probes are in
//! ([`spawn_held`], its trampoline [`exec_when_released`]).

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
};

use anyhow::{bail, Context};

/// What we know about the target process.
#[derive(Clone, Debug)]
pub struct Target {
    pub pid: u32,
    /// Its main thread's name.
    pub comm: String,
    /// Its executable, if readable.
    pub exe: Option<PathBuf>,
    /// Start time in clock ticks after boot (field 22 of /proc/PID/stat):
    /// with the pid it names the process even after the pid is reused.
    start_ticks: u64,
    /// /proc/PID/auxv as read then: the kernel writes it anew at every
    /// exec (entry point, program headers, random bytes' address), so it
    /// tells an exec even of the same executable (busybox applets). None
    /// when unreadable or not yet written (see [`written_auxv`]).
    auxv: Option<Vec<u8>>,
}

impl Target {
    /// What the process is called: its executable's file name (a main
    /// thread may rename itself), else its main thread's name.
    pub fn name(&self) -> String {
        self.exe
            .as_deref()
            .and_then(|e| e.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.comm.clone())
    }

    /// Looks `pid` up; a pid with no live process is an error that says so.
    pub fn from_pid(pid: u32) -> anyhow::Result<Self> {
        let Some((state, start_ticks)) = stat(pid).ok().flatten() else {
            bail!("no process with pid {pid}: check the pid (e.g. `pgrep -f agave-validator`)");
        };
        if state == 'Z' || state == 'X' {
            bail!("process {pid} has already exited (it is a zombie waiting for its parent)");
        }
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|s| s.trim_end().to_string())
            .unwrap_or_default();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        Ok(Self {
            pid,
            comm,
            exe,
            start_ticks,
            auxv: read_auxv(pid),
        })
    }

    /// Whether it is a kernel thread (PF_KTHREAD in /proc/PID/stat's
    /// flags): no user space, so no user stacks and nothing of it for the
    /// slot or allocator detectors.
    pub fn is_kernel_thread(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .ok()
            .and_then(|t| stat_flags(&t))
            .is_some_and(|f| f & PF_KTHREAD != 0)
    }

    /// The executable the process runs now, when it differs from the one it
    /// ran when looked up (an exec since); with its name.
    pub fn exec_since(&self) -> Option<(String, Option<PathBuf>)> {
        let exe = std::fs::read_link(format!("/proc/{}/exe", self.pid)).ok()?;
        let auxv = read_auxv(self.pid);
        let same_auxv = auxv.is_none() || self.auxv.is_none() || auxv == self.auxv;
        if (Some(&exe) == self.exe.as_ref() && same_auxv) || !self.is_alive() {
            return None;
        }
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", self.pid))
            .map(|s| s.trim_end().to_string())
            .unwrap_or_default();
        Some((comm, Some(exe)))
    }

    /// Whether the kernel has written the auxiliary vector of the program
    /// the process runs now (an exec writes it last, after mapping the
    /// code): a look-up in between sees the new executable with an empty
    /// vector.
    pub fn auxv_written(&self) -> bool {
        self.auxv.is_some()
    }

    /// Whether the process still runs (not gone, not a zombie, not a new
    /// process that reused the pid). Only a proof of its end counts: when
    /// /proc cannot be read for another reason (out of descriptors, out of
    /// memory) the kernel is asked whether the pid exists at all.
    pub fn is_alive(&self) -> bool {
        match stat(self.pid) {
            Ok(Some((state, start))) => start == self.start_ticks && state != 'Z' && state != 'X',
            Ok(None) => true,
            Err(e) if crate::sys::is_gone(&e) => false,
            Err(_) => crate::sys::process_exists(self.pid),
        }
    }
}

/// /proc/PID/auxv when the kernel has written it. An exec gives the
/// process a new, zeroed vector and fills it only after mapping the
/// program (create_elf_tables): read in between it is a bare AT_NULL, and
/// comparing that with the filled one later would take one exec for two
/// (seen in a TCG test VM, where the window lasts long enough to land in).
fn read_auxv(pid: u32) -> Option<Vec<u8>> {
    std::fs::read(format!("/proc/{pid}/auxv"))
        .ok()
        .filter(|a| written_auxv(a))
}

/// Whether an auxiliary vector holds the entry point (AT_ENTRY), which
/// every ELF exec writes.
fn written_auxv(auxv: &[u8]) -> bool {
    const AT_ENTRY: u64 = 9;
    auxv.chunks_exact(16)
        .map(|e| u64::from_ne_bytes(e[..8].try_into().expect("8 bytes")))
        .take_while(|&key| key != 0)
        .any(|key| key == AT_ENTRY)
}

/// State letter and start time from /proc/PID/stat (`Ok(None)`: read but not
/// understood).
fn stat(pid: u32) -> std::io::Result<Option<(char, u64)>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    Ok(parse_stat(&text))
}

fn parse_stat(text: &str) -> Option<(char, u64)> {
    // The comm field may hold spaces and parentheses: split after the last ')'.
    let rest = text.get(text.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split(' ').collect();
    let state = fields.first()?.chars().next()?;
    // Field 22 overall is index 19 after pid and comm.
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// The kernel's flag for its own threads (include/linux/sched.h).
const PF_KTHREAD: u64 = 0x0020_0000;

/// The flags field (9) of /proc/PID/stat.
fn stat_flags(text: &str) -> Option<u64> {
    let rest = text.get(text.rfind(')')? + 2..)?;
    // Field 9 overall is index 6 after pid and comm.
    rest.split(' ').nth(6)?.parse().ok()
}

/// After releasing a held child: its view once it has exec'd the command
/// and the kernel has mapped the command's code (its executable is no
/// longer slotprof's, and `/proc/PID/maps` shows the new one executable),
/// or as it is after 60 s. An exec takes a millisecond natively but can
/// take seconds in an emulated VM under the probes; past the old 2 s limit
/// the session took the trampoline's executable for the target's. The
/// executable changes at the start of the exec, before its code is
/// mapped: a map read in between holds only the stack, and a VM run whose
/// first read fell there once decoded none of its samples. The auxiliary
/// vector is written after the code is mapped: waited for too, or the
/// first look at it would show an exec that did not happen.
pub async fn wait_for_exec(held: &Target) -> Target {
    for _ in 0..12_000 {
        match Target::from_pid(held.pid) {
            Ok(now) if now.exe != held.exe && code_is_mapped(&now) && now.auxv_written() => return now,
            Ok(_) => {}
            // Gone (the exec failed and the trampoline exited): the
            // session sees it exit.
            Err(_) => break,
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    Target::from_pid(held.pid).unwrap_or_else(|_| held.clone())
}

/// Whether `target`'s executable has an executable mapping yet.
fn code_is_mapped(target: &Target) -> bool {
    let Some(exe) = &target.exe else { return false };
    symbolizer::maps::ProcessMaps::read(target.pid).is_ok_and(|m| {
        m.mappings()
            .iter()
            .any(|m| m.executable && m.path.as_deref() == Some(exe.as_path()))
    })
}

/// A symbolizer that has taken the memory map of `pid`.
pub fn symbolizer_for(pid: u32) -> anyhow::Result<symbolizer::Symbolizer> {
    let mut sym = symbolizer::Symbolizer::new();
    sym.track_process(pid)
        .with_context(|| format!("cannot read /proc/{pid}/maps (does slotprof have CAP_SYS_PTRACE?)"))?;
    Ok(sym)
}

/// Failed re-reads of a target's memory map: said once (with the first
/// error), since code mapped after the last good read is not symbolized.
#[derive(Default)]
pub struct MapsErrors {
    said: bool,
}

impl MapsErrors {
    pub fn note(&mut self, pid: u32, e: &std::io::Error) {
        // Gone: the target exited (said when the loop sees it), not a
        // map that cannot be read.
        if crate::sys::is_gone(e) {
            return;
        }
        if !std::mem::replace(&mut self.said, true) {
            eprintln!(
                "slotprof: warning: cannot re-read /proc/{pid}/maps ({e}); code mapped after the last read \
                 will show as [unknown] addresses"
            );
        }
    }
}

/// Environment variable that turns this process into the held trampoline of
/// `record`: wait for a byte on the named fd, then exec the command.
pub const HELD_FD_ENV: &str = "SLOTPROF_HELD_FD";

/// A process started by `record`, held before `exec` until the probes are in.
pub struct HeldChild {
    pub child: tokio::process::Child,
    /// Writing a byte here lets the child exec.
    pub release: OwnedFd,
}

/// Starts `argv` held: the child is slotprof itself, waiting on a pipe,
/// and it execs `argv` (keeping its pid) only once the probes are attached,
/// so nothing the command does is missed. (Blocking in `pre_exec` instead
/// would deadlock: spawn waits for the exec.)
pub fn spawn_held(argv: &[String]) -> anyhow::Result<(HeldChild, u32)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pipe2");
    }
    // SAFETY: both descriptors were just made by pipe2 and are owned by nothing else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let gate = read_end.as_raw_fd();
    let me = std::env::current_exe().context("cannot find slotprof's own executable")?;
    let mut cmd = tokio::process::Command::new(me);
    cmd.args(argv)
        .env(HELD_FD_ENV, gate.to_string())
        .kill_on_drop(true);
    // SAFETY: only async-signal-safe calls (fcntl) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // Let the read end survive into the trampoline.
            if libc::fcntl(gate, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().context("cannot start the held child")?;
    drop(read_end);
    let pid = child.id().context("the command exited at once")?;
    Ok((
        HeldChild {
            child,
            release: write_end,
        },
        pid,
    ))
}

/// Checks that `program` can be run, the way `exec` will look for it.
pub fn find_program(program: &str) -> anyhow::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        anyhow::ensure!(
            runnable(std::path::Path::new(program)),
            "cannot run `{program}`: no such executable file"
        );
        return Ok(program.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| runnable(p))
        .ok_or_else(|| {
            anyhow::anyhow!("cannot run `{program}`: not found on PATH (give its path, e.g. ./{program})")
        })
}

/// The trampoline side of [`spawn_held`].
pub fn exec_when_released(fd: Option<i32>) -> std::process::ExitCode {
    use std::os::unix::process::CommandExt;
    let Some(fd) = fd else {
        eprintln!("slotprof: error: {HELD_FD_ENV} is not a file descriptor");
        return std::process::ExitCode::FAILURE;
    };
    let mut b = [0u8; 1];
    // SAFETY: reads one byte into a one-byte buffer from the descriptor slotprof passed down.
    if unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) } != 1 {
        // slotprof failed before attaching: run nothing.
        return std::process::ExitCode::FAILURE;
    }
    // SAFETY: the descriptor is ours and not used after this.
    unsafe { libc::close(fd) };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let err = std::process::Command::new(&argv[0])
        .args(&argv[1..])
        .env_remove(HELD_FD_ENV)
        .exec();
    eprintln!(
        "slotprof: error: cannot run `{}`: {err} (is it on PATH and executable?)",
        argv[0]
    );
    std::process::ExitCode::from(127)
}

/// A thread's name as the kernel keeps it (`comm`, NUL-padded), from
/// /proc; zeros when it is gone.
pub fn comm_of(pid: u32, tid: u32) -> [u8; profiler_ebpf::COMM_LEN] {
    let mut c = [0u8; profiler_ebpf::COMM_LEN];
    if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")) {
        let s = s.trim_end().as_bytes();
        let n = s.len().min(profiler_ebpf::COMM_LEN - 1);
        c[..n].copy_from_slice(&s[..n]);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_auxv_counts_once_the_exec_has_written_its_entry_point() {
        let entry = |pairs: &[(u64, u64)]| -> Vec<u8> {
            pairs
                .iter()
                .flat_map(|(k, v)| [k.to_ne_bytes(), v.to_ne_bytes()])
                .flatten()
                .collect()
        };
        // Mid-exec: the new, zeroed vector.
        assert!(!written_auxv(&entry(&[(0, 0)])));
        assert!(!written_auxv(&[]));
        // AT_PAGESZ, AT_ENTRY, AT_NULL.
        assert!(written_auxv(&entry(&[(6, 4096), (9, 0x401000), (0, 0)])));
        // AT_ENTRY after the AT_NULL is not in the vector.
        assert!(!written_auxv(&entry(&[(6, 4096), (0, 0), (9, 1)])));
        // Our own, read from /proc.
        assert!(Target::from_pid(std::process::id()).unwrap().auxv_written());
    }

    #[test]
    fn self_is_alive_and_missing_pid_says_so() {
        let me = Target::from_pid(std::process::id()).unwrap();
        assert!(me.is_alive());
        assert!(me.exe.is_some());
        let err = Target::from_pid(u32::MAX - 1).unwrap_err().to_string();
        assert!(err.contains("no process with pid"), "{err}");
    }

    #[test]
    fn kthreadd_is_a_kernel_thread_and_this_process_is_not() {
        assert!(!Target::from_pid(std::process::id()).unwrap().is_kernel_thread());
        // pid 2 is kthreadd in the initial pid namespace; in a container it
        // may be something else or nothing.
        if let Ok(t) = Target::from_pid(2) {
            if t.comm == "kthreadd" {
                assert!(t.is_kernel_thread());
            }
        }
        let line = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 2 0 0";
        assert_eq!(stat_flags(line).map(|f| f & PF_KTHREAD != 0), Some(true));
        assert_eq!(stat_flags("garbage"), None);
    }

    #[test]
    fn odd_stat_lines_are_not_understood_and_do_not_panic() {
        assert_eq!(parse_stat("1 (a)"), None);
        assert_eq!(parse_stat("1 (a) "), None);
        assert_eq!(parse_stat("garbage"), None);
        let line = "7 (a) b) S 1 7 7 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0";
        assert_eq!(parse_stat(line), Some(('S', 12345)));
    }

    #[test]
    fn out_of_descriptors_is_not_the_target_exiting() {
        // In a child: with no descriptor free, /proc cannot be opened (EMFILE),
        // and the target must still be alive. A child keeps the test
        // process's own limit alone.
        let me = Target::from_pid(std::process::id()).unwrap();
        // SAFETY: the child allocates (is_alive builds a path); the
        // allocator resets its locks at fork (glibc and jemalloc both
        // register fork handlers), and the child only ends in _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: plain syscalls in the child.
            unsafe {
                for fd in 3..1024 {
                    libc::close(fd);
                }
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
            let open_fails = std::fs::File::open("/proc/self/stat").is_err();
            let alive = me.is_alive();
            // SAFETY: in the forked child, _exit ends it without running the parent's destructors.
            unsafe { libc::_exit(if open_fails && alive { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status:#x}"
        );
    }
}
