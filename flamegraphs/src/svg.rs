//! Flamegraph SVGs, rendered by inferno.

use inferno::flamegraph::{self, color::Palette, Options};

use crate::Folded;

/// What the SVG says about its data.
#[derive(Clone, Debug)]
pub struct SvgOptions {
    pub title: String,
    pub subtitle: Option<String>,
    /// Unit shown on hover: "samples", "ns".
    pub count_name: String,
    /// An inferno palette name: "rust", "hot", "io", ...
    pub palette: String,
}

impl Default for SvgOptions {
    fn default() -> Self {
        Self {
            title: "Flame Graph".to_string(),
            subtitle: None,
            count_name: "samples".to_string(),
            palette: "rust".to_string(),
        }
    }
}

/// Renders `folded` as an interactive SVG flamegraph. An empty profile
/// gives a small SVG that says so, rather than an error or an empty file.
pub fn render(folded: &Folded, opts: &SvgOptions) -> anyhow::Result<Vec<u8>> {
    if folded.is_empty() {
        return Ok(empty_svg(&opts.title).into_bytes());
    }
    let mut options = Options::default();
    options.title = opts.title.clone();
    options.subtitle = opts.subtitle.clone();
    options.count_name = opts.count_name.clone();
    options.colors = opts
        .palette
        .parse::<Palette>()
        .map_err(|_| anyhow::anyhow!("unknown flamegraph palette {:?}", opts.palette))?;
    options.deterministic = true;
    let text = folded.to_text();
    let mut out = Vec::new();
    flamegraph::from_lines(&mut options, text.lines(), &mut out)?;
    Ok(out)
}

/// The largest total either side of a differential flamegraph may have.
pub const MAX_DIFF_TOTAL: u64 = 1 << 55;

/// Renders a differential flamegraph: frame widths are `after`, colors show
/// growth (red) or shrinkage (blue) from `before`. With `normalize`,
/// `before` is scaled to `after`'s total first (profiles of different
/// lengths).
pub fn render_diff(
    before: &Folded,
    after: &Folded,
    normalize: bool,
    opts: &SvgOptions,
) -> anyhow::Result<Vec<u8>> {
    // inferno takes the difference of two counts as isize (past 2^63 a
    // count wraps and the subtraction overflows) and colours a frame by
    // 150 * (largest difference - its own) as isize (past ~2^56 that
    // overflows): both found by fuzzing `slotprof diff`. 2^55 ns is 417
    // days of one thread's off-CPU time, two days of a 200-thread
    // validator's: more than a session, a slot or an hour holds.
    for (which, f) in [("before", before), ("after", after)] {
        if f.total() > MAX_DIFF_TOTAL {
            anyhow::bail!(
                "the {which} profile's counts add up to {}, more than a differential flamegraph can hold (2^55): not a profile slotprof wrote",
                f.total()
            );
        }
    }
    let mut diff = Vec::new();
    let dopts = inferno::differential::Options {
        normalize,
        ..Default::default()
    };
    inferno::differential::from_readers(
        dopts,
        before.to_text().as_bytes(),
        after.to_text().as_bytes(),
        &mut diff,
    )?;
    let diff = String::from_utf8(diff)?;
    if diff.trim().is_empty() {
        return Ok(empty_svg(&opts.title).into_bytes());
    }
    let mut options = Options::default();
    options.title = opts.title.clone();
    options.subtitle = opts.subtitle.clone();
    options.count_name = opts.count_name.clone();
    options.deterministic = true;
    let mut out = Vec::new();
    flamegraph::from_lines(&mut options, diff.lines(), &mut out)?;
    Ok(out)
}

fn empty_svg(title: &str) -> String {
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    format!(
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"600\" height=\"60\" xmlns=\"http://www.w3.org/2000/svg\">\n\
         <text x=\"300\" y=\"24\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"17\">{title}</text>\n\
         <text x=\"300\" y=\"48\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"12\">no samples</text>\n\
         </svg>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzzer's input: a count near 2^64 made inferno's difference of
    /// two counts overflow (a panic with overflow checks, garbage without).
    #[test]
    fn a_diff_of_absurd_counts_is_an_error_not_a_panic() {
        let mut before = Folded::new();
        before.add(["main", "a"], 5);
        let mut after = Folded::new();
        after.add(["main", "a"], u64::MAX / 2);
        let e = render_diff(&before, &after, true, &SvgOptions::default()).unwrap_err();
        assert!(e.to_string().contains("2^55"), "{e}");
        // At the bound, both overflows the fuzzer found stay away.
        after = Folded::new();
        after.add(["main", "a"], MAX_DIFF_TOTAL - 1);
        after.add(["main", "b"], 1);
        assert!(render_diff(&before, &after, false, &SvgOptions::default()).is_ok());
        assert!(render_diff(&after, &before, false, &SvgOptions::default()).is_ok());
    }

    #[test]
    fn renders_frames_and_empty() {
        let mut f = Folded::new();
        f.add(["thread", "main", "hot_spin"], 10);
        let svg = String::from_utf8(render(&f, &SvgOptions::default()).unwrap()).unwrap();
        assert!(svg.contains("hot_spin") && svg.starts_with("<?xml"));
        let empty = String::from_utf8(render(&Folded::new(), &SvgOptions::default()).unwrap()).unwrap();
        assert!(empty.contains("no samples"));
    }

    #[test]
    fn diff_colors_growth() {
        let mut before = Folded::new();
        before.add(["t", "main", "a"], 10);
        before.add(["t", "main", "b"], 10);
        let mut after = Folded::new();
        after.add(["t", "main", "a"], 10);
        after.add(["t", "main", "b"], 30);
        let svg =
            String::from_utf8(render_diff(&before, &after, false, &SvgOptions::default()).unwrap()).unwrap();
        // b grew by 20: inferno annotates the change in the frame's title.
        let titles: Vec<&str> = svg
            .split("<title>")
            .skip(1)
            .map(|t| t.split("</title>").next().unwrap())
            .collect();
        // b went from half of the profile to three quarters of it.
        assert!(titles.contains(&"b (30 samples, 75.00%; +50.00%)"), "{titles:?}");
        assert!(titles.contains(&"a (10 samples, 25.00%; 0.00%)"), "{titles:?}");
    }
}
