//! Builds the eBPF object (profiler-ebpf's binary) for bpfel-unknown-none
//! with the pinned stable toolchain; `include_bytes!` picks it up from OUT_DIR.

fn main() -> anyhow::Result<()> {
    // Building `core` for the bpf target takes `-Z build-std=core`, which
    // the pinned stable rustc accepts only with this set (for this build
    // alone; no nightly toolchain is used).
    // SAFETY: build scripts are single-threaded at this point.
    std::env::set_var("RUSTC_BOOTSTRAP", "1");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../profiler-ebpf");
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "profiler-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom("1.95.0"),
    )
}
