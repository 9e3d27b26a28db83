//! The Prometheus endpoint of `slotprof run`: text exposition format 0.0.4
//! on hyper's HTTP/1.1 server. GET /metrics; GET / is the export's
//! index.html, and every file of the export it links to is served
//! read-only (`/slots/N/oncpu.svg`, ...: [`super::served`]). Loopback
//! unless the configuration says otherwise.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;

use super::served::{export_file, reply};

/// Upper bounds (seconds) of the slot-duration histogram: around the 400 ms
/// slot (going down to 250 ms), with room for slow ones.
pub const SLOT_BUCKETS: [f64; 10] = [0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.8, 1.0, 2.0];

/// A cumulative histogram in Prometheus' sense.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    /// Observations at or below each bound (not cumulative; summed on render).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

/// The metrics' share of each finished slot: the findings placed in it by
/// kind, and its length.
pub struct SlotMetrics<'a>(pub &'a std::sync::Mutex<Snapshot>);

impl super::SlotExport for SlotMetrics<'_> {
    fn slot(&mut self, r: &super::SlotResult<'_>) -> anyhow::Result<()> {
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for f in r.findings.iter().filter(|f| f.slot == Some(r.slot.number)) {
            *s.findings.entry(f.kind.to_string()).or_default() += 1;
        }
        s.slot_durations.observe(r.slot.duration_ns() as f64 / 1e9);
        Ok(())
    }

    fn finish(&mut self, _: &flamegraphs::pprof::ProfileMeta) -> anyhow::Result<()> {
        Ok(())
    }
}

impl Snapshot {
    /// The always-on exporter's counts.
    pub fn exported(&mut self, e: &super::always_on::Exporter) {
        self.slots_exported = e.slots_exported;
        self.slots_summarised = e.slots_summarised;
        self.slots_skipped = e.skipped_low_space;
        self.slots_failed = e.slots_failed;
        self.export_write_errors = e.write_errors;
        self.export_bytes = e.bytes();
        if let Some((slot, unix_s)) = e.last_exported {
            self.last_exported_slot = Some(slot);
            self.last_export_unix_s = Some(unix_s);
        }
    }
}

/// What /metrics shows; the run loop updates it.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Findings so far, by kind.
    pub findings: BTreeMap<String, u64>,
    /// Events lost so far, by cause (ring_buffer_full, stacks, ...).
    pub lost: BTreeMap<String, u64>,
    /// cpu-clock samples of the target.
    pub samples: u64,
    pub slot_durations: Histogram,
    /// Slots exported in full, and summarised in one line.
    pub slots_exported: u64,
    pub slots_summarised: u64,
    /// Slots not written: the export file system was below its floor.
    pub slots_skipped: u64,
    /// Slots whose write failed, and every failed write of the export.
    pub slots_failed: u64,
    pub export_write_errors: u64,
    /// Bytes the export holds now.
    pub export_bytes: u64,
    /// Stacks emptied from the kernel's stack maps as they took turns
    /// (mostly those of off-CPU intervals too short to be reported).
    pub stacks_emptied: u64,
    /// User stacks unwound so far, by how they ended (complete,
    /// truncated, stack_copy_ended, no_unwind_info, unwind_error).
    pub user_stacks: BTreeMap<&'static str, u64>,
    /// Bytes of unwind tables (.eh_frame etc.) held for the target's modules.
    pub unwind_table_bytes: u64,
    /// Times the symbol tables were released after going unused.
    pub symbol_releases: u64,
    /// The probes are attached to a live target now.
    pub target_attached: bool,
    /// The slot source in use (`rpc`, `uprobe`, `clock`) and whether it
    /// gives slots now (the RPC answering; a uprobe or the clock always).
    pub slot_source: &'static str,
    pub slot_source_healthy: bool,
    /// Nothing is written: the export's file system is below its floor.
    pub export_paused: bool,
    /// The last slot written (in full or as its summary line), and when
    /// (seconds since the Unix epoch).
    pub last_exported_slot: Option<u64>,
    pub last_export_unix_s: Option<f64>,
    /// The push endpoints' counts (`[push]`), read as they are.
    pub push: Vec<std::sync::Arc<super::push::Stats>>,
}

