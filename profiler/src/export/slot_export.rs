//! Per-slot and per-leader-window outputs: `slots/<n>/`, `windows/<first>/`,
//! `trace.json` (Chrome trace events, for Perfetto) and `index.html`.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use flamegraphs::{pprof::ProfileMeta, Folded};
use serde::Serialize;
use serde_json::json;

use super::{SlotExport, SlotResult};
use crate::{
    detectors::Finding,
    export::report::{write_profiles, Parts, SlotLabels, WindowSlots},
    output::write_atomic,
    pipeline::aggregate::{Profiles, StackKey},
    slots::{Slot, Timeline},
};

/// What `slot.json` says about one slot.
#[derive(Debug, Serialize)]
pub struct SlotSummary {
    #[serde(flatten)]
    pub slot: Slot,
    pub duration_ms: f64,
    pub oncpu_samples: u64,
    /// Samples times the sampling period.
    pub oncpu_ms: f64,
    pub offcpu_ms: f64,
    /// Threads (by name) with their on-CPU and off-CPU ms, busiest first.
    pub threads: Vec<ThreadTime>,
    /// Detector findings in this slot.
    pub findings: Vec<Finding>,
    /// "slow" or "fast" by the phase probe (`--phase-probe`), else absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<&'static str>,
    /// The kernel's memory pressure (PSI) over the slot: the system's, and
    /// the target's cgroup's (cgroup v2), when the kernel has PSI.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_pressure: Option<crate::kernel::psi::SlotPressure>,
    /// The flamegraph SVGs are not on disk: `slotprof run`'s server draws
    /// them from the `.folded` files when asked (slots without findings).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub flamegraphs_on_request: bool,
}

#[derive(Debug, Serialize)]
pub struct ThreadTime {
    pub thread: String,
    pub oncpu_ms: f64,
    pub offcpu_ms: f64,
}

/// Sums a folded profile by its root frame (the thread name).
fn by_thread(f: &Folded) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for (stack, v) in f.iter() {
        let root = stack.split(';').next().unwrap_or(stack);
        *m.entry(root.to_string()).or_default() += v;
    }
    m
}

pub(crate) fn summarize(r: &SlotResult<'_>) -> SlotSummary {
    let (slot, p, findings, period_ns) = (r.slot, r.profiles, r.findings, r.period_ns);
    let on = by_thread(&p.oncpu);
    let off = by_thread(&p.offcpu);
    let mut threads: Vec<ThreadTime> = on
        .keys()
        .chain(off.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|t| ThreadTime {
            thread: t.clone(),
            oncpu_ms: on.get(t).copied().unwrap_or(0) as f64 * period_ns as f64 / 1e6,
            offcpu_ms: off.get(t).copied().unwrap_or(0) as f64 / 1e6,
        })
        .collect();
    threads.sort_by(|a, b| {
        b.oncpu_ms
            .total_cmp(&a.oncpu_ms)
            .then(b.offcpu_ms.total_cmp(&a.offcpu_ms))
    });
    SlotSummary {
        slot: slot.clone(),
        duration_ms: slot.duration_ns() as f64 / 1e6,
        oncpu_samples: p.oncpu.total(),
        oncpu_ms: p.oncpu.total() as f64 * period_ns as f64 / 1e6,
        offcpu_ms: p.offcpu.total() as f64 / 1e6,
        threads,
        findings: findings
            .iter()
            .filter(|f| f.slot == Some(slot.number))
            .cloned()
            .collect(),
        phase: r.phase,
        memory_pressure: r.memory_pressure,
        flamegraphs_on_request: false,
    }
}

/// Writes `slots/`, `windows/` and `index.html` under `out`, a slot at a
/// time (in timeline order): a leader window is written as soon as its
/// last slot is, and only the slot summaries stay.
pub struct SlotWriter<'a> {
    out: &'a Path,
    /// The session's findings, for the index.
    findings: &'a [Finding],
    summaries: Vec<SlotSummary>,
    /// The window being filled: its first slot, its slots, their profiles
    /// with their labels.
    window: Option<(u64, Vec<Slot>, WindowSlots)>,
}

impl<'a> SlotWriter<'a> {
    pub fn new(out: &'a Path, findings: &'a [Finding]) -> Self {
        Self {
            out,
            findings,
            summaries: Vec::new(),
            window: None,
        }
    }

