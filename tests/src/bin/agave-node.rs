//! `agave-node`: runs the real validator of `cargo xtask validator` until
//! Ctrl-C (or SIGTERM), then stops it and removes its ledger.
//!
//! usage: SLOTPROF_VALIDATOR=BIN agave-node [--load TX_PER_S]
//!
//! `--load N` runs `loadgen` ($SLOTPROF_LOADGEN) against it: N transactions
//! a second from the Solana client library until the node is stopped.

use std::time::Duration;

use slotprof_tests::validator::{binary, Load, Node};

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::SeqCst);
}

fn main() {
    let bin = binary().unwrap_or_else(|e| {
        eprintln!("agave-node: {e}");
        std::process::exit(2)
    });
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rate: Option<u32> = match args.as_slice() {
        [] => None,
        [flag, n] if flag == "--load" => match n.parse() {
            Ok(n) if n > 0 => Some(n),
            _ => {
                eprintln!(
                    "agave-node: --load wants a whole number of transactions a second, e.g. --load 100"
                );
                std::process::exit(2)
            }
        },
        _ => {
            eprintln!("usage: agave-node [--load TX_PER_S]");
            std::process::exit(2)
        }
    };
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    eprintln!(
        "agave-node: starting {} on a fresh ledger (first slot after ~15 s)",
        bin.display()
    );
    let mut node = Node::start(&bin, 2, Duration::from_secs(120)).unwrap_or_else(|e| {
        eprintln!("agave-node: {e}");
        std::process::exit(1)
    });
    println!(
        "The node runs: pid {}, RPC {}, ledger {}",
        node.pid(),
        node.rpc_url(),
        node.dir.display()
    );
    println!(
        "Profile it:\n  sudo target/release/slotprof attach --pid {} --duration 20s \\\n    \
         --slot-source rpc={} --out slotprof-validator",
        node.pid(),
        node.rpc_url()
    );
    let load = match rate.map(|r| Load::start(&node, r, u32::MAX, &node.dir.join("load.json"))) {
        Some(Err(e)) => {
            eprintln!("agave-node: {e}; stopping the node");
            drop(node);
            std::process::exit(1)
        }
        other => other.map(Result::unwrap),
    };
    if let Some(r) = rate {
        println!("Client load: {r} transactions a second (transfers, Memo, SPL Token), after a few seconds of set-up.");
    }
    println!("Ctrl-C stops it and removes its ledger.");
    let mut code = 0;
    while !STOP.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200));
        if node.slot().is_err() && !node.is_running() {
            eprintln!("agave-node: the validator exited; its log:\n{}", node.log_tail());
            code = 1;
            break;
        }
    }
    eprintln!("agave-node: stopping the node, removing {}", node.dir.display());
    drop(load);
    drop(node);
    std::process::exit(code);
}
