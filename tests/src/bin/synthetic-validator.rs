//! A stand-in for a validator's main loop: it advances a slot every
//! `--slot-ms` (default 400) from `--origin-ns` (CLOCK_MONOTONIC; default:
//! now), does light work in `process_slot` every slot and known extra work
//! in `heavy_slot_work` in every `--heavy-every`-th slot (default 4), and
//! reports its own slot boundaries.
//!
//! `--slots N` (default 12): how many slots to run.
//! `--first-slot S` (default 0): number of the first slot.
//! `--report FILE`: where the JSON report goes (default stdout).
//! `--rpc-port P`: serve a JSON-RPC fixture for these slots on 127.0.0.1:P
//!   (HTTP) and P+1 (websocket slotSubscribe); `--leader K/M` (default
//!   4/8): this node leads the first K of every M slots of the epoch;
//!   `--rpc-stop-after N`: stop answering after N slots.
//!
//! `--lock-stall-every K` (default 0: never), `--lock-stall-ms M` (default
//!   30): in every K-th slot (slot number % K == K - 1) the bank loop waits
//!   M ms for a mutex that a `bank-lock-holder` thread holds (a real
//!   futex wait: LockContention's ground truth, listed in the report).
//! `--cpu N`: every thread on CPU N.
//!
//! Each slot starts with a call to `synthetic_validator_start_slot(slot)`,
//! an exported, never-inlined function: the place a uprobe slot source
//! hooks, like `PohRecorder::set_bank` in Agave.

use std::{hint::black_box, time::Duration};

use slotprof_tests::{
    monotonic_ns, name_thread, pin_to_cpu,
    rpc_fixture::{ChainConfig, RpcFixture},
    write_report, Flags,
};

/// Marks the start of a slot (the uprobe target).
#[no_mangle]
#[inline(never)]
pub extern "C" fn synthetic_validator_start_slot(slot: u64) -> u64 {
    black_box(slot)
}

/// Spins for `d` in a dependent chain. Inlined into each caller, so each
/// caller's samples land in the caller itself (a shared callee would be
/// tail-called and the caller's frame would vanish from the stack).
#[inline(always)]
fn burn(d: Duration, seed: u64) -> u64 {
    let end = monotonic_ns() + d.as_nanos() as u64;
    let mut x = seed;
    while monotonic_ns() < end {
        for _ in 0..2_000 {
            x = black_box(x.rotate_left(5) ^ x.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }
    }
    x
}

/// Ordinary per-slot work.
#[inline(never)]
fn process_slot(d: Duration) -> u64 {
    black_box(burn(d, 1))
}

/// The extra work done only in heavy slots.
#[inline(never)]
fn heavy_slot_work(d: Duration) -> u64 {
    black_box(burn(d, 2))
}

/// Waits for the bank mutex while the holder thread has it.
#[inline(never)]
fn wait_for_bank(bank: &std::sync::Mutex<u64>) -> u64 {
    *black_box(bank.lock().unwrap())
}

fn sleep_until(t_ns: u64) {
    let now = monotonic_ns();
    if t_ns > now {
        std::thread::sleep(Duration::from_nanos(t_ns - now));
    }
}

fn main() {
    let flags = Flags::from_env();
    let slot_ns = (flags.num("slot-ms", 400.0) * 1e6) as u64;
    let slots = flags.num("slots", 12.0) as u64;
    let heavy_every = flags.num("heavy-every", 4.0) as u64;
    let origin = flags
        .get("origin-ns")
        .map_or_else(monotonic_ns, |v| v.parse().expect("--origin-ns"));
    let first = flags.num("first-slot", 0.0) as u64;
    let stop_after = flags
        .get("rpc-stop-after")
        .map(|v| v.parse::<u64>().expect("--rpc-stop-after"));
    let leader = flags
        .get("leader")
        .and_then(|v| v.split_once('/'))
        .map(|(k, m)| (k.parse().expect("--leader K/M"), m.parse().expect("--leader K/M")))
        .unwrap_or((4, 8));
    let mut rpc = flags.get("rpc-port").map(|p| {
        let chain = ChainConfig {
            identity: "SLoTPRoFva1idatorXXXXXXXXXXXXXXXXXXXXXXXXXX".to_string(),
            slots_in_epoch: 432_000,
            leader,
        };
        RpcFixture::start(p.parse().expect("--rpc-port"), chain, first.saturating_sub(1))
            .expect("start the RPC fixture")
    });
    if let Some(cpu) = flags.get("cpu") {
        // Every thread on one CPU: the profiles' cpu label is known.
        pin_to_cpu(cpu.parse().expect("--cpu N"));
    }
    let stall_every = flags.num("lock-stall-every", 0.0) as u64;
    let stall = Duration::from_secs_f64(flags.num("lock-stall-ms", 30.0) / 1e3);
    let bank = std::sync::Arc::new(std::sync::Mutex::new(0u64));
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let (taken_tx, taken_rx) = std::sync::mpsc::channel::<()>();
    {
        let bank = bank.clone();
        std::thread::spawn(move || {
            name_thread("bank-lock-holder");
            while hold_rx.recv().is_ok() {
                let mut g = bank.lock().unwrap();
                taken_tx.send(()).unwrap();
                std::thread::sleep(stall);
                *g += 1;
            }
        });
    }
    let mut stalls = Vec::new();
    name_thread("bank-loop");

    let mut report = Vec::new();
    for n in 0..slots {
        let start = origin + n * slot_ns;
        sleep_until(start);
        let began = monotonic_ns();
        if let Some(f) = &mut rpc {
            if stop_after == Some(n) {
                f.stop();
            }
            f.set_slot(first + n);
        }
        synthetic_validator_start_slot(first + n);
        let heavy = heavy_every > 0 && n % heavy_every == 0;
        process_slot(Duration::from_nanos(slot_ns / 10));
        if heavy {
            heavy_slot_work(Duration::from_nanos(slot_ns / 2));
        }
        if stall_every > 0 && (first + n) % stall_every == stall_every - 1 {
            hold_tx.send(()).unwrap();
            taken_rx.recv().unwrap();
            wait_for_bank(&bank);
            stalls.push((first + n).to_string());
        }
        report.push(format!(
            "{{\"slot\":{},\"start_ns\":{start},\"began_ns\":{began},\"end_ns\":{},\"heavy\":{heavy}}}",
            first + n,
            start + slot_ns
        ));
    }
    sleep_until(origin + slots * slot_ns);
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"slot_ns\":{slot_ns},\"origin_ns\":{origin},\"slots\":[{}],\"lock_stalls\":[{}]}}",
            std::process::id(),
            report.join(","),
            stalls.join(",")
        ),
    );
}
