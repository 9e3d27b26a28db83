//! A hot thread spinning in `hot_spin` and a thread that sleeps in
//! `blocking_sleep`; reports how long it spun and how long it slept. A
//! third thread, `waiter`, blocks on a channel that `poker` sends to every
//! 30 ms, so its wakeups come from a known task (a futex wake).
//!
//! `--seconds S` (default 5): how long to run.
//! `--sleep-ms M` (default 20): length of each sleep.
//! `--report FILE`: where to write the JSON report (default stdout).

use std::{
    hint::black_box,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use slotprof_tests::{name_thread, write_report, Flags};

/// The on-CPU hot spot: a dependent arithmetic chain that never leaves the CPU.
#[inline(never)]
fn hot_spin(stop: &AtomicBool) -> u64 {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rounds = 0;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10_000 {
            x = black_box(x.rotate_left(7) ^ x.wrapping_mul(0x2545_f491_4f6c_dd1d));
        }
        rounds += 1;
    }
    black_box(x);
    rounds
}

/// The off-CPU spot: one sleep, measured by the program itself.
#[inline(never)]
fn blocking_sleep(d: Duration) -> Duration {
    let t = Instant::now();
    thread::sleep(black_box(d));
    t.elapsed()
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 5.0);
    let sleep = Duration::from_secs_f64(flags.num("sleep-ms", 20.0) / 1e3);
    let stop = Arc::new(AtomicBool::new(false));

    let hot = {
        let stop = stop.clone();
        thread::spawn(move || {
            name_thread("hot");
            hot_spin(&stop)
        })
    };
    let sleeper = {
        let stop = stop.clone();
        thread::spawn(move || {
            name_thread("sleeper");
            let (mut slept, mut sleeps) = (Duration::ZERO, 0u64);
            while !stop.load(Ordering::Relaxed) {
                slept += blocking_sleep(sleep);
                sleeps += 1;
            }
            (slept, sleeps)
        })
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let waiter = thread::spawn(move || {
        name_thread("waiter");
        let mut woken = 0u64;
        while rx.recv().is_ok() {
            woken += 1;
        }
        woken
    });
    let poker = {
        let stop = stop.clone();
        thread::spawn(move || {
            name_thread("poker");
            while !stop.load(Ordering::Relaxed) {
                thread::sleep(Duration::from_millis(30));
                let _ = tx.send(());
            }
        })
    };
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    poker.join().unwrap();
    let handoffs = waiter.join().unwrap();
    let rounds = hot.join().unwrap();
    let (slept, sleeps) = sleeper.join().unwrap();
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"hot_rounds\":{rounds},\"sleeps\":{sleeps},\"slept_ns\":{},\"handoffs\":{handoffs}}}",
            std::process::id(),
            slept.as_nanos()
        ),
    );
}
