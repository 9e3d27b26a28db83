//! jemalloc purging on the hot thread, and its fixed twin.
//!
//! Every slot (`--slot-ms`, default 400) the `bank-loop` thread builds a
//! bank-like structure (`--bank-mib`, default 48 MiB in 64 KiB buffers,
//! every page touched) and drops it half-way through the slot. With
//! `--purge sync` jemalloc runs with `background_thread:false,
//! dirty_decay_ms:0`, so the freeing thread returns the pages with madvise
//! itself. With `--purge background` the program does what fixed the
//! incident: `background_thread:true`, and the bank dropped on a `reaper`
//! thread. (background_thread alone is not enough: jemalloc still purges,
//! on the freeing thread, every freed extent that coalesces past
//! `oversize_threshold`, 8 MiB by default.) The program re-executes itself with the
//! matching `_RJEM_MALLOC_CONF` and reports jemalloc's purge counters.
//!
//! `--slots N` (default 8), `--report FILE`.

use std::{hint::black_box, os::unix::process::CommandExt, time::Duration};

use slotprof_tests::{monotonic_ns, name_thread, write_report, Flags};

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const CONF_ENV: &str = "_RJEM_MALLOC_CONF";

#[inline(never)]
fn build_bank(mib: usize) -> Vec<Vec<u8>> {
    (0..mib * 16)
        .map(|i| {
            // Filled, not zero-allocated: jemalloc zeroes recycled dirty
            // pages for zeroed allocations with madvise too, on the
            // allocating thread, which would blur the purge twins.
            let mut v = Vec::with_capacity(64 << 10);
            v.resize(64 << 10, i as u8 | 1);
            v
        })
        .collect()
}

#[inline(never)]
fn drop_bank(bank: Vec<Vec<u8>>) {
    drop(black_box(bank));
}

fn mallctl_u64(name: &str) -> u64 {
    let key = format!("{name}\0");
    // SAFETY: the names used are u64 statistics of jemalloc 5.3.
    unsafe { tikv_jemalloc_ctl::raw::read::<u64>(key.as_bytes()) }.unwrap_or(0)
}

fn sleep_until(t: u64) {
    let now = monotonic_ns();
    if t > now {
        std::thread::sleep(Duration::from_nanos(t - now));
    }
}

fn main() {
    let flags = Flags::from_env();
    let purge = flags.get("purge").unwrap_or("sync").to_string();
    let conf = match purge.as_str() {
        "sync" => "background_thread:false,dirty_decay_ms:0,muzzy_decay_ms:0",
        "background" => "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0",
        other => {
            eprintln!("--purge wants sync or background, got {other:?}");
            std::process::exit(2);
        }
    };
    if std::env::var(CONF_ENV).ok().as_deref() != Some(conf) {
        // jemalloc reads its configuration once, at start: run again with it.
        let err = std::process::Command::new("/proc/self/exe")
            .args(std::env::args_os().skip(1))
            .env(CONF_ENV, conf)
            .exec();
        panic!("re-exec failed: {err}");
    }
    name_thread("bank-loop");
    let slot_ns = (flags.num("slot-ms", 400.0) * 1e6) as u64;
    let slots = flags.num("slots", 8.0) as u64;
    let mib = flags.num("bank-mib", 48.0) as usize;
    let reaper = (purge == "background").then(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Vec<u8>>>(1);
        std::thread::spawn(move || {
            name_thread("reaper");
            while let Ok(bank) = rx.recv() {
                drop_bank(bank);
            }
        });
        tx
    });
    let origin = monotonic_ns();
    for n in 0..slots {
        sleep_until(origin + n * slot_ns);
        let bank = build_bank(mib);
        sleep_until(origin + n * slot_ns + slot_ns / 2);
        match &reaper {
            Some(tx) => tx.send(bank).unwrap(),
            None => drop_bank(bank),
        }
    }
    sleep_until(origin + slots * slot_ns);
    let _ = tikv_jemalloc_ctl::epoch::advance();
    // MALLCTL_ARENAS_ALL = 4096: all arenas merged.
    let stat = |s: &str| mallctl_u64(&format!("stats.arenas.4096.{s}"));
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"purge\":\"{purge}\",\"slots\":{slots},\"freed_bytes\":{},\
             \"dirty_npurge\":{},\"dirty_nmadvise\":{},\"dirty_purged_pages\":{},\"muzzy_nmadvise\":{}}}",
            std::process::id(),
            (slots * mib as u64) << 20,
            stat("dirty_npurge"),
            stat("dirty_nmadvise"),
            stat("dirty_purged"),
            stat("muzzy_nmadvise"),
        ),
    );
}
