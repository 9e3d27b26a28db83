//! The aggregator alone on a recorded event stream: decoding, ingestion,
//! slot bucketing and the detectors, on one core, with no kernel involved.
//!
//! Record a stream with the hidden `--save-events FILE` option of `slotprof
//! record`/`attach`, then `cargo bench -p profiler --bench aggregate --
//! FILE` (`cargo xtask bench` does both). Stacks are not symbolized here
//! (the stack table is empty): that cost is the symbolizer's, measured
//! apart. Prints one JSON line.

use std::time::{Duration, Instant};

use profiler::{
    detectors::DetectorConfig,
    kernel::events::{self, Event},
    pipeline::aggregate::{Aggregator, StackTable},
    slots::Buckets,
    slots::Timeline,
};
use symbolizer::Symbolizer;

fn main() {
    let Some(path) = std::env::args().skip(1).find(|a| !a.starts_with("--")) else {
        eprintln!("usage: cargo bench -p profiler --bench aggregate -- FILE (a --save-events stream)");
        std::process::exit(2);
    };
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        eprintln!("cannot read {path}: {e} (record one with `slotprof record --save-events {path} -- CMD`)");
        std::process::exit(2);
    });
    let records = events::read_raw(&bytes);
    let mut runs: Vec<(Duration, Duration, Duration, usize)> = Vec::new();
    for _ in 0..7 {
        let t0 = Instant::now();
        let mut agg = Aggregator::new();
        let mut pid = 0;
        for r in &records {
            match events::decode(r) {
                Some(Event::SlotMark(_)) => {}
                Some(e) => {
                    if let Event::Sample(s) = &e {
                        pid = s.tgid;
                    }
                    agg.ingest(&e)
                }
                None => agg.note_malformed(),
            }
        }
        let t1 = Instant::now();
        let (start, end) = agg.span().unwrap().unwrap_or((0, 1));
        let timeline = Timeline::clock(Duration::from_millis(400), start, Some((4, 8)), start, end + 1);
        let table = StackTable::new();
        let mut sym = Symbolizer::new();
        let per_slot = agg.resolve_slots(&timeline, &table, &mut sym).unwrap();
        let t2 = Instant::now();
        let config = DetectorConfig::default();
        let buckets = Buckets::new(Some(&timeline), start);
        let findings =
            profiler::pipeline::detect(&agg, pid, &[], &config, &buckets, &table, &mut sym).unwrap();
        let t3 = Instant::now();
        std::hint::black_box((&per_slot, &findings));
        runs.push((t1 - t0, t2 - t1, t3 - t2, timeline.slots().len()));
    }
    runs.sort_by_key(|r| r.0 + r.1 + r.2);
    let (ingest, bucket, detect, slots) = runs[runs.len() / 2];
    let n = records.len() as f64;
    let total = (ingest + bucket + detect).as_secs_f64();
    println!(
        "{{\"events\":{},\"slots\":{slots},\"ingest_s\":{:.6},\"bucket_s\":{:.6},\"detect_s\":{:.6},\"events_per_s\":{:.0},\"ingest_events_per_s\":{:.0}}}",
        records.len(),
        ingest.as_secs_f64(),
        bucket.as_secs_f64(),
        detect.as_secs_f64(),
        n / total,
        n / ingest.as_secs_f64()
    );
}
