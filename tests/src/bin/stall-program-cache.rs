//! Program-cache work with a known cost: a replay thread whose "program
//! cache" misses in every 3rd slot, and the fixed twin whose cache holds
//! every program.
//!
//! The functions are named as Agave's are (modules `solana_sbpf::elf`,
//! `solana_sbpf::verifier`, `solana_program_runtime::loaded_programs`
//! inside this crate), so that slotprof finds them by the same table it
//! uses on a validator: `Executable::load` (parsing), `RequisiteVerifier::
//! verify` (two monomorphizations, used in alternate misses: each copy must
//! have its uprobes), `Executable::jit_compile` (which calls itself once:
//! only the outer call counts), `ProgramCache::evict_using_random_selection`
//! and `ProgramCache::prune`.
//!
//! Slots are the program's own: `--slot-ms` (400) long from CLOCK_MONOTONIC
//! 0, what `slotprof --slot-source clock=400ms,origin=0` cuts. The `replay`
//! thread iterates every ~1 ms (`stall_loop_iteration`); at 50 ms into
//! every slot it prunes the cache (`--prune-ms`, 0.3: present in every
//! slot, under any threshold); at 100 ms into every `--every`-th slot (3)
//! from the third slot on it misses: evicts (`--evict-ms`, 2), loads
//! (`--load-ms`, 3), verifies (`--verify-ms`, 2) and JIT-compiles
//! (`--jit-ms`, 10) a program. With `--fixed` nothing misses (the cache is
//! big enough) and only the prunes run.
//!
//! `--seconds S` (6). The report: the pid, the replay thread's tid, and
//! every call it made (`kind`, `start_ns`, `end_ns`, `variant` for verify),
//! each timed by the called function itself, from its first statement to
//! its last (outermost calls: the JIT's call of itself is in its caller's).

use std::{hint::black_box, time::Duration};

use slotprof_tests::{monotonic_ns, name_thread, write_report, Flags};

// The replay thread's iteration is the main loop's of the other stall
// programs (its lock helpers are not used here).
#[allow(dead_code)]
#[path = "../stall_loop.rs"]
mod stall_loop;

use stall_loop::stall_loop_iteration;

/// CPU work until `end` (CLOCK_MONOTONIC ns), in a frame of its own so
/// that samples inside a call name it.
#[inline(never)]
fn emit_instructions(seed: u64, end: u64) -> u64 {
    let mut x = seed;
    while monotonic_ns() < end {
        for _ in 0..200 {
            x = black_box(x.rotate_left(7) ^ x.wrapping_mul(0x2545_f491_4f6c_dd1d));
        }
    }
    x
}

fn busy(ms: f64) -> u64 {
    emit_instructions(ms as u64, monotonic_ns() + (ms * 1e6) as u64)
}

thread_local! {
    /// The outermost probed call running on this thread: (its first and
    /// last instant as the function itself saw them, nesting depth).
    static INSIDE: std::cell::Cell<(u64, u64, u32)> = const { std::cell::Cell::new((0, 0, 0)) };
}

/// Runs a probed function's body, noting when it began and ended from
/// inside the function (outermost call only): what the uprobe and the
/// uretprobe see, without the entry trap, the return trampoline or a
/// preemption around the call (under TCG those took 6.8 ms once beside a
/// 15 ms call).
fn inside<T>(body: impl FnOnce() -> T) -> T {
    INSIDE.with(|c| {
        let (s, e, d) = c.get();
        c.set(if d == 0 {
            (monotonic_ns(), 0, 1)
        } else {
            (s, e, d + 1)
        });
    });
    let r = body();
    INSIDE.with(|c| {
        let (s, e, d) = c.get();
        c.set(if d == 1 {
            (s, monotonic_ns(), 0)
        } else {
            (s, e, d - 1)
        });
    });
    r
}

mod solana_sbpf {
    pub mod elf {
        use std::marker::PhantomData;

        pub struct Executable<C> {
            pub text: u64,
            _context: PhantomData<C>,
        }

        impl<C> Executable<C> {
            #[inline(never)]
            pub fn load(bytes: &[u8], ms: f64) -> Self {
                super::super::inside(|| Self {
                    text: super::super::busy(ms) ^ bytes.len() as u64,
                    _context: PhantomData,
                })
            }

            /// Calls itself once (`depth` 1): nested calls are one piece of
            /// work.
            #[inline(never)]
            pub fn jit_compile(&mut self, ms: f64, depth: u32) -> u64 {
                super::super::inside(|| {
                    if depth > 0 {
                        let half = self.jit_compile(ms / 2.0, depth - 1);
                        return std::hint::black_box(half ^ super::super::busy(ms / 2.0));
                    }
                    super::super::busy(ms)
                })
            }
        }
    }

    pub mod verifier {
        pub trait Verifier {
            fn verify<F: Copy + Into<u64>>(text: u64, f: F, ms: f64) -> u64;
        }

