//! The slot timeline: one static, offline piece of HTML (a canvas and its
//! script, the data inline) that `index.html` and `slotprof explain`'s
//! `explain.html` both put at their top. Slots run along time, each a bar as
//! tall as the slot lasted, coloured by where its time went (the busiest
//! thread on-CPU, then the stalls the findings measured: waiting for a CPU,
//! lock waits, madvise, memory, program cache; the rest grey); leader
//! windows shaded behind, the phase as a band on top, findings (and, in
//! explain, bad slots) marked above. The wheel zooms, a drag pans, a click
//! shows a slot (with links to its flamegraphs where they are).
//!
//! A canvas, so 10,000 slots draw at once: when there are more slots than
//! pixels, a column's bar is its slot with the most stall time (a real
//! slot, the worst), and its marks (leader, phase, findings, bad) any of
//! its slots'. After
//! each draw the script writes what it drew on the canvas element
//! (`data-slots`, `data-columns`, `data-finding-columns`,
//! `data-leader-columns`, `data-bad-columns`, `data-colours`: the palette's
//! colours found in the canvas's pixels): what a headless browser test
//! checks, and a person can read in the inspector.

use std::fmt::Write as _;

use crate::detectors::{Finding, FindingKind};

/// Where a slot's time went, in the order the parts stack (bottom up).
pub const PARTS: [(&str, &str); 6] = [
    ("on-CPU (busiest thread)", "#4c78a8"),
    ("waiting for a CPU", "#f58518"),
    ("lock waits", "#e45756"),
    ("madvise (allocator purges)", "#72b7b2"),
    ("memory (reclaim, page waits)", "#54a24b"),
    ("program cache", "#b279a2"),
];

/// The part a finding kind's time goes to (MainLoopGap and the cache-line
/// and KVM kinds are marked, not stacked: their time is the others').
fn part_of(kind: FindingKind) -> Option<usize> {
    match kind {
        FindingKind::CpuContention => Some(1),
        FindingKind::LockContention => Some(2),
        FindingKind::SyncAllocatorPurge => Some(3),
        FindingKind::MemoryPressure => Some(4),
        FindingKind::ProgramCache => Some(5),
        _ => None,
    }
}

/// One slot as the timeline draws it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bar {
    pub number: u64,
    /// CLOCK_MONOTONIC ns (0: unknown; the slots are then drawn in order).
    pub start_ns: u64,
    pub duration_ms: f64,
    pub leader: bool,
    pub aligned: bool,
    /// "slow" or "fast".
    pub phase: Option<String>,
    /// ms per [`PARTS`] entry.
    pub parts: [f64; 6],
    /// The finding kinds in the slot (names).
    pub kinds: Vec<String>,
    /// explain's judgement of the slot, when it has one.
    pub bad: Option<bool>,
}

impl Bar {
    /// A slot's bar from its findings (each finding's time to its kind's
    /// part) and its busiest thread's on-CPU time.
    pub fn new(slot: &crate::slots::Slot, busiest_oncpu_ms: f64, findings: &[&Finding]) -> Bar {
        let mut bar = Bar {
            number: slot.number,
            start_ns: slot.start_ns,
            duration_ms: slot.duration_ns() as f64 / 1e6,
            leader: slot.leader,
            aligned: slot.aligned,
            ..Bar::default()
        };
        bar.parts[0] = busiest_oncpu_ms;
        for f in findings {
            bar.add_finding(f.kind.as_str(), f.duration_ns as f64 / 1e6);
        }
        bar
    }

    /// The part a finding of kind `kind` (a name, as written) adds to.
    pub fn add_finding(&mut self, kind: &str, duration_ms: f64) {
        if let Some(p) = FindingKind::ALL
            .iter()
            .find(|k| k.as_str() == kind)
            .and_then(|k| part_of(*k))
        {
            self.parts[p] += duration_ms;
        }
        if !self.kinds.iter().any(|k| k == kind) {
            self.kinds.push(kind.to_string());
        }
    }
}

