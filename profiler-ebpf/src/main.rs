//! slotprof's kernel side: one program per event source.
//!
//! Built for `bpfel-unknown-none` by `profiler/build.rs`. On the host this
//! file is an empty binary, so `cargo clippy --workspace` works.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod probes;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("profiler-ebpf is an eBPF object, built by profiler/build.rs; run `slotprof` instead");
}