        pub struct RequisiteVerifier;

        impl Verifier for RequisiteVerifier {
            #[inline(never)]
            fn verify<F: Copy + Into<u64>>(text: u64, f: F, ms: f64) -> u64 {
                super::super::inside(|| text ^ f.into() ^ super::super::busy(ms))
            }
        }
    }
}

mod solana_program_runtime {
    pub mod loaded_programs {
        use std::marker::PhantomData;

        pub struct ProgramCache<FG> {
            pub entries: u64,
            _fork_graph: PhantomData<FG>,
        }

        impl<FG> ProgramCache<FG> {
            pub fn new() -> Self {
                Self {
                    entries: 0,
                    _fork_graph: PhantomData,
                }
            }

            #[inline(never)]
            pub fn evict_using_random_selection(&mut self, ms: f64) {
                super::super::inside(|| self.entries = self.entries.wrapping_add(super::super::busy(ms)));
            }

            #[inline(never)]
            pub fn prune(&mut self, ms: f64) {
                super::super::inside(|| self.entries ^= super::super::busy(ms));
            }
        }
    }
}

use solana_program_runtime::loaded_programs::ProgramCache;
use solana_sbpf::{
    elf::Executable,
    verifier::{RequisiteVerifier, Verifier},
};

struct InvokeContext;
struct BankForks;

/// One call as the function saw it from inside: (kind, start, end, variant).
type Call = (&'static str, u64, u64, u32);

fn timed<T>(calls: &mut Vec<Call>, kind: &'static str, variant: u32, f: impl FnOnce() -> T) -> T {
    let r = f();
    let (start, end, _) = INSIDE.with(|c| c.get());
    calls.push((kind, start, end, variant));
    r
}

fn main() {
    let flags = Flags::from_env();
    let run_for = flags.secs("seconds", 6.0).as_nanos() as u64;
    let slot_ns = (flags.num("slot-ms", 400.0) * 1e6) as u64;
    let every = flags.num("every", 3.0) as u64;
    let (prune_ms, evict_ms, load_ms, verify_ms, jit_ms) = (
        flags.num("prune-ms", 0.3),
        flags.num("evict-ms", 2.0),
        flags.num("load-ms", 3.0),
        flags.num("verify-ms", 2.0),
        flags.num("jit-ms", 10.0),
    );
    let fixed = std::env::args().any(|a| a == "--fixed");
    let start = monotonic_ns();
    let end = start + run_for;
    let first = start / slot_ns + 2;

    let replay = std::thread::spawn(move || {
        name_thread("replay");
        let tid = unsafe { libc::gettid() } as u32;
        let mut cache: ProgramCache<BankForks> = ProgramCache::new();
        let mut calls: Vec<Call> = Vec::new();
        let elf = vec![0x7f_u8; 4096];
        let (mut pruned, mut missed) = (start / slot_ns, first - every);
        let mut misses = 0u32;
        let mut i = 0u64;
        while monotonic_ns() < end {
            black_box(stall_loop_iteration(i));
            i += 1;
            let now = monotonic_ns();
            let (slot, into) = (now / slot_ns, now % slot_ns);
            if slot > pruned && into >= 50_000_000 {
                pruned = slot;
                timed(&mut calls, "evict", 1, || cache.prune(prune_ms));
            }
            if !fixed && slot >= missed + every && slot % every == first % every && into >= 100_000_000 {
                missed = slot;
                misses += 1;
                timed(&mut calls, "evict", 0, || {
                    cache.evict_using_random_selection(evict_ms)
                });
                let mut exe: Executable<InvokeContext> =
                    timed(&mut calls, "load", 0, || Executable::load(&elf, load_ms));
                // Alternate misses use the verifier's two copies.
                let variant = misses % 2;
                let text = exe.text;
                timed(&mut calls, "verify", variant, || {
                    if variant == 0 {
                        RequisiteVerifier::verify(text, 1u32, verify_ms)
                    } else {
                        RequisiteVerifier::verify(text, 1u64, verify_ms)
                    }
                });
                black_box(timed(&mut calls, "jit", 0, || exe.jit_compile(jit_ms, 1)));
            }
        }
        (tid, calls)
    });
    let (tid, calls) = replay.join().expect("the replay thread");
    std::thread::sleep(Duration::from_millis(20));
    let calls: Vec<String> = calls
        .iter()
        .map(|(kind, s, e, v)| {
            format!(r#"{{"kind": "{kind}", "start_ns": {s}, "end_ns": {e}, "variant": {v}}}"#)
        })
        .collect();
    write_report(
        &flags,
        &format!(
            r#"{{"pid": {}, "replay_tid": {tid}, "slot_ms": {}, "fixed": {fixed}, "calls": [{}]}}"#,
            std::process::id(),
            slot_ns / 1_000_000,
            calls.join(", ")
        ),
    );
}
