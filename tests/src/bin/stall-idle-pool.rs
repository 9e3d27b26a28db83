//! Idle workers, the common case among a validator's threads, whose short
//! waits `--offcpu folded` sums in the kernel: `idle-0` .. `idle-3` wait
//! on one condition variable with a 3 ms timeout in `idle_wait` (a futex
//! wait, from the same frames each time); `waker` wakes one of them every
//! 1-4 ms; `napper` sleeps 2 ms at a time in `short_nap`; `long-napper`
//! sleeps 40 ms at a time in `long_nap` (too long to fold); the main thread
//! waits for the end. Each thread counts its own waits and their time.
//!
//! `--seconds S` (default 12): how long to run.
//! `--report FILE`: where to write the JSON report (default stdout).

use std::{
    hint::black_box,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use slotprof_tests::{name_thread, write_report, Flags};

/// One wait for work, as an idle pool worker does it.
#[inline(never)]
fn idle_wait(pool: &(Mutex<u64>, Condvar), seen: &mut u64) -> Duration {
    let t = Instant::now();
    let (lock, cv) = pool;
    let guard = lock.lock().unwrap();
    let (guard, _) = cv
        .wait_timeout_while(guard, Duration::from_millis(3), |n| *n == *seen)
        .unwrap();
    *seen = *guard;
    black_box(t.elapsed())
}

/// One short sleep.
#[inline(never)]
fn short_nap() -> Duration {
    let t = Instant::now();
    thread::sleep(black_box(Duration::from_millis(2)));
    t.elapsed()
}

/// One sleep too long to fold.
#[inline(never)]
fn long_nap() -> Duration {
    let t = Instant::now();
    thread::sleep(black_box(Duration::from_millis(40)));
    t.elapsed()
}

/// Runs `wait` until `stop`: (waits, their time).
fn count(stop: &AtomicBool, mut wait: impl FnMut() -> Duration) -> (u64, Duration) {
    let (mut n, mut total) = (0, Duration::ZERO);
    while !stop.load(Ordering::Relaxed) {
        total += wait();
        n += 1;
    }
    (n, total)
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 12.0);
    let stop = Arc::new(AtomicBool::new(false));
    let pool = Arc::new((Mutex::new(0u64), Condvar::new()));
    let mut threads = Vec::new();
    for i in 0..4 {
        let (stop, pool) = (stop.clone(), pool.clone());
        let name = format!("idle-{i}");
        threads.push((
            name.clone(),
            thread::spawn(move || {
                name_thread(&name);
                let mut seen = 0;
                count(&stop, || idle_wait(&pool, &mut seen))
            }),
        ));
    }
    type Nap = fn() -> Duration;
    let naps: [(&str, Nap); 2] = [("napper", short_nap), ("long-napper", long_nap)];
    for (name, nap) in naps {
        let stop = stop.clone();
        threads.push((
            name.to_string(),
            thread::spawn(move || {
                name_thread(name);
                count(&stop, nap)
            }),
        ));
    }
    let waker = {
        let (stop, pool) = (stop.clone(), pool.clone());
        thread::spawn(move || {
            name_thread("waker");
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let mut wakeups = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                thread::sleep(Duration::from_micros(1_000 + x % 3_000));
                *pool.0.lock().unwrap() += 1;
                pool.1.notify_one();
                wakeups += 1;
            }
            wakeups
        })
    };
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    let wakeups = waker.join().unwrap();
    let waits: Vec<String> = threads
        .into_iter()
        .map(|(name, t)| {
            let (n, total) = t.join().unwrap();
            format!("\"{name}\":{{\"waits\":{n},\"waited_ns\":{}}}", total.as_nanos())
        })
        .collect();
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"wakeups\":{wakeups},\"threads\":{{{}}}}}",
            std::process::id(),
            waits.join(",")
        ),
    );
}
