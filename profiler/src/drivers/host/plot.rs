//! host.svg: invalidations and compaction over time, bursts shaded. Plain
//! SVG, so it opens in a browser and pastes into an incident report.

use std::fmt::Write;

use crate::detectors::kvm_mmu_invalidation::analysis::{DutyCycle, Series};

const W: f64 = 1000.0;
const PANEL_H: f64 = 200.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 50.0;
const COLORS: [&str; 6] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

struct Line<'a> {
    label: &'a str,
    values: Vec<f64>,
}

/// Renders the plot; `title` names the host and the session.
pub fn render(series: &Series, duty: &DutyCycle, title: &str) -> String {
    let n = series.seconds.len().max(1);
    let mut sources: Vec<(&String, u64)> = Vec::new();
    for s in &series.seconds {
        for (label, pages) in &s.invalidated_by_source {
            match sources.iter_mut().find(|(l, _)| *l == label) {
                Some(e) => e.1 += pages,
                None => sources.push((label, *pages)),
            }
        }
    }
    sources.sort_by_key(|s| std::cmp::Reverse(s.1));
    let mut top = vec![Line {
        label: "invalidated pages/s (all)",
        values: series
            .seconds
            .iter()
            .map(|s| s.invalidated_pages as f64)
            .collect(),
    }];
    if sources.len() > 1 {
        for (label, _) in sources.iter().take(COLORS.len() - 1) {
            top.push(Line {
                label,
                values: series
                    .seconds
                    .iter()
                    .map(|s| *s.invalidated_by_source.get(*label).unwrap_or(&0) as f64)
                    .collect(),
            });
        }
    }
    let bottom = vec![
        Line {
            label: "compaction: pages scanned/s",
            values: series
                .seconds
                .iter()
                .map(|s| s.compaction_scanned as f64)
                .collect(),
        },
        Line {
            label: "compaction: pages isolated/s",
            values: series
                .seconds
                .iter()
                .map(|s| s.compaction_isolated as f64)
                .collect(),
        },
        Line {
            label: "pages migrated/s",
            values: series.seconds.iter().map(|s| s.migrated as f64).collect(),
        },
    ];
    let height = TOP + 2.0 * PANEL_H + GAP + 40.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        svg,
        r#"<text x="{LEFT}" y="20" font-size="15">{}</text>"#,
        escape(title)
    );
    panel(&mut svg, &top, duty, n, TOP, "KVM invalidations (pages/s)");
    panel(
        &mut svg,
        &bottom,
        duty,
        n,
        TOP + PANEL_H + GAP,
        "host compaction and migration (pages/s)",
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">seconds since start (shaded: bursts)</text></svg>"#,
        LEFT + (W - LEFT - RIGHT) / 2.0,
        height - 8.0
    );
    svg
}

fn panel(svg: &mut String, lines: &[Line], duty: &DutyCycle, n: usize, y0: f64, title: &str) {
    let plot_w = W - LEFT - RIGHT;
    let max = lines
        .iter()
        .flat_map(|l| l.values.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1.0);
    let x = |i: f64| LEFT + i / n as f64 * plot_w;
    let y = |v: f64| y0 + PANEL_H - v / max * PANEL_H;
    for b in &duty.bursts {
        let _ = write!(
            svg,
            r##"<rect x="{:.1}" y="{y0}" width="{:.1}" height="{PANEL_H}" fill="#fde0dc"/>"##,
            x(b.start_s as f64),
            (b.length_s as f64 / n as f64 * plot_w).max(1.0)
        );
    }
    let _ = write!(
        svg,
        r##"<rect x="{LEFT}" y="{y0}" width="{plot_w}" height="{PANEL_H}" fill="none" stroke="#888"/>"##
    );
    let _ = write!(
        svg,
        r#"<text x="{LEFT}" y="{}">{}</text>"#,
        y0 - 6.0,
        escape(title)
    );
    for frac in [0.0, 0.5, 1.0] {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 4.0,
            y(max * frac) + 4.0,
            si(max * frac)
        );
    }
    let step = tick_step(n);
    let mut t = 0;
    while t <= n {
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{t}</text>"#,
            x(t as f64),
            y0 + PANEL_H + 14.0
        );
        t += step;
    }
    for (k, line) in lines.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let points: Vec<String> = line
            .values
            .iter()
            .enumerate()
            .map(|(i, &v)| format!("{:.1},{:.1}", x(i as f64 + 0.5), y(v)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="{}" points="{}"/>"#,
            if k == 0 { 2 } else { 1 },
            points.join(" ")
        );
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" fill="{color}" text-anchor="end">{}</text>"#,
            W - RIGHT - 6.0,
            y0 + 16.0 + 14.0 * k as f64,
            escape(line.label)
        );
    }
}

fn tick_step(n: usize) -> usize {
    [1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600]
        .into_iter()
        .find(|s| n / s <= 12)
        .unwrap_or(7200)
}

fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detectors::kvm_mmu_invalidation::analysis::{duty_cycle, Second};

    #[test]
    fn renders_lines_bursts_and_labels() {
        let mut series = Series::default();
        for i in 0..30u64 {
            let pages = if i % 10 < 4 { 50_000 } else { 0 };
            let s = series.at(i as usize);
            *s = Second {
                invalidated_pages: pages,
                compaction_scanned: pages * 2,
                ..Default::default()
            };
            s.invalidated_by_source
                .insert("kcompactd-proactive".into(), pages);
        }
        let pages: Vec<u64> = series.seconds.iter().map(|s| s.invalidated_pages).collect();
        let duty = duty_cycle(&pages);
        let svg = render(&series, &duty, "host <test>");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert_eq!(svg.matches("fill=\"#fde0dc\"").count(), 2 * duty.bursts.len());
        assert!(svg.contains("host &lt;test&gt;"));
        assert!(svg.contains("50.0k"));
        assert_eq!(svg.matches("<polyline").count(), 4);
    }
}
