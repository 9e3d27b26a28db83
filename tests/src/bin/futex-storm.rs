//! A futex-heavy workload for benchmarks: two threads hand a token back and
//! forth through a Mutex and a Condvar (every round trip is two futex waits
//! and two wakes). Reports round trips per second.
//!
//! `--seconds S` (default 3), `--report FILE`.

use std::{
    sync::{Arc, Condvar, Mutex},
    thread,
    time::Instant,
};

use slotprof_tests::{name_thread, write_report, Flags};

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 3.0);
    // The token: whose turn it is (0 or 1), or 2 to stop.
    let pair = Arc::new((Mutex::new(0u8), Condvar::new()));
    let player = |me: u8, pair: Arc<(Mutex<u8>, Condvar)>| {
        move || {
            name_thread(if me == 0 { "ping" } else { "pong" });
            let (lock, cv) = &*pair;
            let mut turns = 0u64;
            let mut turn = lock.lock().unwrap();
            loop {
                while *turn != me && *turn != 2 {
                    turn = cv.wait(turn).unwrap();
                }
                if *turn == 2 {
                    return turns;
                }
                *turn = 1 - me;
                turns += 1;
                cv.notify_one();
            }
        }
    };
    let a = thread::spawn(player(0, pair.clone()));
    let b = thread::spawn(player(1, pair.clone()));
    let start = Instant::now();
    thread::sleep(run_for);
    *pair.0.lock().unwrap() = 2;
    pair.1.notify_all();
    let turns = a.join().unwrap() + b.join().unwrap();
    let secs = start.elapsed().as_secs_f64();
    // Its own CPU time, so a tool that runs it as a child can tell its
    // own CPU from the storm's.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a zeroed rusage for the kernel to fill.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let cpu_s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"round_trips\":{},\"round_trips_per_s\":{:.0},\"cpu_s\":{:.3}}}",
            std::process::id(),
            turns / 2,
            turns as f64 / 2.0 / secs,
            cpu_s(usage.ru_utime) + cpu_s(usage.ru_stime)
        ),
    );
}