/// The section: a heading, the legend, the canvas (element id `id`), the
/// detail line, the data and the script. `links`: where slot `N`'s files are
/// (`{links}N/oncpu.svg`), when the page sits beside them.
pub fn section(id: &str, bars: &[Bar], links: Option<&str>) -> String {
    let id: String = id
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    let kinds: Vec<&str> = FindingKind::ALL.iter().map(|k| k.as_str()).collect();
    let origin = bars
        .iter()
        .map(|b| b.start_ns)
        .filter(|&s| s > 0)
        .min()
        .unwrap_or(0);
    let mut data = String::from("[");
    for (i, b) in bars.iter().enumerate() {
        let flags = u32::from(b.leader)
            | u32::from(b.aligned) << 1
            | u32::from(b.phase.as_deref() == Some("slow")) << 2
            | u32::from(b.phase.as_deref() == Some("fast")) << 3;
        let mask: u32 = b
            .kinds
            .iter()
            .filter_map(|k| kinds.iter().position(|n| n == k))
            .fold(0, |m, i| m | 1 << i);
        let at = if b.start_ns > 0 {
            (b.start_ns - origin) as f64 / 1e6
        } else {
            -1.0
        };
        let num = |x: f64| {
            if x.is_finite() {
                (x * 10.0).round() / 10.0
            } else {
                0.0
            }
        };
        let _ = write!(
            data,
            "{}[{},{},{},{},{},{},{},{},{},{},{},{}]",
            if i > 0 { "," } else { "" },
            b.number,
            num(at),
            num(b.duration_ms),
            flags,
            num(b.parts[0]),
            num(b.parts[1]),
            num(b.parts[2]),
            num(b.parts[3]),
            num(b.parts[4]),
            num(b.parts[5]),
            mask,
            match b.bad {
                None => -1,
                Some(false) => 0,
                Some(true) => 1,
            }
        );
    }
    data.push(']');
    let legend: String = PARTS
        .iter()
        .map(|(name, colour)| format!("<span><i style=\"background:{colour}\"></i>{name}</span>"))
        .collect();
    let parts_js: Vec<String> = PARTS.iter().map(|(n, c)| format!("[\"{n}\",\"{c}\"]")).collect();
    let kinds_js: Vec<String> = kinds.iter().map(|k| format!("\"{k}\"")).collect();
    let links_js = match links {
        Some(l) => format!("\"{}\"", l.replace(['"', '\\', '<'], "")),
        None => "null".into(),
    };
    format!(
        r##"<section id="{id}-section" class="timeline">
<h2>Timeline</h2>
<p class="legend">{legend}<span><i style="background:#dce8fa"></i>leader window</span><span><i style="background:#d0d0d0"></i>rest of the slot</span><span><i style="background:#d62728"></i>slow phase</span><span><i style="background:#98df8a"></i>fast phase</span><span><i style="background:#000000"></i>findings</span><span><i style="background:#8b008b"></i>bad slot (explain)</span></p>
<p class="hint">Bar height: the slot's duration. Wheel: zoom; drag: pan; click: the slot; double-click: everything.</p>
<canvas id="{id}" width="1200" height="256" style="width:100%;max-width:1600px;border:1px solid #ccc;cursor:crosshair"></canvas>
<div id="{id}-detail" class="timeline-detail">{count} slots</div>
<script id="{id}-data" type="application/json">{data}</script>
<script>
{script}
slotprofTimeline("{id}", [{parts}], [{kinds}], {links});
</script>
<noscript>The timeline needs JavaScript; the table below has every slot.</noscript>
</section>
"##,
        id = id,
        count = bars.len(),
        data = data,
        script = SCRIPT,
        parts = parts_js.join(","),
        kinds = kinds_js.join(","),
        links = links_js,
    )
}

