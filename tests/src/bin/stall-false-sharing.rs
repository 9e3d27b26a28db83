//! Cache-line ping-pong, and its padded twins.
//!
//! `--mode counters`: threads `bump-a` (CPU 0) and `bump-b` (CPU 1)
//! increment two atomics that sit side by side on one cache line, in
//! `bump_a` and `bump_b`.
//!
//! `--mode rwlock` (the incident's shape): `scheduler` (CPU 0) takes a read
//! lock millions of times a second in `check_bank`, on a lock that shares a
//! cache line with bank data that `replay` (CPU 1) reads in `replay_reads`.
//!
//! `--padded`: the same with the hot fields on their own 128-byte lines.
//! `--seconds S` (default 4). `--report FILE`: the shared line's address.

use std::{
    hint::black_box,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        RwLock,
    },
    thread,
};

use slotprof_tests::{name_thread, pin_to_cpu, precise_ips, write_report, Flags};

#[repr(align(128))]
struct Padded<T>(T);

/// Counters side by side (one line) or padded apart.
struct Counters {
    a: Padded<AtomicU64>,
    b: Padded<AtomicU64>,
}

struct PackedCounters {
    a: AtomicU64,
    b: AtomicU64,
}

/// The incident's bank: lock word and hot data on one line, or apart.
#[repr(C, align(64))]
struct Bank {
    lock: RwLock<()>,
    data: [AtomicU64; 4],
}

#[repr(C)]
struct PaddedBank {
    lock: Padded<RwLock<()>>,
    data: Padded<[AtomicU64; 4]>,
}

#[inline(never)]
fn bump_a(c: &AtomicU64, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1000 {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Not identical to `bump_a` (it adds 2), or the compiler would fold the
/// two into one function and both sites would have one name.
#[inline(never)]
fn bump_b(c: &AtomicU64, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1000 {
            c.fetch_add(2, Ordering::Relaxed);
        }
    }
}

#[inline(never)]
fn check_bank(lock: &RwLock<()>, stop: &AtomicBool) -> u64 {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1000 {
            let g = lock.read().unwrap();
            black_box(&g);
            n += 1;
        }
    }
    n
}

#[inline(never)]
fn replay_reads(data: &[AtomicU64; 4], stop: &AtomicBool) -> u64 {
    let mut sum = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1000 {
            for d in data {
                sum = sum.wrapping_add(d.load(Ordering::Relaxed));
            }
        }
    }
    sum
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 4.0);
    let padded = std::env::args().any(|a| a == "--padded");
    let mode = flags.get("mode").unwrap_or("counters").to_string();
    let stop: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
    // In the precise-ip test VM: exact sample IPs while the threads run.
    precise_ips(true);

    // (address of the line both threads use, or of the written field)
    let (shared, t1, t2): (usize, thread::JoinHandle<u64>, thread::JoinHandle<u64>) =
        match (mode.as_str(), padded) {
            ("counters", false) => {
                let c: &'static PackedCounters = Box::leak(Box::new(PackedCounters {
                    a: AtomicU64::new(0),
                    b: AtomicU64::new(0),
                }));
                (
                    &c.a as *const _ as usize,
                    thread::spawn(move || {
                        name_thread("bump-a");
                        pin_to_cpu(0);
                        bump_a(&c.a, stop);
                        0
                    }),
                    thread::spawn(move || {
                        name_thread("bump-b");
                        pin_to_cpu(1);
                        bump_b(&c.b, stop);
                        0
                    }),
                )
            }
            ("counters", true) => {
                let c: &'static Counters = Box::leak(Box::new(Counters {
                    a: Padded(AtomicU64::new(0)),
                    b: Padded(AtomicU64::new(0)),
                }));
                (
                    &c.a.0 as *const _ as usize,
                    thread::spawn(move || {
                        name_thread("bump-a");
                        pin_to_cpu(0);
                        bump_a(&c.a.0, stop);
                        0
                    }),
                    thread::spawn(move || {
                        name_thread("bump-b");
                        pin_to_cpu(1);
                        bump_b(&c.b.0, stop);
                        0
                    }),
                )
            }
            ("rwlock", false) => {
                let b: &'static Bank = Box::leak(Box::new(Bank {
                    lock: RwLock::new(()),
                    data: Default::default(),
                }));
                (
                    &b.lock as *const _ as usize,
                    thread::spawn(move || {
                        name_thread("scheduler");
                        pin_to_cpu(0);
                        check_bank(&b.lock, stop)
                    }),
                    thread::spawn(move || {
                        name_thread("replay");
                        pin_to_cpu(1);
                        replay_reads(&b.data, stop)
                    }),
                )
            }
            ("rwlock", true) => {
                let b: &'static PaddedBank = Box::leak(Box::new(PaddedBank {
                    lock: Padded(RwLock::new(())),
                    data: Padded(Default::default()),
                }));
                (
                    &b.lock.0 as *const _ as usize,
                    thread::spawn(move || {
                        name_thread("scheduler");
                        pin_to_cpu(0);
                        check_bank(&b.lock.0, stop)
                    }),
                    thread::spawn(move || {
                        name_thread("replay");
                        pin_to_cpu(1);
                        replay_reads(&b.data.0, stop)
                    }),
                )
            }
            _ => {
                eprintln!("--mode wants counters or rwlock");
                std::process::exit(2);
            }
        };
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    let (x, y) = (t1.join().unwrap(), t2.join().unwrap());
    precise_ips(false);
    black_box((x, y));
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"mode\":\"{mode}\",\"padded\":{padded},\"shared_addr\":{shared},\"shared_line\":{}}}",
            std::process::id(),
            shared & !63
        ),
    );
}