impl Default for Snapshot {
    fn default() -> Self {
        Self {
            findings: BTreeMap::new(),
            lost: BTreeMap::new(),
            samples: 0,
            slot_durations: Histogram::new(&SLOT_BUCKETS),
            slots_exported: 0,
            slots_summarised: 0,
            slots_skipped: 0,
            slots_failed: 0,
            export_write_errors: 0,
            export_bytes: 0,
            stacks_emptied: 0,
            user_stacks: BTreeMap::new(),
            unwind_table_bytes: 0,
            symbol_releases: 0,
            target_attached: false,
            slot_source: "clock",
            slot_source_healthy: false,
            export_paused: false,
            last_exported_slot: None,
            last_export_unix_s: None,
            push: Vec::new(),
        }
    }
}

/// slotprof's own process, as Prometheus's standard `process_*`
/// metrics name it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Process {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    /// Seconds since the Unix epoch.
    pub start_time_seconds: f64,
    pub open_fds: u64,
    pub max_fds: u64,
}

/// Reads [`Process`] from /proc/self.
pub fn own_process() -> Process {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at ") ";
    // field N of proc(5) is index N - 3 here.
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let (ticks, page) = crate::sys::clock_ticks_and_page_size();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    let max_fds = crate::sys::nofile_limit();
    Process {
        cpu_seconds: (field(14) + field(15)) as f64 / ticks,
        resident_bytes: field(24) * page,
        virtual_bytes: field(23),
        start_time_seconds: boot as f64 + field(22) as f64 / ticks,
        open_fds: std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64),
        max_fds,
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Renders the text exposition format.
pub fn render(s: &Snapshot, own: &Process) -> String {
    let mut out = String::new();
    counters(&mut out, s);
    push(&mut out, s);
    gauges(&mut out, s);
    process(&mut out, own);
    out
}

/// One metric: its HELP and TYPE lines, then its samples.
fn section(out: &mut String, name: &str, kind: &str, help: &str, lines: Vec<String>) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for l in lines {
        let _ = writeln!(out, "{l}");
    }
}

/// What slotprof found, sampled, lost and exported so far.
fn counters(out: &mut String, s: &Snapshot) {
    section(
        out,
        "slotprof_findings_total",
        "counter",
        "Findings so far, by kind.",
        s.findings
            .iter()
            .map(|(k, n)| format!("slotprof_findings_total{{kind=\"{}\"}} {n}", escape(k)))
            .collect(),
    );
    section(
        out,
        "slotprof_lost_events_total",
        "counter",
        "Events that did not reach slotprof whole, by cause.",
        s.lost
            .iter()
            .map(|(c, n)| format!("slotprof_lost_events_total{{cause=\"{}\"}} {n}", escape(c)))
            .collect(),
    );
    section(
        out,
        "slotprof_samples_total",
        "counter",
        "cpu-clock samples of the target.",
        vec![format!("slotprof_samples_total {}", s.samples)],
    );
    let h = &s.slot_durations;
    let mut lines = Vec::new();
    let mut cumulative = 0;
    for (b, c) in h.bounds.iter().zip(&h.counts) {
        cumulative += c;
        lines.push(format!(
            "slotprof_slot_duration_seconds_bucket{{le=\"{b}\"}} {cumulative}"
        ));
    }
    lines.push(format!(
        "slotprof_slot_duration_seconds_bucket{{le=\"+Inf\"}} {}",
        h.count
    ));
    lines.push(format!("slotprof_slot_duration_seconds_sum {}", h.sum));
    lines.push(format!("slotprof_slot_duration_seconds_count {}", h.count));
    section(
        out,
        "slotprof_slot_duration_seconds",
        "histogram",
        "Slot lengths as the slot source saw them.",
        lines,
    );
    section(
        out,
        "slotprof_slots_exported_total",
        "counter",
        "Slots exported in full, or as one summary line.",
        vec![
            format!(
                "slotprof_slots_exported_total{{mode=\"full\"}} {}",
                s.slots_exported
            ),
            format!(
                "slotprof_slots_exported_total{{mode=\"summary\"}} {}",
                s.slots_summarised
            ),
        ],
    );
    section(
        out,
        "slotprof_slots_not_exported_total",
        "counter",
        "Slots not exported: the export file system below its free-space floor, or the slot's write failed.",
        vec![
            format!(
                "slotprof_slots_not_exported_total{{reason=\"low_space\"}} {}",
                s.slots_skipped
            ),
            format!(
                "slotprof_slots_not_exported_total{{reason=\"write_failed\"}} {}",
                s.slots_failed
            ),
        ],
    );
    section(
        out,
        "slotprof_export_write_errors_total",
        "counter",
        "Writes of the export that failed (slots, windows, the hour's profiles, the index); slotprof goes on.",
        vec![format!("slotprof_export_write_errors_total {}", s.export_write_errors)],
    );
    section(
        out,
        "slotprof_export_bytes",
        "gauge",
        "Bytes the export directory holds.",
        vec![format!("slotprof_export_bytes {}", s.export_bytes)],
    );
    section(
        out,
        "slotprof_stacks_emptied_total",
        "counter",
        "Stacks emptied from the kernel's stack maps as they took turns (each map is emptied every other slot).",
        vec![format!("slotprof_stacks_emptied_total {}", s.stacks_emptied)],
    );
    section(
        out,
        "slotprof_user_stacks_total",
        "counter",
        "User stacks unwound (from copies, with the modules' CFI), by how they ended: complete (the thread's first frame), truncated (128 frames), stack_copy_ended, no_unwind_info, unwind_error.",
        s.user_stacks
            .iter()
            .map(|(e, n)| format!("slotprof_user_stacks_total{{end=\"{}\"}} {n}", escape(e)))
            .collect(),
    );
}