/// The timeline's script: `slotprofTimeline(id, parts, kinds, links)` draws
/// the canvas `id` from the JSON in `id-data` (see [`section`]).
const SCRIPT: &str = r##"function slotprofTimeline(ID, PARTS, KINDS, LINKS) {
  var REST = "#d0d0d0", LEADER = "#dce8fa", SLOW = "#d62728", FAST = "#98df8a", MARK = "#000000", BAD = "#8b008b";
  var data = JSON.parse(document.getElementById(ID + "-data").textContent);
  var cv = document.getElementById(ID), cx = cv.getContext("2d", {willReadFrequently: true});
  var detail = document.getElementById(ID + "-detail");
  var from = 0, to = data.length, selected = -1;
  var TOP = 32, H = 200;
  function fit() {
    var w = Math.round(Math.min(1600, Math.max(600, cv.getBoundingClientRect().width || 1200)));
    if (cv.width !== w) cv.width = w;
  }
  function columns() {
    var W = cv.width, n = to - from, cols = [];
    if (n <= 0) return cols;
    if (n <= W) {
      for (var i = from; i < to; i++) {
        var x0 = Math.floor((i - from) * W / n), x1 = Math.floor((i - from + 1) * W / n);
        cols.push({x: x0, w: Math.max(1, x1 - x0), a: i, b: i + 1});
      }
    } else {
      for (var c = 0; c < W; c++) {
        var a = from + Math.floor(c * n / W), b = from + Math.floor((c + 1) * n / W);
        if (b > a) cols.push({x: c, w: 1, a: a, b: b});
      }
    }
    return cols;
  }
  function agg(col) {
    // The bar is the column's slot with the most stall time (then the
    // longest): a real slot, the worst; the marks are any slot's.
    var r = {dur: 0, parts: [0, 0, 0, 0, 0, 0], leader: false, slow: false, fast: false, mask: 0, bad: false};
    var worst = -1, key = -1;
    for (var i = col.a; i < col.b; i++) {
      var d = data[i], k = (d[5] + d[6] + d[7] + d[8] + d[9]) * 1e6 + d[2];
      if (k > key) { key = k; worst = i; }
      r.leader = r.leader || (d[3] & 1) !== 0;
      r.slow = r.slow || (d[3] & 4) !== 0;
      r.fast = r.fast || (d[3] & 8) !== 0;
      r.mask |= d[10];
      r.bad = r.bad || d[11] === 1;
    }
    if (worst >= 0) {
      r.dur = data[worst][2];
      for (var p = 0; p < 6; p++) r.parts[p] = data[worst][4 + p];
    }
    return r;
  }
  function draw() {
    var t0 = performance.now();
    fit();
    var W = cv.width, cols = columns(), max = 0, stats = {cols: 0, findings: 0, leader: 0, bad: 0};
    cx.fillStyle = "#ffffff";
    cx.fillRect(0, 0, W, cv.height);
    var aggs = cols.map(agg);
    aggs.forEach(function (r) { max = Math.max(max, r.dur); });
    // The longest slot fills all but the top 20 px: a leader window's
    // shade shows above every bar.
    var scale = max > 0 ? (H - 20) / max : 0;
    cols.forEach(function (col, k) {
      var r = aggs[k];
      stats.cols++;
      if (r.leader) { cx.fillStyle = LEADER; cx.fillRect(col.x, TOP, col.w, H); stats.leader++; }
      if (r.slow || r.fast) { cx.fillStyle = r.slow ? SLOW : FAST; cx.fillRect(col.x, 0, col.w, 8); }
      if (r.mask) { cx.fillStyle = MARK; cx.fillRect(col.x, 11, col.w, 7); stats.findings++; }
      if (r.bad) { cx.fillStyle = BAD; cx.fillRect(col.x, 21, col.w, 7); stats.bad++; }
      var total = Math.round(r.dur * scale), y = TOP + H, left = total;
      for (var p = 0; p < 6 && left > 0; p++) {
        var h = Math.min(left, Math.round(r.parts[p] * scale));
        if (h <= 0) continue;
        cx.fillStyle = PARTS[p][1];
        cx.fillRect(col.x, y - h, col.w, h);
        y -= h; left -= h;
      }
      if (left > 0) { cx.fillStyle = REST; cx.fillRect(col.x, y - left, col.w, left); }
      if (selected >= col.a && selected < col.b) {
        cx.strokeStyle = "#ffbf00"; cx.lineWidth = 1;
        cx.strokeRect(col.x + 0.5, TOP + 0.5, Math.max(1, col.w - 1), H - 1);
      }
    });
    // The slot numbers at the ends and the middle of the view.
    if (to > from) {
      cx.fillStyle = "#333333"; cx.font = "11px sans-serif"; cx.textBaseline = "bottom";
      cx.textAlign = "left"; cx.fillText(String(data[from][0]), 2, cv.height);
      cx.textAlign = "center"; cx.fillText(String(data[Math.floor((from + to) / 2)][0]), W / 2, cv.height);
      cx.textAlign = "right"; cx.fillText(String(data[to - 1][0]), W - 2, cv.height);
    }
    var ms = performance.now() - t0;
    var seen = {}, px = cx.getImageData(0, 0, W, cv.height).data;
    var palette = {rest: REST, leader: LEADER, slow: SLOW, fast: FAST, findings: MARK, bad: BAD};
    PARTS.forEach(function (p, i) { palette["part" + i] = p[1]; });
    var byRgb = {};
    Object.keys(palette).forEach(function (name) {
      var h = palette[name];
      byRgb[parseInt(h.slice(1), 16)] = name;
    });
    for (var q = 0; q < px.length; q += 4) {
      var name = byRgb[(px[q] << 16) | (px[q + 1] << 8) | px[q + 2]];
      if (name) seen[name] = 1;
    }
    var ds = cv.dataset;
    ds.slots = String(data.length);
    ds.from = String(from); ds.to = String(to);
    ds.columns = String(stats.cols);
    ds.findingColumns = String(stats.findings);
    ds.leaderColumns = String(stats.leader);
    ds.badColumns = String(stats.bad);
    ds.colours = Object.keys(seen).sort().join(" ");
    ds.drawMs = ms.toFixed(1);
  }
  function slotAt(ev) {
    var rect = cv.getBoundingClientRect(), x = (ev.clientX - rect.left) * cv.width / rect.width;
    var n = to - from;
    return Math.min(to - 1, Math.max(from, from + Math.floor(x * n / cv.width)));
  }
  function show(i) {
    selected = i;
    var d = data[i], parts = [];
    for (var p = 0; p < 6; p++) if (d[4 + p] > 0) parts.push(PARTS[p][0] + " " + d[4 + p] + " ms");
    var kinds = KINDS.filter(function (k, j) { return (d[10] >> j) & 1; });
    var html = "slot " + d[0] + ((d[3] & 1) ? " (leader)" : "") + ": " + d[2] + " ms" +
      (d[1] >= 0 ? ", at " + (d[1] / 1000).toFixed(1) + " s" : "") +
      ((d[3] & 4) ? ", slow phase" : (d[3] & 8) ? ", fast phase" : "") +
      (d[11] === 1 ? ", <b>bad</b>" : d[11] === 0 ? ", good" : "") +
      (parts.length ? "; " + parts.join(", ") : "") +
      (kinds.length ? "; findings: " + kinds.join(", ") : "");
    if (LINKS !== null) {
      var base = LINKS + d[0] + "/";
      html += ' — <a href="' + base + 'oncpu.svg">on-CPU</a> <a href="' + base + 'offcpu.svg">off-CPU</a> <a href="' + base + 'slot.json">slot.json</a>';
    }
    detail.innerHTML = html;
    draw();
  }
  cv.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var at = slotAt(ev), n = to - from;
    var m = ev.deltaY < 0 ? Math.max(10, Math.round(n / 1.5)) : Math.min(data.length, Math.round(n * 1.5));
    var f = Math.round(at - (at - from) * m / Math.max(1, n));
    from = Math.max(0, Math.min(data.length - m, f)); to = from + m;
    draw();
  }, {passive: false});
  var drag = null;
  cv.addEventListener("mousedown", function (ev) { drag = {x: ev.clientX, from: from, moved: false}; });
  window.addEventListener("mouseup", function () { setTimeout(function () { drag = null; }, 0); });
  cv.addEventListener("mousemove", function (ev) {
    if (!drag) return;
    var n = to - from, dx = ev.clientX - drag.x;
    var shift = Math.round(-dx * n / cv.getBoundingClientRect().width);
    if (shift !== 0) drag.moved = true;
    from = Math.max(0, Math.min(data.length - n, drag.from + shift)); to = from + n;
    draw();
  });
  cv.addEventListener("click", function (ev) { if (!drag || !drag.moved) show(slotAt(ev)); });
  cv.addEventListener("dblclick", function () { from = 0; to = data.length; draw(); });
  window.addEventListener("resize", draw);
  window.slotprofTimelines = window.slotprofTimelines || {};
  window.slotprofTimelines[ID] = {
    zoom: function (a, b) { from = Math.max(0, a); to = Math.min(data.length, b); draw(); },
    select: show
  };
  draw();
}"##;

