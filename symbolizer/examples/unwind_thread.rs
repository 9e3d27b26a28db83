//! Unwinds a thread blocked in a system call from /proc, with the same
//! unwinder slotprof uses (a debugging aid): `unwind_thread PID TID`.
use symbolizer::{maps::ProcessMaps, unwind, Symbolizer};

fn main() {
    let args: Vec<u32> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let [pid, tid] = args[..] else {
        eprintln!("usage: unwind_thread PID TID");
        std::process::exit(2);
    };
    let Some((pc, sp, stack)) = unwind::blocked_thread(pid, tid, 16384) else {
        eprintln!("thread {tid} of {pid} is not blocked in a system call (or cannot be read)");
        std::process::exit(1);
    };
    let maps = ProcessMaps::read(pid).expect("read /proc/PID/maps");
    let mut u = unwind::Unwinder::new();
    u.sync(pid, &maps);
    let (frames, end) = u.unwind(pid, pc, sp, 0, &stack);
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