/// The state an alert reads: tables held, the build, attached, healthy,
/// paused, the last export.
/// The push endpoints': batches by how they ended, failed attempts, the
/// queue (absent when nothing is pushed).
fn push(out: &mut String, s: &Snapshot) {
    use std::sync::atomic::Ordering::Relaxed;
    if s.push.is_empty() {
        return;
    }
    let each = |f: &dyn Fn(&super::push::Stats) -> String| s.push.iter().map(|p| f(p)).collect::<Vec<_>>();
    let label = |p: &super::push::Stats| format!("endpoint=\"{}\",url=\"{}\"", p.endpoint, escape(&p.url));
    let mut batches = Vec::new();
    for p in &s.push {
        for (result, n) in [
            ("pushed", &p.pushed),
            ("dropped", &p.dropped),
            ("rejected", &p.rejected),
        ] {
            batches.push(format!(
                "slotprof_push_batches_total{{{},result=\"{result}\"}} {}",
                label(p),
                n.load(Relaxed)
            ));
        }
    }
    section(
        out,
        "slotprof_push_batches_total",
        "counter",
        "Batches of slot profiles pushed (taken by the receiver), dropped (the queue full, or still queued at exit) or rejected (refused by the receiver as malformed).",
        batches,
    );
    section(
        out,
        "slotprof_push_failed_attempts_total",
        "counter",
        "Push requests that failed (no connection, timeout, 5xx, 408, 429) and were retried with backoff.",
        each(&|p| {
            format!(
                "slotprof_push_failed_attempts_total{{{}}} {}",
                label(p),
                p.failed.load(Relaxed)
            )
        }),
    );
    section(
        out,
        "slotprof_push_encode_seconds_total",
        "counter",
        "Time spent encoding batches for this endpoint (on the profiling side: what pushing costs it).",
        each(&|p| {
            format!(
                "slotprof_push_encode_seconds_total{{{}}} {}",
                label(p),
                p.encode_ns.load(Relaxed) as f64 / 1e9
            )
        }),
    );
    section(
        out,
        "slotprof_push_queue_bytes",
        "gauge",
        "Bytes of batches waiting to be pushed.",
        each(&|p| {
            format!(
                "slotprof_push_queue_bytes{{{}}} {}",
                label(p),
                p.queued_bytes.load(Relaxed)
            )
        }),
    );
    section(
        out,
        "slotprof_push_queue_limit_bytes",
        "gauge",
        "The queue's bound (push.queue): past it the oldest batch is dropped.",
        each(&|p| format!("slotprof_push_queue_limit_bytes{{{}}} {}", label(p), p.limit)),
    );
    section(
        out,
        "slotprof_push_last_success_timestamp_seconds",
        "gauge",
        "When a batch was last taken by the receiver (Unix time; 0: never).",
        each(&|p| {
            format!(
                "slotprof_push_last_success_timestamp_seconds{{{}}} {}",
                label(p),
                p.last_pushed_unix_ms.load(Relaxed) as f64 / 1e3
            )
        }),
    );
}

