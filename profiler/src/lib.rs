//! slotprof's userspace: loads the probes, turns their events into
//! profiles, and writes files that open in the tools operators already use.
//!
//! The data flows one way, and the modules follow it:
//! [`probes`] (load and attach, read kernel maps) -> [`events`] (decode
//! ring-buffer records) -> [`aggregate`] (count by thread and stack) ->
//! [`report`] (symbolize, write folded/SVG/pprof/summary). [`session`]
//! drives it for `attach` and `record`.

pub mod aggregate;
pub mod attach;
pub mod background;
pub mod btf;
pub mod cli;
pub mod config;
pub mod detectors;
pub mod diff;
pub mod duration;
pub mod events;
pub mod host;
pub mod intervals;
pub mod memory_access;
pub mod metrics;
pub mod output;
pub mod phase;
pub mod pipeline;
pub mod privileges;
pub mod probes;
pub mod records;
pub mod replay;
pub mod report;
pub mod ring_reader;
pub mod run;
pub mod sd_notify;
pub mod session;
pub mod slot_export;
pub mod slot_sources;
pub mod slot_window;
pub mod slots;
pub mod sys;
pub mod syscalls;
pub mod target;
pub mod topology;
pub mod tracefs;
pub mod user_stacks;

/// slotprof's version, as written into every summary.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