    fn flush_window(&mut self, meta: &ProfileMeta) -> anyhow::Result<()> {
        let Some((first, slots, each)) = self.window.take() else {
            return Ok(());
        };
        let dir = self.out.join("windows").join(first.to_string());
        let numbers: Vec<u64> = slots.iter().map(|s| s.number).collect();
        let p = merged(each.iter().map(|(p, _)| p));
        write_profiles(
            &dir,
            &p,
            Parts::Window(&each),
            meta,
            &format!("leader window {numbers:?}"),
        )?;
        let window = window_json(first, &slots, &p);
        write_atomic(&dir.join("window.json"), &serde_json::to_vec_pretty(&window)?)
    }

    /// The slot summaries written so far.
    pub fn into_summaries(self) -> Vec<SlotSummary> {
        self.summaries
    }
}

impl SlotExport for SlotWriter<'_> {
    /// Writes one slot's directory (and the window before it, if this slot
    /// starts another).
    fn slot(&mut self, r: &SlotResult<'_>) -> anyhow::Result<()> {
        let (slot, p) = (r.slot, r.profiles);
        let dir = self.out.join("slots").join(slot.number.to_string());
        let sub = format!(
            "slot {}{}",
            slot.number,
            if slot.leader { " (leader)" } else { "" }
        );
        let labels = SlotLabels::of(slot, r.phase);
        write_profiles(&dir, p, Parts::Slot(&labels), r.meta, &sub)?;
        let summary = summarize(r);
        write_atomic(&dir.join("slot.json"), &serde_json::to_vec_pretty(&summary)?)?;
        self.summaries.push(summary);
        if self
            .window
            .as_ref()
            .is_some_and(|(w, _, _)| Some(*w) != slot.window)
        {
            self.flush_window(r.meta)?;
        }
        if let Some(w) = slot.window {
            let entry = self.window.get_or_insert_with(|| (w, Vec::new(), Vec::new()));
            entry.1.push(slot.clone());
            entry.2.push((p.clone(), labels));
        }
        Ok(())
    }

    /// The last window and `index.html`.
    fn finish(&mut self, meta: &ProfileMeta) -> anyhow::Result<()> {
        self.flush_window(meta)?;
        write_atomic(
            &self.out.join("index.html"),
            index_html(&self.summaries, self.findings).as_bytes(),
        )
    }
}

/// The sum of slots' profiles (a window's).
pub(crate) fn merged<'a>(each: impl Iterator<Item = &'a Profiles>) -> Profiles {
    let mut p = Profiles::default();
    for e in each {
        p.merge(e);
    }
    p
}

/// What `window.json` says about a leader window.
pub(crate) fn window_json<S: std::borrow::Borrow<Slot>>(
    first: u64,
    slots: &[S],
    p: &Profiles,
) -> serde_json::Value {
    let numbers: Vec<u64> = slots.iter().map(|s| s.borrow().number).collect();
    json!({
        "first_slot": first,
        "slots": numbers,
        "start_ns": slots.first().map(|s| s.borrow().start_ns),
        "end_ns": slots.last().map(|s| s.borrow().end_ns),
        "oncpu_samples": p.oncpu.total(),
        "offcpu_ms": p.offcpu.total() as f64 / 1e6,
    })
}

