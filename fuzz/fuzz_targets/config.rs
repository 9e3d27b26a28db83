//! `slotprof.toml` as `slotprof run` parses and checks it (a SIGHUP reads
//! whatever is in the file then).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = profiler::config::Config::parse(text);
    }
});
