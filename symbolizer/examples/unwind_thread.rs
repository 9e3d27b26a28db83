//! Unwinds a blocked thread's user stack from /proc (debugging aid):
//! `unwind_thread PID TID`.
use std::os::unix::fs::FileExt;
use symbolizer::{maps::ProcessMaps, unwind::Unwinder, Symbolizer};

fn main() {
    let args: Vec<u32> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let (pid, tid) = (args[0], args[1]);
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).unwrap();
    let f: Vec<&str> = text.split_whitespace().collect();
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    let (sp, pc) = (hex(f[7]), hex(f[8]));
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut stack = vec![0u8; 16384];
    let mut n = 0;
    while n < stack.len() {
        let want = (4096 - ((sp + n as u64) & 4095)) as usize;
        let want = want.min(stack.len() - n);
        match mem.read_at(&mut stack[n..n + want], sp + n as u64) {
            Ok(k) if k > 0 => n += k,
            _ => break,
        }
    }
    stack.truncate(n);
    let maps = ProcessMaps::read(pid).unwrap();
    let mut u = Unwinder::new();
    u.sync(pid, &maps);
    let (frames, end) = u.unwind(pid, pc, sp, 0, &stack);
    let mut sym = Symbolizer::new();
    sym.track_process(pid).unwrap();
    println!("{n} stack bytes, end {end:?}");
    for (i, a) in frames.iter().enumerate() {
        println!("{a:#x} {:?}", sym.user_frame(pid, *a, i > 0));
    }
    for (m, s) in u.module_stats() {
        println!("{m}: {s:?}");
    }
}