/// The Chrome trace-event file: a track per thread with on-CPU samples
/// (instants) and off-CPU spans, each with the pprof profiles' labels as
/// args (thread name and id, CPU, slot, leader, phase at `phase_at`), and
/// tracks for slots and leader windows.
/// Written event by event: a busy node's session has hundreds of
/// thousands of intervals, and a whole JSON tree of them took a gigabyte.
pub fn write_trace(
    w: &mut impl std::io::Write,
    pid: u32,
    process: &str,
    timeline: &Timeline,
    agg: &crate::pipeline::aggregate::Aggregator,
    phase_at: &dyn Fn(u64) -> Option<&'static str>,
) -> std::io::Result<()> {
    let (samples, cpus, intervals) = (agg.samples(), agg.sample_cpus(), agg.intervals());
    let us = |ns: u64| ns as f64 / 1e3;
    // The labels the pprof profiles have, as an event's args: its thread,
    // and the slot (number, leader flag, phase) it started in.
    let args = |ts: u64, k: &StackKey| {
        let mut a = json!({
            "thread_name": crate::kernel::events::comm_str(&k.comm),
            "thread_id": k.tid,
        });
        if let Some(s) = timeline.slot_at(ts).map(|i| &timeline.slots()[i]) {
            a["slot"] = json!(s.number);
            a["leader"] = json!(s.leader);
        }
        if let Some(p) = phase_at(ts) {
            a["phase"] = json!(p);
        }
        a
    };
    // Pseudo-threads for the slot tracks, far from real tids.
    const SLOTS_TID: u64 = u32::MAX as u64 + 1;
    const WINDOWS_TID: u64 = SLOTS_TID + 1;
    w.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
    let mut first = true;
    let mut event = |w: &mut dyn std::io::Write, e: serde_json::Value| -> std::io::Result<()> {
        if !first {
            w.write_all(b",\n")?;
        }
        first = false;
        serde_json::to_writer(&mut *w, &e).map_err(std::io::Error::other)
    };
    event(
        w,
        json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}),
    )?;
    event(
        w,
        json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": SLOTS_TID, "args": {"name": "slots"}}),
    )?;
    event(
        w,
        json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": WINDOWS_TID, "args": {"name": "leader windows"}}),
    )?;
    event(
        w,
        json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": SLOTS_TID, "args": {"sort_index": -2}}),
    )?;
    event(
        w,
        json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": WINDOWS_TID, "args": {"sort_index": -1}}),
    )?;
    // A thread's name is the last one it had: threads name themselves
    // after they start.
    let mut named: BTreeMap<u32, (u64, [u8; profiler_ebpf::COMM_LEN])> = BTreeMap::new();
    let mut name = |tid: u32, ts: u64, comm: [u8; profiler_ebpf::COMM_LEN]| {
        let e = named.entry(tid).or_insert((ts, comm));
        if ts >= e.0 {
            *e = (ts, comm);
        }
    };
    for (ts, k) in samples {
        name(k.tid, *ts, k.comm);
    }
    intervals.for_each(|i| name(i.key.tid, i.end_ns, i.key.comm))?;
    for (tid, (_, comm)) in &named {
        let comm = crate::kernel::events::comm_str(comm);
        event(
            w,
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": format!("{comm} ({tid})")}}),
        )?;
    }
    for s in timeline.slots() {
        let name = format!("slot {}{}", s.number, if s.leader { " (leader)" } else { "" });
        event(
            w,
            json!({"ph": "X", "name": name, "cat": "slot", "pid": pid, "tid": SLOTS_TID,
            "ts": us(s.start_ns), "dur": us(s.duration_ns()),
            "args": {"slot": s.number, "leader": s.leader, "aligned": s.aligned}}),
        )?;
    }
    let mut windows: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for s in timeline.slots() {
        if let Some(win) = s.window {
            let e = windows.entry(win).or_insert((s.start_ns, s.end_ns));
            e.0 = e.0.min(s.start_ns);
            e.1 = e.1.max(s.end_ns);
        }
    }
    for (win, (start, end)) in windows {
        event(
            w,
            json!({"ph": "X", "name": format!("leader window {win}"), "cat": "window", "pid": pid,
            "tid": WINDOWS_TID, "ts": us(start), "dur": us(end - start)}),
        )?;
    }
    let mut written = Ok(());
    intervals.for_each(|i| {
        if written.is_err() {
            return;
        }
        let name = match (i.folded, i.preempted) {
            // The thread ran between these waits: the slice is their
            // span, its args their count and time.
            (Some(_), _) => "off-CPU (short waits, folded)",
            (None, true) => "off-CPU (waiting for a CPU)",
            (None, false) => "off-CPU (blocked)",
        };
        let dur = us(i.end_ns.saturating_sub(i.start_ns));
        let mut a = args(i.start_ns, &i.key);
        if let Some(f) = i.folded {
            a["waits"] = json!(f.intervals);
            a["offcpu_ms"] = json!(f.offcpu_ns as f64 / 1e6);
        }
        written = event(
            w,
            json!({"ph": "X", "name": name, "cat": "offcpu", "pid": pid, "tid": i.key.tid,
            "ts": us(i.start_ns), "dur": dur, "args": a}),
        );
    })?;
    written?;
    for (n, (ts, k)) in samples.iter().enumerate() {
        let mut a = args(*ts, k);
        if let Some(cpu) = cpus.get(n) {
            a["cpu"] = json!(cpu);
        }
        event(
            w,
            json!({"ph": "i", "s": "t", "name": "on-CPU sample", "cat": "oncpu", "pid": pid,
            "tid": k.tid, "ts": us(*ts), "args": a}),
        )?;
    }
    w.write_all(b"]}\n")
}

/// Text made safe to put in HTML (element content and quoted attributes).
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A slot summary's bar on the timeline.
pub fn bar(s: &SlotSummary) -> super::timeline_page::Bar {
    let findings: Vec<&Finding> = s.findings.iter().collect();
    let busiest = s.threads.iter().map(|t| t.oncpu_ms).fold(0.0, f64::max);
    let mut b = super::timeline_page::Bar::new(&s.slot, busiest, &findings);
    b.phase = s.phase.map(str::to_string);
    b
}

