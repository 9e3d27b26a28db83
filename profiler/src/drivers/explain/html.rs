//! `explain.html`: the same slot timeline as a session's `index.html`, one
//! per node with its bad slots marked, then each comparison table with its
//! rate ratios drawn as a forest plot (the ratio and its 95% interval on a
//! log scale, 1 marked): static, offline, one file.

use std::fmt::Write as _;

use super::{stats, Table};
use crate::export::{
    slot_export::escape,
    timeline_page::{self, Bar},
};

/// A table's forest plot: one row per exposure with a ratio, the interval
/// as a line, the ratio as a dot (red where the interval is above 1).
fn forest(t: &Table) -> String {
    let rows: Vec<_> = t.rows.iter().filter(|r| r.ratio.ratio.is_some()).collect();
    let (w, left, right, row_h) = (900.0, 330.0, 40.0, 22.0);
    let h = 30.0 + row_h * rows.len().max(1) as f64;
    // The axis: a log scale over the finite bounds seen, 1 always in it.
    let finite = |v: Option<f64>| v.filter(|x| x.is_finite() && *x > 0.0);
    let (mut lo, mut hi) = (0.5f64, 2.0f64);
    for r in &rows {
        for v in [finite(r.ratio.low), finite(r.ratio.ratio), finite(r.ratio.high)]
            .into_iter()
            .flatten()
        {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    let (llo, lhi) = ((lo / 1.2).log10(), (hi * 1.2).log10());
    let x = |v: f64| left + (v.log10() - llo) / (lhi - llo) * (w - left - right);
    let mut s = format!(
        "<svg class=\"forest\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" xmlns=\"http://www.w3.org/2000/svg\" \
         font-family=\"system-ui, sans-serif\" font-size=\"12\">\n"
    );
    let one = x(1.0);
    let _ = writeln!(
        s,
        "<line x1=\"{one:.1}\" y1=\"10\" x2=\"{one:.1}\" y2=\"{:.1}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\
         <text x=\"{one:.1}\" y=\"9\" text-anchor=\"middle\" fill=\"#555\">1</text>",
        h - 4.0
    );
    for (i, r) in rows.iter().enumerate() {
        let y = 30.0 + row_h * i as f64;
        let q = &r.ratio;
        let colour = if stats::raises_risk(q) {
            "#d62728"
        } else {
            "#1f77b4"
        };
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left - 8.0,
            y + 4.0,
            escape(&r.exposure)
        );
        let a = finite(q.low).map_or(left, x);
        let b = finite(q.high).map_or(w - right, x);
        let _ = writeln!(
            s,
            "<line class=\"ci\" x1=\"{a:.1}\" y1=\"{y:.1}\" x2=\"{b:.1}\" y2=\"{y:.1}\" stroke=\"{colour}\" stroke-width=\"2\"/>"
        );
        if let Some(v) = finite(q.ratio) {
            let _ = writeln!(
                s,
                "<circle class=\"ratio\" cx=\"{:.1}\" cy=\"{y:.1}\" r=\"4\" fill=\"{colour}\"><title>{}: {:.2} ({}-{})</title></circle>",
                x(v),
                escape(&r.exposure),
                v,
                q.low.map_or("-".into(), |l| format!("{l:.2}")),
                q.high.map_or("-".into(), |h| if h.is_finite() { format!("{h:.2}") } else { "inf".into() }),
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

fn table_html(t: &Table) -> String {
    let num = |v: Option<f64>| match v {
        Some(x) if x.is_infinite() => "inf".to_string(),
        Some(x) => format!("{x:.2}"),
        None => "-".to_string(),
    };
    let mut rows = String::new();
    for r in &t.rows {
        let q = &r.ratio;
        let _ = writeln!(
            rows,
            "<tr{cls}><td class=\"text\">{e}</td><td>{}/{}</td><td>{}/{}</td><td>{}</td><td>{}-{}</td><td>{}</td><td class=\"text\">{note}</td></tr>",
            q.exposed_bad,
            q.exposed,
            q.unexposed_bad,
            q.unexposed,
            num(q.ratio),
            num(q.low),
            num(q.high),
            match q.attributable_share {
                Some(a) if stats::raises_risk(q) => format!("{:.0}%", a * 100.0),
                Some(_) => "n.s.".into(),
                None => "-".into(),
            },
            cls = if stats::raises_risk(q) { " class=\"raises\"" } else { "" },
            e = escape(&r.exposure),
            note = escape(r.note.as_deref().unwrap_or("")),
        );
    }
    format!(
        "<h2>{node}: {slots} slots judged ({judged}), {bad} bad ({pct:.2}%)</h2>\n{forest}\
         <table><thead><tr><th>exposure</th><th>bad/with</th><th>bad/without</th><th>ratio</th><th>95% CI</th>\
         <th>share of bad slots</th><th>note</th></tr></thead><tbody>\n{rows}</tbody></table>\n",
        node = escape(&t.node),
        slots = t.slots,
        judged = t.judged,
        bad = t.bad,
        pct = 100.0 * t.bad as f64 / t.slots.max(1) as f64,
        forest = forest(t),
    )
}

/// The page.
pub fn page(outcomes: &str, nodes: &[(String, Vec<Bar>)], tables: &[Table]) -> String {
    let mut body = String::new();
    for (i, (node, bars)) in nodes.iter().enumerate() {
        let _ = writeln!(body, "<h2>{}: {} slots</h2>", escape(node), bars.len());
        body.push_str(&timeline_page::section(&format!("timeline-{i}"), bars, None));
    }
    for t in tables {
        body.push_str(&table_html(t));
    }
    format!(
        r##"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slotprof explain</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; margin-bottom: 2em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td.text {{ text-align: left; }}
tr.raises td {{ background: #fde0dd; }}
{style}</style></head>
<body>
<h1>slotprof explain</h1>
<p>Bad slots: {outcomes}. A ratio is how many times likelier a bad slot is with the exposure than without; red where its 95% interval lies above 1. The timelines mark bad slots (purple) above the findings (black).</p>
{body}</body></html>
"##,
        style = timeline_page::STYLE,
        outcomes = escape(outcomes),
    )
}
