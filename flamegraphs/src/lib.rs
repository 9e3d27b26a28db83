//! Folded stacks, and the files made from them.
//!
//! The pipeline is the one from inferno: stacks are collapsed into a
//! [`Folded`] set (one line per distinct stack, `root;...;leaf value`), then
//! rendered: as folded text (for `flamegraph.pl`, inferno, speedscope), as
//! an SVG flamegraph ([`svg`]), or as a pprof protobuf ([`pprof`]). Every
//! renderer returns bytes; writing them is the caller's business.

mod folded;
pub mod otlp;
pub mod pprof;
pub mod svg;

pub use folded::{fold, Folded, FoldedSum};
