//! A square-wave CPU competitor: spins on `--cpu` for `--on` seconds, then
//! sleeps `--off` seconds, for `--seconds` (default 25). The phase probe on
//! that CPU should see a slow phase of on/(on+off) with period on+off.

use std::{hint::black_box, time::Duration};

use slotprof_tests::{monotonic_ns, name_thread, pin_to_cpu, write_report, Flags};

fn main() {
    let flags = Flags::from_env();
    let cpu = flags.num("cpu", 1.0) as usize;
    let on = flags.secs("on", 3.0).as_nanos() as u64;
    let off = flags.secs("off", 2.0).as_nanos() as u64;
    let total = flags.secs("seconds", 25.0).as_nanos() as u64;
    name_thread("competitor");
    pin_to_cpu(cpu);
    let start = monotonic_ns();
    let mut x = 1u64;
    let mut cycles = 0u64;
    while monotonic_ns() - start < total {
        let busy_until = monotonic_ns() + on;
        while monotonic_ns() < busy_until {
            for _ in 0..1000 {
                x = black_box(x.rotate_left(9) ^ x.wrapping_mul(31));
            }
        }
        std::thread::sleep(Duration::from_nanos(off));
        cycles += 1;
    }
    write_report(
        &flags,
        &format!(
            "{{\"pid\":{},\"cycles\":{cycles},\"on_ns\":{on},\"off_ns\":{off}}}",
            std::process::id()
        ),
    );
}
