//! Everything that touches the kernel or the target process: loading and
//! attaching the probes ([`probes`]; [`hooks`]: each program to its event;
//! [`attach`]: a target's whole set; [`btf`], [`tracefs`]),
//! the event stream ([`ring_reader`]: the ring buffer drained off the event
//! loop; [`events`]: its records decoded; [`stream`]: both, through the
//! user-stack unwinder, into a driver's sink), stack maps ([`stack_cache`])
//! and user stacks unwound from the copies the probes take
//! ([`user_stacks`]), the target's
//! threads and code ([`target`]; [`cache_functions`]: where a
//! validator's program-cache functions are, for their uprobes), syscall
//! names ([`syscalls`]), the kernel's pressure-stall counters ([`psi`]) and
//! the privileges all this needs ([`privileges`]).
//!
//! Not here: what is made of the events once delivered (`pipeline`,
//! `detectors`), and the loops that drive a mode (`drivers`).

pub mod attach;
pub mod btf;
pub mod cache_functions;
pub mod events;
pub mod hooks;
pub mod privileges;
pub mod probes;
pub mod psi;
pub mod ring_reader;
pub mod stack_cache;
pub mod stream;
pub mod syscalls;
pub mod target;
pub mod tracefs;
pub mod user_stacks;
