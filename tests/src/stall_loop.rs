//! The main loop and the lock of the stall programs that have one
//! (stall-gaps, stall-explain), included by each (`#[path]`): the
//! functions their tests name (`stall_loop_iteration` is the
//! `--loop-symbol` target; the lock's waiter and holder are the stacks
//! LockContention must show) are the same code in both.

use std::{
    hint::black_box,
    sync::{mpsc, Mutex},
    thread,
    time::Duration,
};

use slotprof_tests::monotonic_ns;

/// One iteration of the main loop (the `--loop-symbol` target).
#[no_mangle]
#[inline(never)]
pub extern "C" fn stall_loop_iteration(i: u64) -> u64 {
    let end = monotonic_ns() + 500_000;
    let mut x = i;
    while monotonic_ns() < end {
        for _ in 0..500 {
            x = black_box(x.rotate_left(3) ^ x.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }
    }
    thread::sleep(Duration::from_micros(500));
    x
}

#[inline(never)]
pub fn injected_sleep(d: Duration) {
    thread::sleep(black_box(d));
}

#[inline(never)]
pub fn wait_for_bank_lock(bank: &Mutex<u64>) -> u64 {
    *black_box(bank.lock().unwrap())
}

#[inline(never)]
pub fn hold_bank_lock(bank: &Mutex<u64>, taken: &mpsc::Sender<()>, d: Duration) {
    let mut guard = bank.lock().unwrap();
    taken.send(()).unwrap();
    thread::sleep(d);
    *guard += 1;
    // Work after the unlock: the unlock (and its futex wake) is a call
    // from here, not a tail call that would leave this frame off the
    // waker's stack.
    drop(guard);
    black_box(taken);
}
