//! The validator's JSON-RPC answers and websocket messages, as slotprof
//! reads them: every call's `result` type, the leader schedule checked
//! against the epoch, the slot notifications. Errors are fine; panics,
//! hangs and unbounded allocations are not.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use profiler::slot_sources::rpc::{decode_answer, notification_slot, schedule_from};
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let _ = decode_answer::<u64>("getSlot", data);
    let _ = notification_slot(&String::from_utf8_lossy(data));
    // The first line is getEpochInfo's result, the rest getLeaderSchedule's.
    let (info, schedule) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b""[..]),
    };
    if let Ok(Some(info)) = decode_answer::<Value>("getEpochInfo", info) {
        if let Ok(s) = decode_answer::<HashMap<String, Vec<u64>>>("getLeaderSchedule", schedule) {
            if let Ok(e) = schedule_from(&info, s, "Node1111") {
                // The schedule's own questions must hold up too.
                let _ = e.contains(e.first_slot);
                let _ = e.contains(u64::MAX);
            }
        }
    }
});
