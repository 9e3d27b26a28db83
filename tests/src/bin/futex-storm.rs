//! A context-switch storm for benchmarks: two threads hand a token back
//! and forth, through a Mutex and a Condvar (default: every round trip is
//! two futex waits and two wakes) or through two pipes (`--through pipe`,
//! one byte each way).
//! `--pairs N` runs N such pairs at once (default 1): with more pairs than
//! CPUs a CPU switches from one storm thread straight to another instead of
//! going idle between handoffs, so the machine switches more often.
//! Reports round trips per second (all pairs) and its own CPU time.
//!
//! `--seconds S` (default 3), `--through futex|pipe`, `--pairs N`, `--report FILE`.

use std::{
    fs::File,
    io::{Read, Write},
    os::fd::FromRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Condvar, Mutex,
    },
    thread,
    time::Instant,
};

use slotprof_tests::{name_thread, write_report, Flags};

/// One pair ping-ponging a byte through two pipes until `stop`; the handle
/// gives its round trips.
fn pipe_pair(stop: Arc<AtomicBool>) -> thread::JoinHandle<u64> {
    let pipe = || {
        let mut fds = [0; 2];
        // SAFETY: pipe(2) fills two fds that we then own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe");
        unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
    };
    let ((mut to_pong_r, mut to_pong_w), (mut to_ping_r, mut to_ping_w)) = (pipe(), pipe());
    let pong = thread::spawn(move || {
        name_thread("pong");
        let mut b = [0u8];
        while to_pong_r.read_exact(&mut b).is_ok() && b[0] != 2 {
            to_ping_w.write_all(&b).unwrap();
        }
    });
    thread::spawn(move || {
        name_thread("ping");
        let mut b = [1u8];
        let mut trips = 0;
        while !stop.load(Ordering::Relaxed) {
            to_pong_w.write_all(&[1]).unwrap();
            to_ping_r.read_exact(&mut b).unwrap();
            trips += 1;
        }
        to_pong_w.write_all(&[2]).unwrap();
        pong.join().unwrap();
        trips
    })
}

/// One pair handing a token through a Mutex and a Condvar until `stop`;
/// the handle gives its round trips.
fn futex_pair(stop: Arc<AtomicBool>) -> thread::JoinHandle<u64> {
    // The token: whose turn it is (0 or 1), or 2 to stop.
    let pair = Arc::new((Mutex::new(0u8), Condvar::new()));
    let player = |me: u8, pair: Arc<(Mutex<u8>, Condvar)>, stop: Option<Arc<AtomicBool>>| {
        move || {
            name_thread(if me == 0 { "ping" } else { "pong" });
            let (lock, cv) = &*pair;
            let mut turns = 0u64;
            let mut turn = lock.lock().unwrap();
            loop {
                while *turn != me && *turn != 2 {
                    turn = cv.wait(turn).unwrap();
                }
                if *turn == 2 {
                    return turns;
                }
                // The first player ends the game when told to.
                let done = stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed));
                *turn = if done { 2 } else { 1 - me };
                turns += 1;
                cv.notify_one();
            }
        }
    };
    let b = thread::spawn(player(1, pair.clone(), None));
    thread::spawn(move || {
        let a = player(0, pair, Some(stop))();
        (a + b.join().unwrap()) / 2
    })
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 3.0);
    let through_pipe = match flags.get("through") {
        None | Some("futex") => false,
        Some("pipe") => true,
        Some(other) => {
            eprintln!("futex-storm: --through {other:?}: use futex or pipe");
            std::process::exit(2);
        }
    };
    let pairs = flags.num("pairs", 1.0).max(1.0) as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..pairs)
        .map(|_| {
            if through_pipe {
                pipe_pair(stop.clone())
            } else {
                futex_pair(stop.clone())
            }
        })
        .collect();
    thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    let trips: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    report(&flags, trips, start.elapsed().as_secs_f64());
}

fn report(flags: &Flags, round_trips: u64, secs: f64) {
    // Its own CPU time, so a tool that runs it as a child can tell its
    // own CPU from the storm's.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a zeroed rusage for the kernel to fill.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let cpu_s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    write_report(
        flags,
        &format!(
            "{{\"pid\":{},\"round_trips\":{},\"round_trips_per_s\":{:.0},\"cpu_s\":{:.3}}}",
            std::process::id(),
            round_trips,
            round_trips as f64 / secs,
            cpu_s(usage.ru_utime) + cpu_s(usage.ru_stime)
        ),
    );
}
