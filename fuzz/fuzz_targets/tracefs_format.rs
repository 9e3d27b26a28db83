//! A tracepoint's `format` file, which slotprof reads to find its fields'
//! offsets on this kernel.
#![no_main]

use libfuzzer_sys::fuzz_target;
use profiler::kernel::tracefs::Format;

fuzz_target!(|data: &[u8]| {
    let format = Format::parse(&String::from_utf8_lossy(data));
    for (name, size) in [("pid", 4), ("prev_state", 8), ("common_pid", 4)] {
        let _ = format.field(name, size);
    }
});