fn gauges(out: &mut String, s: &Snapshot) {
    section(
        out,
        "slotprof_unwind_table_bytes",
        "gauge",
        "Bytes of unwind tables (.eh_frame, .debug_frame) held for the target's modules.",
        vec![format!("slotprof_unwind_table_bytes {}", s.unwind_table_bytes)],
    );
    section(
        out,
        "slotprof_symbol_table_releases_total",
        "counter",
        "Times the parsed symbol tables (debug info, kernel symbols) were released after a minute unused; a lookup after that parses them again.",
        vec![format!("slotprof_symbol_table_releases_total {}", s.symbol_releases)],
    );
    section(
        out,
        "slotprof_build_info",
        "gauge",
        "slotprof's version (always 1).",
        vec![format!(
            "slotprof_build_info{{version=\"{}\"}} 1",
            escape(env!("CARGO_PKG_VERSION"))
        )],
    );
    let flag = |b: bool| u8::from(b);
    section(
        out,
        "slotprof_target_attached",
        "gauge",
        "1 while the probes are attached to a live target; 0 while slotprof waits for it.",
        vec![format!("slotprof_target_attached {}", flag(s.target_attached))],
    );
    section(
        out,
        "slotprof_slot_source_healthy",
        "gauge",
        "1 while the slot source gives slots (the RPC answering), by source.",
        vec![format!(
            "slotprof_slot_source_healthy{{source=\"{}\"}} {}",
            escape(s.slot_source),
            flag(s.slot_source_healthy)
        )],
    );
    section(
        out,
        "slotprof_export_paused",
        "gauge",
        "1 while nothing is written: the export's file system is below its free-space floor.",
        vec![format!("slotprof_export_paused {}", flag(s.export_paused))],
    );
    if let (Some(slot), Some(at)) = (s.last_exported_slot, s.last_export_unix_s) {
        section(
            out,
            "slotprof_last_exported_slot",
            "gauge",
            "The last slot written to the export (in full or as its summary line).",
            vec![format!("slotprof_last_exported_slot {slot}")],
        );
        section(
            out,
            "slotprof_last_export_timestamp_seconds",
            "gauge",
            "When the last slot was written (Unix time); alert on time() minus this.",
            vec![format!("slotprof_last_export_timestamp_seconds {at:.3}")],
        );
    }
}

/// The standard process metrics and slotprof's heap.
fn process(out: &mut String, own: &Process) {
    // The standard process metrics, unprefixed, as every Prometheus client
    // library names them.
    for (name, kind, help, value) in [
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            format!("{}", own.cpu_seconds),
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            own.resident_bytes.to_string(),
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            own.virtual_bytes.to_string(),
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            format!("{:.2}", own.start_time_seconds),
        ),
        (
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            own.open_fds.to_string(),
        ),
        (
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            own.max_fds.to_string(),
        ),
    ] {
        section(out, name, kind, help, vec![format!("{name} {value}")]);
    }
    if let Some((in_use, free)) = heap_bytes() {
        section(
            out,
            "slotprof_heap_bytes",
            "gauge",
            "slotprof's malloc heap: bytes in use, and bytes free but still held (fragmentation).",
            vec![
                format!("slotprof_heap_bytes{{state=\"in_use\"}} {in_use}"),
                format!("slotprof_heap_bytes{{state=\"free\"}} {free}"),
            ],
        );
    }
}

/// glibc's heap: (bytes in use, bytes free but held), all arenas.
fn heap_bytes() -> Option<(u64, u64)> {
    crate::sys::heap_bytes()
}

/// Connections served at once; one more is closed as soon as it is
/// accepted (a scraper needs one; idle clients must not take the
/// descriptors the profiling itself needs).
pub const MAX_CONNECTIONS: usize = 32;
/// A request's head must arrive within this.
const HEAD_TIMEOUT: Duration = Duration::from_secs(3);
/// A connection lasts at most this long (one request each).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// [`serve`] on a thread of its own ([`crate::background`]): /metrics
/// answers while the session's loop is busy.
pub fn serve_in_background(
    listener: TcpListener,
    state: Arc<Mutex<Snapshot>>,
    export_dir: PathBuf,
) -> std::io::Result<crate::background::Background> {
    let listener = listener.into_std()?;
    crate::background::Background::spawn("slotprof-http", move || async move {
        if let Ok(listener) = TcpListener::from_std(listener) {
            serve(listener, state, export_dir).await;
        }
    })
}

