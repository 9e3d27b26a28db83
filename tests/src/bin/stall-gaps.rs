//! A main loop with injected gaps of known kinds, and its smooth twin.
//!
//! The loop thread (`main-loop`) calls `stall_loop_iteration` once per
//! iteration (about 0.5 ms of work and a 0.5 ms sleep). Every `--gap-every`
//! iterations (default 50) it injects a gap of `--gap-ms` (default 20),
//! cycling through three kinds:
//! - `sleep`: it sleeps in `injected_sleep`;
//! - `lock`: it waits in `wait_for_bank_lock` for a mutex that the
//!   `lock-holder` thread holds in `hold_bank_lock`;
//! - `drop`: it drops, in `drop_big_bank`, a large structure that the
//!   `builder` thread made (on-CPU work in the allocator's free path).
//!
//! `--smooth`: no gaps. `--seconds S` (default 6). `--report FILE`: JSON
//! with every injected gap's kind and CLOCK_MONOTONIC start and end, and
//! every iteration that took over `--slow-ms` (default 5) without one,
//! with the `cpu_ns` and `run_delay_ns` the kernel counted over it (the
//! rest of it the thread was blocked: in the smooth loop, its sleep).
//! Each gap also carries what the kernel counted for the loop thread over
//! it (`getrusage(RUSAGE_THREAD)`): `cpu_ns` (user + system time) and
//! `voluntary_switches` (times it blocked), the ground truth of whether
//! the gap was spent on-CPU or blocked, and `run_delay_ns`: the time it
//! spent runnable but waiting for a CPU (`/proc/thread-self/schedstat`).
//! A lock gap's clock counts both, the futex wait neither (or only the
//! delay after the wakeup): a mutex spins before it blocks, and in the TCG
//! test VMs that spin took up to 234 ms of a 250 ms wait (the emulator
//! runs `pause` slowly; natively it is microseconds). A `lock`
//! gap also carries `handoff_ns`: when the loop asked the holder to take
//! the lock (it then waits on a channel until the holder has it; the loop
//! is the hot thread, so that wait is lost time too).

use std::{
    hint::black_box,
    sync::{mpsc, Arc, Mutex},
    thread,
    time::Duration,
};

use slotprof_tests::{monotonic_ns, name_thread, run_delay_ns, write_report, Flags};

/// The calling thread's CPU time (ns) and voluntary context switches.
fn thread_usage() -> (u64, u64) {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1_000;
    (ns(u.ru_utime) + ns(u.ru_stime), u.ru_nvcsw as u64)
}

#[path = "../stall_loop.rs"]
mod stall_loop;

use stall_loop::{hold_bank_lock, injected_sleep, stall_loop_iteration, wait_for_bank_lock};

/// A bank-like structure: many small heap objects.
type Bank = Vec<Box<[u64; 8]>>;

#[inline(never)]
fn build_bank(n: usize) -> Bank {
    (0..n as u64).map(|i| Box::new([i; 8])).collect()
}

#[inline(never)]
fn drop_big_bank(bank: Bank) {
    drop(black_box(bank));
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 6.0);
    let every = flags.num("gap-every", 50.0) as u64;
    let gap = Duration::from_secs_f64(flags.num("gap-ms", 20.0) / 1e3);
    let smooth = std::env::args().any(|a| a == "--smooth");
    let bank_size = flags.num("bank-objects", 1_200_000.0) as usize;
    let slow_ns = (flags.num("slow-ms", 5.0) * 1e6) as u64;

    let bank_lock = Arc::new(Mutex::new(0u64));
    let (hold_tx, hold_rx) = mpsc::channel::<()>();
    let (taken_tx, taken_rx) = mpsc::channel::<()>();
    {
        let bank_lock = bank_lock.clone();
        thread::spawn(move || {
            name_thread("lock-holder");
            while hold_rx.recv().is_ok() {
                hold_bank_lock(&bank_lock, &taken_tx, gap);
            }
        });
    }
    let (want_tx, want_rx) = mpsc::channel::<()>();
    let (bank_tx, bank_rx) = mpsc::channel::<Bank>();
    thread::spawn(move || {
        name_thread("builder");
        while want_rx.recv().is_ok() {
            if bank_tx.send(build_bank(bank_size)).is_err() {
                break;
            }
        }
    });
    if !smooth {
        want_tx.send(()).unwrap();
    }

    name_thread("main-loop");
    let kinds = ["sleep", "lock", "drop"];
    let mut gaps = Vec::new();
    let end = monotonic_ns() + run_for.as_nanos() as u64;
    let mut i = 0u64;
    // The next bank to drop, taken from the builder as soon as it is ready
    // (never waited for inside a gap: on a slow machine the builder can lag).
    let mut ready: Option<Bank> = None;
    // Iterations the program itself saw take over `slow_ns` without an injected
    // gap (the machine's doing: a coarse timer, a vCPU taken away): the
    // smooth twin's ground truth.
    let mut slow = Vec::new();
    let mut last = monotonic_ns();
    let (mut last_usage, mut last_delay) = (thread_usage(), run_delay_ns());
    while monotonic_ns() < end {
        let now = monotonic_ns();
        let (usage, delay) = (thread_usage(), run_delay_ns());
        if now - last > slow_ns && (smooth || !i.is_multiple_of(every)) {
            slow.push(format!(
                "{{\"start_ns\":{last},\"end_ns\":{now},\"cpu_ns\":{},\"run_delay_ns\":{}}}",
                usage.0 - last_usage.0,
                delay.saturating_sub(last_delay)
            ));
        }
        (last, last_usage, last_delay) = (now, usage, delay);
        stall_loop_iteration(i);
        i += 1;
        if ready.is_none() && !smooth {
            ready = bank_rx.try_recv().ok();
        }
        if smooth || !i.is_multiple_of(every) {
            continue;
        }
        let kind = kinds[(i / every) as usize % kinds.len()];
        // Counted from the gap's own start (for a lock gap: once the holder
        // has the lock).
        let mut before = thread_usage();
        let mut delay_before = run_delay_ns();
        let mut handoff = None;
        let (start, stop) = match kind {
            "sleep" => {
                let s = monotonic_ns();
                injected_sleep(gap);
                (s, monotonic_ns())
            }
            "lock" => {
                handoff = Some(monotonic_ns());
                hold_tx.send(()).unwrap();
                taken_rx.recv().unwrap();
                before = thread_usage();
                delay_before = run_delay_ns();
                let s = monotonic_ns();
                wait_for_bank_lock(&bank_lock);
                (s, monotonic_ns())
            }
            _ => {
                let Some(bank) = ready.take() else {
                    continue; // not built yet: no drop this time
                };
                let s = monotonic_ns();
                drop_big_bank(bank);
                let e = monotonic_ns();
                want_tx.send(()).unwrap();
                (s, e)
            }
        };
        let after = thread_usage();
        let delay = run_delay_ns().saturating_sub(delay_before);
        gaps.push(format!(
            "{{\"kind\":\"{kind}\",\"start_ns\":{start},\"end_ns\":{stop},\
             \"cpu_ns\":{},\"voluntary_switches\":{},\"run_delay_ns\":{delay}{}}}",
            after.0 - before.0,
            after.1 - before.1,
            handoff
                .map(|h| format!(",\"handoff_ns\":{h}"))
                .unwrap_or_default()
        ));
    }
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"iterations\":{i},\"gaps\":[{}],\"slow\":[{}]}}",
            std::process::id(),
            gaps.join(","),
            slow.join(",")
        ),
    );
}
