//! CPU contention with a known culprit: a hot thread and a real-time hog
//! on its core, and the fixed twin with the hog on another core.
//!
//! Slots are the program's own: `--slot-ms` (400) long from CLOCK_MONOTONIC
//! 0, what `slotprof --slot-source clock=400ms,origin=0` cuts. The `hot`
//! thread, pinned to CPU `--cpu` (0), iterates every ~1 ms (0.5 ms of work,
//! a 0.5 ms sleep: it is both preempted and woken). A second process,
//! `hog` (forked before any thread exists), SCHED_FIFO priority 1, spins
//! for `--burst-ms` (30) at 150 ms into every `--every`-th slot (3) from
//! the third slot on: pinned to the hot thread's CPU, it takes the core
//! and the hot thread waits for it; with `--fixed` it is pinned to another
//! CPU (the fix: the culprit moved off the hot core) and takes nothing from
//! the hot thread.
//!
//! `--seconds S` (8). The report: the pids, the hot thread's tid, each
//! burst the hog ran (`start_ns`, `end_ns`), and per slot the run-queue
//! wait the kernel counted for the hot thread (`run_delay_ns`, from
//! `/proc/thread-self/schedstat`, read every iteration: the independent
//! count a CpuContention finding must agree with).

use std::{
    collections::BTreeMap,
    hint::black_box,
    io::{BufRead, BufReader, Write},
    os::fd::FromRawFd,
    time::Duration,
};

use slotprof_tests::{monotonic_ns, name_thread, pin_to_cpu, run_delay_ns, write_report, Flags};

// The hot thread's iteration is the main loop's of the other stall
// programs (its lock helpers are not used here).
#[allow(dead_code)]
#[path = "../stall_loop.rs"]
mod stall_loop;

use stall_loop::stall_loop_iteration;

/// The hog: real-time, on `cpu`, a burst of `burst` ns at 150 ms into every
/// `every`-th slot from slot `first` until `end`; writes each burst to `out`.
fn hog(cpu: usize, slot_ns: u64, first: u64, every: u64, burst: u64, end: u64, mut out: std::fs::File) {
    name_thread("hog");
    pin_to_cpu(cpu);
    let param = libc::sched_param { sched_priority: 1 };
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        eprintln!(
            "stall-contention: the hog cannot be SCHED_FIFO ({}): run as root",
            std::io::Error::last_os_error()
        );
        std::process::exit(2);
    }
    let mut slot = first;
    loop {
        let at = slot * slot_ns + 150_000_000;
        if at + burst >= end {
            break;
        }
        // One sleep: between bursts the hog never runs (what it logs is
        // all it took).
        std::thread::sleep(Duration::from_nanos(at.saturating_sub(monotonic_ns())));
        let start = monotonic_ns();
        while monotonic_ns() - start < burst {
            std::hint::spin_loop();
        }
        let stop = monotonic_ns();
        writeln!(out, "{start} {stop}").expect("write to the parent");
        slot += every;
    }
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 8.0).as_nanos() as u64;
    let slot_ns = (flags.num("slot-ms", 400.0) * 1e6) as u64;
    let burst = (flags.num("burst-ms", 30.0) * 1e6) as u64;
    let every = flags.num("every", 3.0) as u64;
    let cpu = flags.num("cpu", 0.0) as usize;
    let fixed = std::env::args().any(|a| a == "--fixed");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        eprintln!("stall-contention needs two CPUs (the hot one and another)");
        std::process::exit(2);
    }
    let hog_cpu = if fixed { (cpu + 1) % cpus } else { cpu };
    let start = monotonic_ns();
    let end = start + run_for;
    let first = start / slot_ns + 2;

    let mut fds = [0; 2];
    assert_eq!(
        unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) },
        0,
        "pipe"
    );
    // Forked while this process has one thread.
    let child = unsafe { libc::fork() };
    if child == 0 {
        unsafe { libc::close(fds[0]) };
        let out = unsafe { std::fs::File::from_raw_fd(fds[1]) };
        hog(hog_cpu, slot_ns, first, every, burst, end, out);
        unsafe { libc::_exit(0) };
    }
    assert!(child > 0, "fork: {}", std::io::Error::last_os_error());
    unsafe { libc::close(fds[1]) };
    let bursts_from = unsafe { std::fs::File::from_raw_fd(fds[0]) };

    let hot = std::thread::spawn(move || {
        name_thread("hot");
        pin_to_cpu(cpu);
        let tid = unsafe { libc::gettid() } as u32;
        let mut delay: BTreeMap<u64, u64> = BTreeMap::new();
        // From the thread's birth (the kernel zeroes a new task's
        // run_delay): its first wait for a CPU and the one after moving to
        // the pinned core (behind slotprof's own threads, as it starts)
        // are the kernel's count too, in the first slot read.
        let mut last = 0;
        let mut i = 0u64;
        while monotonic_ns() < end {
            black_box(stall_loop_iteration(i));
            i += 1;
            let now_delay = run_delay_ns();
            *delay.entry(monotonic_ns() / slot_ns).or_default() += now_delay - last;
            last = now_delay;
        }
        (tid, delay)
    });
    let bursts: Vec<(u64, u64)> = BufReader::new(bursts_from)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| {
            let (a, b) = l.split_once(' ')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect();
    let mut status = 0;
    unsafe { libc::waitpid(child, &mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the hog failed (status {status})"
    );
    let (tid, delay) = hot.join().expect("the hot thread");
    let bursts: Vec<String> = bursts
        .iter()
        .map(|(a, b)| format!("{{\"start_ns\":{a},\"end_ns\":{b}}}"))
        .collect();
    let slots: Vec<String> = delay
        .iter()
        .map(|(s, d)| format!("{{\"slot\":{s},\"run_delay_ns\":{d}}}"))
        .collect();
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"hot_tid\":{tid},\"hog_pid\":{child},\"hog_cpu\":{hog_cpu},\"cpu\":{cpu},\
             \"fixed\":{fixed},\"slot_ms\":{},\"bursts\":[{}],\"slots\":[{}]}}",
            std::process::id(),
            slot_ns / 1_000_000,
            bursts.join(","),
            slots.join(",")
        ),
    );
}