/// Serves /metrics, / and the export's files (under `export_dir`) until the
/// task is dropped.
pub async fn serve(listener: TcpListener, state: Arc<Mutex<Snapshot>>, export_dir: PathBuf) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let export_dir = Arc::new(export_dir);
    loop {
        let conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            // Out of descriptors (or another transient failure): the
            // listener stays readable, so wait instead of spinning.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(conn);
            continue;
        };
        let (state, export_dir) = (state.clone(), export_dir.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| {
                let answer = answer(&req, &state, &export_dir);
                async move { Ok::<_, std::convert::Infallible>(answer) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(conn), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
        });
    }
}

/// The answer to one request.
fn answer<B>(req: &Request<B>, state: &Mutex<Snapshot>, export_dir: &Path) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only: this server is read-only\n",
        );
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("GET, HEAD"),
        );
        return r;
    }
    match req.uri().path() {
        "/metrics" => {
            let snapshot = state.lock().unwrap().clone();
            reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                render(&snapshot, &own_process()),
            )
        }
        "/" => export_file(export_dir, "index.html"),
        path => export_file(export_dir, path),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    fn snapshot() -> Snapshot {
        let mut s = Snapshot::default();
        s.findings.insert("MainLoopGap".into(), 3);
        s.findings.insert("SyncAllocatorPurge".into(), 1);
        s.lost.insert("ring_buffer_full".into(), 0);
        s.lost.insert("stacks".into(), 2);
        s.samples = 12345;
        for v in [0.4, 0.41, 0.39, 0.9, 3.0] {
            s.slot_durations.observe(v);
        }
        s.slots_exported = 4;
        s.slots_summarised = 96;
        s.user_stacks.insert("complete", 990);
        s.user_stacks.insert("truncated", 10);
        s.unwind_table_bytes = 4096;
        s
    }

    fn parse(text: &str) -> prometheus_parse::Scrape {
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("valid exposition")
    }

    fn value(scrape: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
        let s = scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
            .unwrap_or_else(|| panic!("{name} {label:?} missing"));
        match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(h) => h.iter().map(|b| b.count).fold(0.0, f64::max),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn renders_what_a_real_parser_reads_back() {
        let mut snap = snapshot();
        snap.target_attached = true;
        snap.slot_source = "rpc";
        snap.last_exported_slot = Some(1234);
        snap.last_export_unix_s = Some(1.7e9);
        let pushed = std::sync::Arc::new(super::super::push::Stats::new(
            "otlp",
            "http://h:4318/v1development/profiles".into(),
            1 << 20,
        ));
        pushed.pushed.store(3, std::sync::atomic::Ordering::Relaxed);
        pushed
            .queued_bytes
            .store(4096, std::sync::atomic::Ordering::Relaxed);
        snap.push = vec![pushed];
        let own = Process {
            cpu_seconds: 1.5,
            resident_bytes: 64 << 20,
            ..own_process()
        };
        let text = render(&snap, &own);
        let scrape = parse(&text);
        assert_eq!(
            value(&scrape, "slotprof_findings_total", Some(("kind", "MainLoopGap"))),
            3.0
        );
        assert_eq!(
            value(&scrape, "slotprof_lost_events_total", Some(("cause", "stacks"))),
            2.0
        );
        assert_eq!(value(&scrape, "slotprof_samples_total", None), 12345.0);
        assert_eq!(
            value(&scrape, "slotprof_user_stacks_total", Some(("end", "truncated"))),
            10.0
        );
        assert_eq!(value(&scrape, "slotprof_unwind_table_bytes", None), 4096.0);
        assert_eq!(
            value(&scrape, "slotprof_push_batches_total", Some(("result", "pushed"))),
            3.0
        );
        assert_eq!(
            value(&scrape, "slotprof_push_queue_bytes", Some(("endpoint", "otlp"))),
            4096.0
        );
        assert_eq!(
            value(&scrape, "process_resident_memory_bytes", None),
            (64 << 20) as f64
        );
        assert_eq!(value(&scrape, "process_cpu_seconds_total", None), 1.5);
        // The process's own figures, read from /proc/self: plausible.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value(&scrape, "process_start_time_seconds", None);
        assert!(
            started > now - 86_400.0 * 365.0 && started <= now + 1.0,
            "{started} vs now {now}"
        );
        let (open, max) = (
            value(&scrape, "process_open_fds", None),
            value(&scrape, "process_max_fds", None),
        );
        assert!(open >= 3.0 && max >= open, "{open} of {max}");
        assert!(value(&scrape, "process_virtual_memory_bytes", None) > 0.0);
        assert_eq!(
            value(
                &scrape,
                "slotprof_build_info",
                Some(("version", env!("CARGO_PKG_VERSION")))
            ),
            1.0
        );
        assert_eq!(value(&scrape, "slotprof_target_attached", None), 1.0);
        assert_eq!(
            value(&scrape, "slotprof_slot_source_healthy", Some(("source", "rpc"))),
            0.0
        );
        assert_eq!(value(&scrape, "slotprof_export_paused", None), 0.0);
        assert_eq!(value(&scrape, "slotprof_last_exported_slot", None), 1234.0);
        assert!(
            !text.contains("slotprof_process_"),
            "the process metrics are unprefixed"
        );
        assert_eq!(
            value(
                &scrape,
                "slotprof_slots_exported_total",
                Some(("mode", "summary"))
            ),
            96.0
        );
        // The histogram: 3 slots at <= 0.45 s, 4 at <= 1 s, 5 in all.
        let hist = scrape
            .samples
            .iter()
            .find_map(|s| match &s.value {
                prometheus_parse::Value::Histogram(h) if s.metric == "slotprof_slot_duration_seconds" => {
                    Some(h.clone())
                }
                _ => None,
            })
            .expect("histogram");
        let at = |le: f64| hist.iter().find(|b| b.less_than == le).unwrap().count;
        assert_eq!((at(0.45), at(1.0), at(f64::INFINITY)), (3.0, 4.0, 5.0));
        assert!(text.contains("slotprof_slot_duration_seconds_count 5"));
    }

    #[tokio::test]
    async fn serves_metrics_and_the_index_over_http() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let dir = std::env::temp_dir().join(format!("slotprof-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("index.html"), "<html>slots</html>").unwrap();
        let server = tokio::spawn(serve(listener, Arc::new(Mutex::new(snapshot())), dir.clone()));
        let get = |path: &'static str| async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).await.unwrap();
            out
        };
        let metrics = get("/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200 OK"));
        let body = metrics.split("\r\n\r\n").nth(1).unwrap();
        let scrape = parse(body);
        assert_eq!(
            value(
                &scrape,
                "slotprof_findings_total",
                Some(("kind", "SyncAllocatorPurge"))
            ),
            1.0
        );
        assert!(value(&scrape, "process_resident_memory_bytes", None) > 0.0);
        assert!(get("/").await.ends_with("<html>slots</html>"));
        assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
        // The files the index links to, read-only; nothing outside.
        std::fs::create_dir_all(dir.join("slots/7")).unwrap();
        std::fs::write(dir.join("slots/7/oncpu.svg"), "<svg/>").unwrap();
        std::fs::write(dir.join(".secret.tmp"), "temporary").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.join("slots/7/link.svg")).unwrap();
        // Case 9: a hard link to a file outside the export.
        let outside = std::env::temp_dir().join(format!("slotprof-metrics-outside-{}", std::process::id()));
        std::fs::write(&outside, "secret").unwrap();
        std::fs::hard_link(&outside, dir.join("slots/7/hard.svg")).unwrap();
        let svg = get("/slots/7/oncpu.svg").await;
        assert!(
            svg.starts_with("HTTP/1.1 200 OK") && svg.ends_with("<svg/>"),
            "{svg}"
        );
        assert!(
            svg.to_ascii_lowercase().contains("content-type: image/svg+xml"),
            "{svg}"
        );
        for bad in [
            "/../../etc/hostname",
            "/slots/%2e%2e/%2e%2e/etc/hostname",
            "/slots/7/link.svg",
            "/slots/7/hard.svg",
            "/.secret.tmp",
            "/slots/7",
            "/slots//7/oncpu.svg",
            "//etc/hostname",
        ] {
            let r = get(bad).await;
            assert!(
                r.starts_with("HTTP/1.1 404") || r.starts_with("HTTP/1.1 400"),
                "{bad}: {r}"
            );
        }
        // A slot `run` left undrawn: its flamegraph drawn from its .folded
        // when asked, and not kept.
        std::fs::create_dir_all(dir.join("slots/8")).unwrap();
        std::fs::write(
            dir.join("slots/8/oncpu.folded"),
            "solReplayStage;solana::replay 7\n",
        )
        .unwrap();
        let drawn = get("/slots/8/oncpu.svg").await;
        assert!(drawn.starts_with("HTTP/1.1 200 OK"), "{drawn}");
        assert!(
            drawn.contains("<svg") && drawn.contains("solana::replay") && drawn.contains("slot 8"),
            "{drawn}"
        );
        assert!(!dir.join("slots/8/oncpu.svg").exists());
        // No .folded, or one that is a link out of the export: nothing drawn.
        assert!(get("/slots/8/offcpu.svg").await.starts_with("HTTP/1.1 404"));
        std::os::unix::fs::symlink("/etc/hostname", dir.join("slots/7/offcpu.folded")).unwrap();
        let linked = get("/slots/7/offcpu.svg").await;
        assert!(linked.starts_with("HTTP/1.1 404"), "{linked}");
        // Not folded stacks: an error that says what to open instead.
        std::fs::write(dir.join("slots/8/offcpu.folded"), "no count here\n").unwrap();
        let bad = get("/slots/8/offcpu.svg").await;
        assert!(
            bad.starts_with("HTTP/1.1 500") && bad.contains("inferno-flamegraph"),
            "{bad}"
        );
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 405"), "{out}");
        // A request in pieces (as `write!` on a raw socket sends it) is
        // answered whole, not from its first segment (a CI failure: the
        // answer to "GET " closed the socket under the rest).
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        for piece in ["GET ", "/metrics", " HTTP/1.1\r\nHost: x\r\n", "\r\n"] {
            c.write_all(piece.as_bytes()).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        }
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        server.abort();
        std::fs::remove_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(&outside);
    }

    /// Accepted sockets the server holds open: this process's TCP
    /// sockets whose local port is the server's, other than the listener
    /// (other tests run in this process at the same time, so a count of
    /// all descriptors is not the server's).
    fn server_sockets(port: u16) -> usize {
        let ours: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .filter_map(|l| {
                l.to_str()?
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')
                    .map(str::to_string)
            })
            .collect();
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        table
            .lines()
            .skip(1)
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let local_port = f[1]
                    .rsplit_once(':')
                    .map(|(_, p)| u16::from_str_radix(p, 16).unwrap());
                local_port == Some(port) && f[3] != "0A" && ours.contains(f[9])
            })
            .count()
    }

    #[tokio::test]
    async fn eleven_hundred_idle_connections_hold_few_descriptors_and_scrapes_resume() {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit on a local struct.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        if lim.rlim_max < 4096 {
            eprintln!(
                "SKIPPED: the hard descriptor limit ({}) is below 4096",
                lim.rlim_max
            );
            return;
        }
        lim.rlim_cur = lim.rlim_cur.max(4096);
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(
            listener,
            Arc::new(Mutex::new(snapshot())),
            std::path::PathBuf::from("/nonexistent"),
        ));
        let mut idle = Vec::new();
        for _ in 0..1100 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let held_by_server = server_sockets(addr.port());
        assert!(
            (1..=MAX_CONNECTIONS).contains(&held_by_server),
            "the server holds {held_by_server} descriptors for 1,100 idle clients"
        );
        // The idle clients keep their sockets open; a scrape gets through once
        // the server has timed out the ones it took (3 s), and at once after.
        let scrape = || async {
            let mut c = tokio::net::TcpStream::connect(addr).await.ok()?;
            c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .ok()?;
            let mut out = String::new();
            c.read_to_string(&mut out).await.ok()?;
            out.starts_with("HTTP/1.1 200 OK").then_some(())
        };
        let began = std::time::Instant::now();
        while scrape().await.is_none() {
            assert!(
                began.elapsed() < std::time::Duration::from_secs(10),
                "no scrape answered in 10 s"
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        assert!(scrape().await.is_some());
        drop(idle);
        server.abort();
    }
}