/// The legend's and the timeline's style (for the page's `<style>`).
pub const STYLE: &str = "p.legend span { margin-right: 1.2em; white-space: nowrap; font-size: 90%; }\n\
p.legend i { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.3em; vertical-align: -0.1em; border: 1px solid #999; }\n\
p.hint { color: #666; font-size: 85%; }\n\
.timeline-detail { margin: 0.5em 0 1em; min-height: 1.4em; }\n";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slots::Slot;

    fn finding(kind: FindingKind, ms: u64) -> Finding {
        Finding {
            kind,
            slot: Some(7),
            pid: 1,
            tid: 1,
            thread: "t".into(),
            start_ns: 0,
            duration_ns: ms * 1_000_000,
            magnitudes: Default::default(),
            cause: None,
            stack: Vec::new(),
            waker_stack: Vec::new(),
            ran_instead: Vec::new(),
            explanation: String::new(),
            advice: String::new(),
        }
    }

    #[test]
    fn findings_time_goes_to_its_kinds_part_and_the_data_says_so() {
        let slot = Slot {
            number: 7,
            start_ns: 5_000_000_000,
            end_ns: 5_400_000_000,
            leader: true,
            window: Some(4),
            aligned: true,
        };
        let f = [
            finding(FindingKind::CpuContention, 12),
            finding(FindingKind::ProgramCache, 30),
            finding(FindingKind::ProgramCache, 5),
            finding(FindingKind::MainLoopGap, 50),
        ];
        let refs: Vec<&Finding> = f.iter().collect();
        let mut bar = Bar::new(&slot, 210.0, &refs);
        bar.phase = Some("slow".into());
        assert_eq!(bar.parts, [210.0, 12.0, 0.0, 0.0, 0.0, 35.0]);
        assert_eq!(bar.kinds, ["CpuContention", "ProgramCache", "MainLoopGap"]);
        let html = section("timeline", &[bar], Some("slots/"));
        // number, at, duration, flags (leader, aligned, slow), parts, kinds
        // mask (CpuContention 1, MainLoopGap 4, ProgramCache 6), bad.
        let kinds_mask = 1 << 1 | 1 << 4 | 1 << 6;
        assert!(
            html.contains(&format!("[[7,0,400,7,210,12,0,0,0,35,{kinds_mask},-1]]")),
            "{html}"
        );
        assert!(
            html.contains("slotprofTimeline(\"timeline\", [[\"on-CPU (busiest thread)\",\"#4c78a8\"]"),
            "{html}"
        );
        assert!(html.contains("], \"slots/\");"));
    }

    #[test]
    fn written_findings_add_by_name_and_unknown_names_are_only_marked() {
        let mut bar = Bar::default();
        bar.add_finding("LockContention", 11.5);
        bar.add_finding("LockContention", 1.0);
        bar.add_finding("SomethingNew", 9.0);
        assert_eq!(bar.parts[2], 12.5);
        assert_eq!(bar.parts.iter().sum::<f64>(), 12.5);
        assert_eq!(bar.kinds, ["LockContention", "SomethingNew"]);
        // An unknown kind has no bit: the data stays well-formed.
        let html = section("t-1", &[bar], None);
        assert!(html.contains(",8,-1]]") && html.contains("], null);"), "{html}");
    }
}
