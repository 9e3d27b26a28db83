//! Records as they come out of the ring buffer (and out of a
//! `--save-events` file): the kernel side is ours, but a saved file is
//! anyone's, and a bug on either side must not become a crash here.
#![no_main]

use libfuzzer_sys::fuzz_target;
use profiler::{kernel::events, kernel::user_stacks::UserStacks};

fuzz_target!(|data: &[u8]| {
    let mut stacks = UserStacks::default();
    stacks.begin_batch();
    for record in events::read_raw(data) {
        let _ = events::decode(record);
        let _ = stacks.feed(record, &mut |_| {});
    }
    stacks.flush(&mut |_| {});
});
