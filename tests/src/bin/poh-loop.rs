//! A PoH-like CPU-bound loop: each thread hashes the previous sha256 output,
//! as a Solana leader's PoH thread does, for `--seconds` (default 3), on
//! `--threads` threads (default: one per CPU). Reports hashes per second,
//! the figure whose drop is a profiler's overhead on CPU-bound work, and a
//! series of (CLOCK_MONOTONIC ns, hashes so far) every 100 ms, so a bench can
//! take the rate over exactly the seconds a profiler was attached.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};
use slotprof_tests::{name_thread, write_report, Flags};

/// One thread's count, alone on its cache line (only its thread writes it).
#[repr(align(128))]
#[derive(Default)]
struct Count(AtomicU64);

fn monotonic_ns() -> u64 {
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel fills the timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() {
    let flags = Flags::from_env();
    let seconds = flags.secs("seconds", 3.0);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = flags.num("threads", cpus as f64) as usize;
    let counts: Arc<Vec<Count>> = Arc::new((0..threads).map(|_| Count::default()).collect());
    let done = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            let counts = counts.clone();
            std::thread::spawn(move || {
                name_thread(&format!("poh{i}"));
                chain(seconds, &counts[i].0)
            })
        })
        .collect();
    let total = || counts.iter().map(|c| c.0.load(Ordering::Relaxed)).sum::<u64>();
    let sampler = std::thread::spawn({
        let done = done.clone();
        let counts = counts.clone();
        move || {
            let total = || counts.iter().map(|c| c.0.load(Ordering::Relaxed)).sum::<u64>();
            let mut series = vec![(monotonic_ns(), total())];
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                series.push((monotonic_ns(), total()));
            }
            series
        }
    });
    let hashes: u64 = workers.into_iter().map(|w| w.join().expect("poh thread")).sum();
    let elapsed = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let mut series = sampler.join().expect("sampler");
    series.push((monotonic_ns(), total()));
    let points: Vec<String> = series.iter().map(|(t, n)| format!("[{t},{n}]")).collect();
    write_report(
        &flags,
        &format!(
            "{{\"threads\":{threads},\"hashes\":{hashes},\"seconds\":{elapsed:.3},\"hashes_per_s\":{:.0},\"series\":[{}]}}",
            hashes as f64 / elapsed,
            points.join(",")
        ),
    );
}

/// Hashes until `seconds` have passed; checks the clock and publishes its
/// count every 1000 hashes.
fn chain(seconds: Duration, count: &AtomicU64) -> u64 {
    let start = Instant::now();
    let mut state = [0u8; 32];
    let mut n = 0u64;
    while start.elapsed() < seconds {
        for _ in 0..1000 {
            state = Sha256::digest(state).into();
        }
        n += 1000;
        count.store(n, Ordering::Relaxed);
    }
    std::hint::black_box(state);
    n
}
