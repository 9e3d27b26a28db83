//! Slots made bad with a known probability by one stall class, and a second
//! class that is harmless: the known answer `slotprof explain` must find.
//!
//! Slots are the program's own: `--slot-ms` (400) long from CLOCK_MONOTONIC
//! 0, what `slotprof --slot-source clock=400ms,origin=0` cuts. The loop
//! thread (`main-loop`) iterates every ~1 ms (`stall_loop_iteration`). At
//! the first iteration of each slot it draws, from a seeded generator
//! (`--seed`, 1): a gap (probability `--p-gap`, 0.3: at ~100 ms into the
//! slot it sleeps `--gap-ms`, 40, in `injected_sleep`: a MainLoopGap), a
//! lock wait (`--p-lock`, 0.3, independent: at ~250 ms it waits ~8 ms for
//! a mutex the `lock-holder` thread holds: a LockContention, below a 20 ms
//! gap threshold), and the slot's outcome: bad with probability
//! `--bad-with-gap` (0.6) when it had the gap, `--bad-without` (0.1)
//! otherwise; the lock never matters. So the gap's relative risk is
//! 0.6/0.1 = 6 and the lock's 1.
//!
//! `--seconds S` (40). `--outcomes FILE`: the outcomes as JSON lines
//! (`{"slot": N, "bad": B}`, what `slotprof explain --outcomes` reads);
//! `--report FILE`: every slot with what was injected and its outcome.

use std::{
    sync::{mpsc, Arc, Mutex},
    thread,
    time::Duration,
};

use slotprof_tests::{monotonic_ns, name_thread, write_report, Flags};

#[path = "../stall_loop.rs"]
mod stall_loop;

use stall_loop::{hold_bank_lock, injected_sleep, stall_loop_iteration, wait_for_bank_lock};

/// xorshift64*: a seeded draw in [0, 1).
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What one slot got.
struct Plan {
    slot: u64,
    gap: bool,
    lock: bool,
    bad: bool,
    gap_done: bool,
    lock_done: bool,
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 40.0);
    let slot_ns = (flags.num("slot-ms", 400.0) * 1e6) as u64;
    let p_gap = flags.num("p-gap", 0.3);
    let p_lock = flags.num("p-lock", 0.3);
    let bad_with = flags.num("bad-with-gap", 0.6);
    let bad_without = flags.num("bad-without", 0.1);
    let gap = Duration::from_secs_f64(flags.num("gap-ms", 40.0) / 1e3);
    let mut draw = Draw((flags.num("seed", 1.0) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);

    let bank_lock = Arc::new(Mutex::new(0u64));
    let (hold_tx, hold_rx) = mpsc::channel::<()>();
    let (taken_tx, taken_rx) = mpsc::channel::<()>();
    {
        let bank_lock = bank_lock.clone();
        thread::spawn(move || {
            name_thread("lock-holder");
            while hold_rx.recv().is_ok() {
                hold_bank_lock(&bank_lock, &taken_tx, Duration::from_millis(8));
            }
        });
    }
    name_thread("main-loop");
    let end = monotonic_ns() + run_for.as_nanos() as u64;
    let mut plans: Vec<Plan> = Vec::new();
    let mut i = 0u64;
    while monotonic_ns() < end {
        stall_loop_iteration(i);
        i += 1;
        let now = monotonic_ns();
        let slot = now / slot_ns;
        let into = now % slot_ns;
        if plans.last().is_none_or(|p| p.slot != slot) {
            // Only slots entered at their start are judged (the first one is
            // entered wherever the program started).
            if into > 20_000_000 {
                continue;
            }
            let gap = draw.next() < p_gap;
            let lock = draw.next() < p_lock;
            let bad = draw.next() < if gap { bad_with } else { bad_without };
            plans.push(Plan {
                slot,
                gap,
                lock,
                bad,
                gap_done: false,
                lock_done: false,
            });
        }
        let p = plans.last_mut().expect("a plan");
        if p.slot != slot {
            continue;
        }
        if p.gap && !p.gap_done && into >= 100_000_000 {
            p.gap_done = true;
            injected_sleep(gap);
        }
        if p.lock && !p.lock_done && into >= 250_000_000 {
            p.lock_done = true;
            hold_tx.send(()).unwrap();
            taken_rx.recv().unwrap();
            wait_for_bank_lock(&bank_lock);
        }
    }
    // A slot the run ended in is not judged.
    let last_whole = monotonic_ns() / slot_ns;
    let judged: Vec<&Plan> = plans.iter().filter(|p| p.slot < last_whole).collect();
    if let Some(path) = flags.get("outcomes") {
        let lines: Vec<String> = judged
            .iter()
            .map(|p| format!("{{\"slot\":{},\"bad\":{}}}", p.slot, p.bad))
            .collect();
        std::fs::write(path, lines.join("\n") + "\n").expect("write --outcomes");
    }
    let slots: Vec<String> = judged
        .iter()
        .map(|p| {
            format!(
                "{{\"slot\":{},\"gap\":{},\"lock\":{},\"bad\":{}}}",
                p.slot, p.gap, p.lock, p.bad
            )
        })
        .collect();
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"slot_ms\":{},\"relative_risk\":{},\"slots\":[{}]}}",
            std::process::id(),
            slot_ns / 1_000_000,
            bad_with / bad_without,
            slots.join(",")
        ),
    );
}