/// One static, offline page: the slot timeline, then a sortable table of
/// slots with links to each slot's flamegraphs.
pub fn index_html<'a>(slots: impl IntoIterator<Item = &'a SlotSummary>, findings: &[Finding]) -> String {
    let mut count = 0;
    let mut bars = Vec::new();
    let mut found = String::new();
    for f in findings {
        let _ = writeln!(
            found,
            "<tr><td>{kind}</td><td>{slot}</td><td>{thread}</td><td>{dur:.1}</td><td class=\"text\">{expl}</td></tr>",
            kind = f.kind,
            slot = f.slot.map(|s| format!("<a href=\"slots/{s}/slot.json\">{s}</a>")).unwrap_or_default(),
            thread = escape(&f.thread),
            dur = f.duration_ns as f64 / 1e6,
            expl = escape(&f.explanation),
        );
    }
    let mut rows = String::new();
    let mut on_request = 0;
    for s in slots {
        count += 1;
        bars.push(bar(s));
        let top: Vec<String> = s
            .threads
            .iter()
            .take(3)
            .map(|t| format!("{} {:.0}/{:.0}", escape(&t.thread), t.oncpu_ms, t.offcpu_ms))
            .collect();
        let n = s.slot.number;
        let _ = writeln!(
            rows,
            "<tr{cls}><td>{n}</td><td>{leader}</td><td>{dur:.1}</td><td>{on:.1}</td><td>{off:.1}</td>\
             <td>{top}</td><td>{findings}</td>\
             <td><a href=\"slots/{n}/oncpu.svg\">on-CPU</a> <a href=\"slots/{n}/offcpu.svg\">off-CPU</a>{drawn} \
             <a href=\"slots/{n}/slot.json\">json</a></td></tr>",
            cls = if s.slot.aligned {
                ""
            } else {
                " class=\"unaligned\""
            },
            leader = if s.slot.leader { "leader" } else { "" },
            dur = s.duration_ms,
            on = s.oncpu_ms,
            off = s.offcpu_ms,
            top = top.join("<br>"),
            findings = s.findings.len(),
            drawn = if s.flamegraphs_on_request {
                on_request += 1;
                "<sup title=\"drawn by slotprof's server when opened from it\">*</sup>"
            } else {
                ""
            },
        );
    }
    let on_request = if on_request > 0 {
        "<p>* Flamegraphs drawn on request: open this page from slotprof's own server (the address in \
         <code>metrics.listen</code>; http://127.0.0.1:10440/ as shipped), which draws them from the slot's \
         <code>.folded</code> files; on disk, open those in speedscope or <code>inferno-flamegraph</code>.</p>"
    } else {
        ""
    };
    format!(
        r##"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slotprof: slots</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; vertical-align: top; }}
td:nth-child(6), td.text {{ text-align: left; font-size: 90%; }}
th {{ cursor: pointer; background: #eee; }}
tr.unaligned {{ color: #999; }}
{style}</style></head>
<body>
<h1>slotprof: {count} slots</h1>
{timeline}
<p>Click a column to sort. Times in ms. Top threads: name on-CPU/off-CPU ms. Grey rows: slot boundaries guessed, not from the slot source.</p>
{on_request}
<h2>Findings ({nfindings})</h2>
<table id="findings"><thead><tr><th>kind</th><th>slot</th><th>thread</th><th>ms</th><th>what happened</th></tr></thead>
<tbody>
{found}</tbody></table>
<h2>Slots</h2>
<table id="slots"><thead><tr><th>slot</th><th>leader</th><th>duration</th><th>on-CPU</th><th>off-CPU</th><th>top threads</th><th>findings</th><th>flamegraphs</th></tr></thead>
<tbody>
{rows}</tbody></table>
<script>
document.querySelectorAll("#slots th").forEach(function (th, col) {{
  th.addEventListener("click", function () {{
    var body = document.querySelector("#slots tbody");
    var rows = Array.prototype.slice.call(body.rows);
    var asc = th.dataset.asc !== "1";
    th.dataset.asc = asc ? "1" : "0";
    rows.sort(function (a, b) {{
      var x = a.cells[col].textContent, y = b.cells[col].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return asc ? c : -c;
    }});
    rows.forEach(function (r) {{ body.appendChild(r); }});
  }});
}});
</script>
</body></html>
"##,
        count = count,
        nfindings = findings.len(),
        style = super::timeline_page::STYLE,
        timeline = super::timeline_page::section("timeline", &bars, Some("slots/")),
    )
}
