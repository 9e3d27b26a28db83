//! Known call chains under named threads, for checking that user stacks
//! reach the thread's start whatever the build: a hot chain three calls
//! deep (`hot`: deep_spin_top -> deep_spin_mid -> deep_spin_leaf) and a
//! Condvar wait three calls deep (`waiter`: deep_wait_top -> deep_wait_mid
//! -> deep_wait_leaf -> Condvar::wait_timeout). `cargo xtask build` builds
//! it twice: with frame pointers (target/release) and as a plain
//! `cargo build --release` would, without (target/nofp/release).
//!
//! With `--recurse N` a third thread, `recursive`, spins at the bottom of
//! N nested calls of `deep_recurse` (deeper than the 128 frames a stack
//! keeps: its stacks end in `[truncated]`).
//!
//! `stall-deep --seconds N [--recurse N]`

use std::{
    sync::{Condvar, Mutex},
    time::{Duration, Instant},
};

#[inline(never)]
fn deep_spin_leaf(n: u64) -> u64 {
    let mut x = n;
    for i in 0..200_000u64 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
    }
    std::hint::black_box(x)
}

#[inline(never)]
fn deep_spin_mid(n: u64) -> u64 {
    std::hint::black_box(deep_spin_leaf(n)).wrapping_add(1)
}

#[inline(never)]
fn deep_spin_top(n: u64) -> u64 {
    std::hint::black_box(deep_spin_mid(n)).wrapping_add(1)
}

#[inline(never)]
fn deep_wait_leaf(p: &(Mutex<bool>, Condvar)) {
    let g = p.0.lock().unwrap();
    let _ = p.1.wait_timeout(g, Duration::from_millis(20)).unwrap();
}

#[inline(never)]
fn deep_wait_mid(p: &(Mutex<bool>, Condvar)) {
    deep_wait_leaf(p);
    std::hint::black_box(());
}

#[inline(never)]
fn deep_wait_top(p: &(Mutex<bool>, Condvar)) {
    deep_wait_mid(p);
    std::hint::black_box(());
}

/// Spins until `end` at the bottom of `depth` nested calls.
#[inline(never)]
fn deep_recurse(depth: u32, end: Instant) -> u64 {
    if depth == 0 {
        let mut n = 0;
        while Instant::now() < end {
            n = deep_spin_leaf(n);
        }
        return n;
    }
    // Work after the call keeps it a call (no tail call, no loop).
    std::hint::black_box(deep_recurse(std::hint::black_box(depth - 1), end)).wrapping_add(1)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = args
        .iter()
        .position(|a| a == "--seconds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let recurse: Option<u32> = args
        .iter()
        .position(|a| a == "--recurse")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok());
    let end = Instant::now() + Duration::from_secs(seconds);
    let recursive = recurse.map(|depth| {
        std::thread::Builder::new()
            .name("recursive".into())
            .spawn(move || deep_recurse(depth, end))
            .unwrap()
    });
    let hot = std::thread::Builder::new()
        .name("hot".into())
        .spawn(move || {
            let mut n = 0;
            while Instant::now() < end {
                n = deep_spin_top(n);
            }
            n
        })
        .unwrap();
    let waiter = std::thread::Builder::new()
        .name("waiter".into())
        .spawn(move || {
            let p = (Mutex::new(false), Condvar::new());
            while Instant::now() < end {
                deep_wait_top(&p);
            }
        })
        .unwrap();
    hot.join().unwrap();
    waiter.join().unwrap();
    if let Some(r) = recursive {
        r.join().unwrap();
    }
}
