//! Names for the addresses in slotprof's stacks.
//!
//! User addresses are mapped to `(file, file offset)` through a snapshot of
//! the process's memory map taken while it ran, then symbolized from the
//! file itself ([`blazesym`]'s ELF source). That is what keeps a profile
//! readable when the target exits before the session ends. Kernel addresses
//! go through kallsyms.
//!
//! An address that cannot be named still gets a frame,
//! `[unknown] module+0xoffset`: a stack is never shortened.

mod cfi;
pub mod frame_pointers;
pub mod functions;
pub mod maps;
mod symbolize;
pub mod unwind;

pub use symbolize::{Module, Symbolizer};
