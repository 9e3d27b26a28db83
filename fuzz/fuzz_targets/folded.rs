//! Folded stacks as `slotprof diff` reads them (any file a user points it
//! at), and what diff does with two of them.
#![no_main]

use flamegraphs::{svg, Folded};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (a, b) = text.split_once("\n\n").unwrap_or((&text, ""));
    let (Ok(a), Ok(b)) = (Folded::parse(a), Folded::parse(b)) else {
        return;
    };
    let _ = a.to_text();
    let opts = svg::SvgOptions {
        title: "fuzz".into(),
        subtitle: None,
        count_name: "samples".into(),
        palette: "hot".into(),
    };
    let _ = svg::render_diff(&a, &b, true, &opts);
});
