//! A PoH-like CPU-bound loop: each thread hashes the previous sha256 output,
//! as a Solana leader's PoH thread does, for `--seconds` (default 3), on
//! `--threads` threads (default: one per CPU). Reports hashes per second,
//! the figure whose drop is a profiler's overhead on CPU-bound work.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use slotprof_tests::{name_thread, write_report, Flags};

fn main() {
    let flags = Flags::from_env();
    let seconds = flags.secs("seconds", 3.0);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = flags.num("threads", cpus as f64) as usize;
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            std::thread::spawn(move || {
                name_thread(&format!("poh{i}"));
                chain(seconds)
            })
        })
        .collect();
    let hashes: u64 = workers.into_iter().map(|w| w.join().expect("poh thread")).sum();
    let elapsed = start.elapsed().as_secs_f64();
    write_report(
        &flags,
        &format!(
            "{{\"threads\":{threads},\"hashes\":{hashes},\"seconds\":{elapsed:.3},\"hashes_per_s\":{:.0}}}",
            hashes as f64 / elapsed
        ),
    );
}

/// Hashes until `seconds` have passed; checks the clock every 1000 hashes.
fn chain(seconds: Duration) -> u64 {
    let start = Instant::now();
    let mut state = [0u8; 32];
    let mut n = 0u64;
    while start.elapsed() < seconds {
        for _ in 0..1000 {
            state = Sha256::digest(state).into();
        }
        n += 1000;
    }
    std::hint::black_box(state);
    n
}
