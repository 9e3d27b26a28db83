//! The modes, each a loop that pumps events from the kernel side
//! (`kernel`) into the pipeline (`pipeline`, `detectors`) and results out
//! to the exporters (`export`): [`session`] (`attach` and `record`: one
//! window, the whole session), [`run`] (always on: finished slots in
//! batches, their exports as they end, reloads, the daemon's resilience)
//! and [`host`] (on the hypervisor: the host's memory management against
//! its VMs).
//!
//! Not here: anything a mode does with events that another mode does too.

pub mod host;
pub mod run;
pub mod session;
