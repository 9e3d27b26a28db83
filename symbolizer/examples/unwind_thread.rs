//! Unwinds a thread blocked in a system call from /proc, with the same
//! unwinder slotprof uses (a debugging aid): `unwind_thread PID TID`.
use symbolizer::{unwind, Symbolizer};

fn main() {
    let args: Vec<u32> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let [pid, tid] = args[..] else {
        eprintln!("usage: unwind_thread PID TID");
        std::process::exit(2);
    };
    let Some((pc, sp, stack)) = blocked_thread(pid, tid) else {
        eprintln!("thread {tid} of {pid} is not blocked in a system call (or cannot be read)");
        std::process::exit(1);
    };
    let mut u = unwind::Unwinder::new();
    let (frames, end, _) = u.unwind(pid, pc, sp, 0, &stack);
    let mut sym = Symbolizer::new();
    sym.track_process(pid).expect("read /proc/PID/maps");
    println!("{} stack bytes, end {end:?}", stack.len());
    for (i, a) in frames.iter().enumerate() {
        println!("{a:#x} {:?}", sym.user_frame(pid, *a, i > 0));
    }
    for (m, s) in u.module_stats() {
        println!("{m}: {s:?}");
    }
}

/// A thread blocked in a system call: its user instruction and stack
/// pointers from /proc/PID/task/TID/syscall ("nr arg0..arg5 sp pc"), and
/// 16 KiB of its stack. /proc does not give the frame pointer: a frame
/// whose CFI is relative to it ends the unwinding there.
fn blocked_thread(pid: u32, tid: u32) -> Option<(u64, u64, Vec<u8>)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
    let f: Vec<&str> = text.split_whitespace().collect();
    if f.len() != 9 {
        return None;
    }
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let (sp, pc) = (hex(f[7])?, hex(f[8])?);
    let mut stack = vec![0u8; 16384];
    let n = unwind::read_memory(pid, sp, &mut stack);
    stack.truncate(n);
    (n > 0).then_some((pc, sp, stack))
}
