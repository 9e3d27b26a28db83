//! Threads still asleep when a slot (or the session) ends: their interval
//! is open, so the kernel has taken neither stack yet. Read here from
//! their saved registers, `/proc/PID/task/TID/syscall` and `stack`, and
//! their memory, doing what the probes would do at the switch-in.

use super::*;

impl UserStacks {
    /// The stacks of a thread still asleep (its interval is open): user
    /// and kernel stack ids. Neither was taken by the kernel yet (they are
    /// taken at the switch-in or the system call's exit): the user stack is
    /// unwound from its registers (saved at the switch-out, or read from
    /// `/proc/PID/task/TID/syscall`) and its memory, the kernel stack read
    /// from `/proc/PID/task/TID/stack`. A blocked thread's stacks do not
    /// change while it sleeps; both are read once per interval.
    ///
    /// What the probes would do at its switch-in is done here too, so an
    /// open interval costs what a closed one does (in `slotprof run` every
    /// slot's end finds dozens of threads asleep): an interruptible sleep
    /// in a wait system call gets that call's one-frame kernel stack, not a
    /// `/proc` walk, and a thread asleep at the instruction and stack
    /// pointer of its last exit copy gets that copy's stack (as
    /// `stack_for::REPEAT` would), not a read of its memory.
    pub fn of_sleeper(&mut self, pid: u32, tid: u32, start: &OffCpuStart) -> (i32, i32) {
        if let Some(&(s, ids)) = self.sleepers.get(&tid) {
            if s == start.start_ns {
                return ids;
            }
        }
        let mut user = start.user_stack_id;
        let mut kernel = start.kernel_stack_id;
        let syscall = if start.user_sp == 0 && (user < 0 || kernel == KERNEL_STACK_AT_SWITCH_IN) {
            proc_syscall_regs(pid, tid)
        } else {
            None
        };
        if user < 0 {
            let (mut ip, mut sp, bp) = (start.user_ip, start.user_sp, start.user_bp);
            if sp == 0 {
                (ip, sp) = syscall.map_or((0, 0), |s| (s.ip, s.sp));
            }
            // /proc gives no bp: the instruction and stack pointers decide.
            if let Some(id) = self.last_exit_copy(tid, ip, sp, None) {
                self.sources.sleepers_repeated += 1;
                user = id;
            } else {
                // Its registers as it left user space, its stack as it is now.
                let mut stack = vec![0u8; profiler_ebpf::USER_STACK_BYTES];
                let n = if sp != 0 {
                    symbolizer::unwind::read_memory(pid, sp, &mut stack)
                } else {
                    0
                };
                if n > 0 {
                    stack.truncate(n);
                    user = self.unwind(pid, ip, sp, bp, &stack).0;
                }
            }
        }
        if kernel == KERNEL_STACK_AT_SWITCH_IN {
            match syscall {
                Some(s) if sleeps_interruptible(start.state) && is_wait_syscall(s.nr) => {
                    kernel = KERNEL_STACK_SYSCALL_WAIT - s.nr;
                }
                _ => {
                    if let Some(frames) = self.kallsyms.sleeping_stack(pid, tid) {
                        kernel = self.intern(frames);
                    }
                }
            }
        }
        if self.sleepers.len() >= 65_536 {
            self.sleepers.clear();
        }
        self.sleepers.insert(tid, (start.start_ns, (user, kernel)));
        (user, kernel)
    }
}

/// Where a thread blocked in a system call is: the call, and its user
/// instruction and stack pointers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct SyscallRegs {
    pub(super) nr: i32,
    pub(super) ip: u64,
    pub(super) sp: u64,
}

/// [`SyscallRegs`] from `/proc/PID/task/TID/syscall` ("nr args... sp pc").
pub(super) fn proc_syscall_regs(pid: u32, tid: u32) -> Option<SyscallRegs> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
    parse_proc_syscall(&text)
}

pub(super) fn parse_proc_syscall(text: &str) -> Option<SyscallRegs> {
    let words: Vec<&str> = text.split_whitespace().collect();
    // "running", or "-1 sp pc" for a thread blocked outside a system call.
    if words.len() != 9 || words[0].starts_with('-') {
        return None;
    }
    let hex = |w: &str| u64::from_str_radix(w.strip_prefix("0x")?, 16).ok();
    Some(SyscallRegs {
        nr: words[0].parse().ok()?,
        ip: hex(words[8])?,
        sp: hex(words[7])?,
    })
}

/// Kernel stacks of sleeping threads from `/proc/PID/task/TID/stack`,
/// which names frames (`func+0xoff/0xsize`) but hides addresses: names are
/// turned back into addresses with `/proc/kallsyms`, read again only for
/// names not seen yet (and at most every 10 s), keeping just those.
#[derive(Default)]
pub struct SleeperKernelStacks {
    addrs: HashMap<String, u64>,
    /// Names a scan did not find (not in kallsyms): not scanned for again,
    /// else every such stack read all of `/proc/kallsyms` every 10 s.
    absent: std::collections::HashSet<String>,
    last_scan: Option<Instant>,
}

impl SleeperKernelStacks {
    pub(super) fn sleeping_stack(&mut self, pid: u32, tid: u32) -> Option<Vec<u64>> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stack")).ok()?;
        let frames = parse_proc_stack(&text);
        if frames.is_empty() {
            return None;
        }
        let missing: Vec<&str> = frames
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| !self.addrs.contains_key(*n) && !self.absent.contains(*n))
            .collect();
        if !missing.is_empty()
            && self
                .last_scan
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(10))
        {
            self.last_scan = Some(Instant::now());
            if let Ok(f) = std::fs::File::open("/proc/kallsyms") {
                use std::io::BufRead;
                let wanted: std::collections::HashSet<&str> = missing.into_iter().collect();
                for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
                    let mut w = line.split_whitespace();
                    let (Some(a), Some(_), Some(name)) = (w.next(), w.next(), w.next()) else {
                        continue;
                    };
                    if wanted.contains(name) {
                        if let Ok(a) = u64::from_str_radix(a, 16) {
                            if a != 0 {
                                self.addrs.entry(name.to_string()).or_insert(a);
                            }
                        }
                    }
                }
                if self.absent.len() >= 4096 {
                    self.absent.clear();
                }
                for name in wanted {
                    if !self.addrs.contains_key(name) {
                        self.absent.insert(name.to_string());
                    }
                }
            }
        }
        let ips: Vec<u64> = frames
            .iter()
            .filter_map(|(n, off)| self.addrs.get(n).map(|a| a + off))
            .collect();
        (ips.len() == frames.len()).then_some(ips)
    }
}

/// `[<0>] futex_wait_queue+0x60/0x90` lines: (name, offset), leaf first.
pub(super) fn parse_proc_stack(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let f = l.split_once("] ")?.1.split_whitespace().next()?;
            let (name, rest) = f.split_once('+')?;
            let off = rest.split_once('/')?.0;
            Some((
                name.to_string(),
                u64::from_str_radix(off.strip_prefix("0x")?, 16).ok()?,
            ))
        })
        .collect()
}
