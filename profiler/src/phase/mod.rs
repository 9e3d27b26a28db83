//! The guest's view of a host that slows it down: a calibrated probe and
//! the analysis of what it measured.
//!
//! Inside a VM the host's work (kcompactd migrating the guest's memory,
//! KVM invalidating its mappings) is invisible, but its effect is not: the
//! same CPU-bound work takes longer. [`probe`] runs a PoH-like sha256 chain
//! for a short burst at a fixed interval on each chosen CPU and records the
//! ns per hash; [`analysis`] splits the windows into slow and fast (by the
//! midpoint of p10 and p90, the incident's method), and finds the period
//! and duty cycle of the slow phase.
//!
//! Not here: what the host itself did (`host`, run on the hypervisor).

pub mod analysis;
pub mod probe;
