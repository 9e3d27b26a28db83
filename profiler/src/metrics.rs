//! The Prometheus endpoint of `slotprof run`: text exposition format 0.0.4
//! on a small HTTP server (GET /metrics; GET / serves the export's
//! index.html). Loopback unless the configuration says otherwise.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

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
        }
    }
}

/// slotprof's own CPU time (seconds) and resident memory (bytes).
pub fn own_usage() -> (f64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at ") ".
    let fields: Vec<&str> = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let field = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat, 11 and 12 after the name.
    let cpu = (field(11) + field(12)) / ticks;
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * page;
    (cpu, rss)
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Renders the text exposition format.
pub fn render(s: &Snapshot, own_cpu_s: f64, own_rss: u64) -> String {
    let mut out = String::new();
    let section = |out: &mut String, name: &str, kind: &str, help: &str, lines: Vec<String>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for l in lines {
            let _ = writeln!(out, "{l}");
        }
    };
    section(
        &mut out,
        "slotprof_findings_total",
        "counter",
        "Findings so far, by kind.",
        s.findings
            .iter()
            .map(|(k, n)| format!("slotprof_findings_total{{kind=\"{}\"}} {n}", escape(k)))
            .collect(),
    );
    section(
        &mut out,
        "slotprof_lost_events_total",
        "counter",
        "Events that did not reach slotprof whole, by cause.",
        s.lost
            .iter()
            .map(|(c, n)| format!("slotprof_lost_events_total{{cause=\"{}\"}} {n}", escape(c)))
            .collect(),
    );
    section(
        &mut out,
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
        &mut out,
        "slotprof_slot_duration_seconds",
        "histogram",
        "Slot lengths as the slot source saw them.",
        lines,
    );
    section(
        &mut out,
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
        &mut out,
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
        &mut out,
        "slotprof_export_write_errors_total",
        "counter",
        "Writes of the export that failed (slots, windows, the hour's profiles, the index); slotprof goes on.",
        vec![format!("slotprof_export_write_errors_total {}", s.export_write_errors)],
    );
    section(
        &mut out,
        "slotprof_export_bytes",
        "gauge",
        "Bytes the export directory holds.",
        vec![format!("slotprof_export_bytes {}", s.export_bytes)],
    );
    section(
        &mut out,
        "slotprof_stacks_emptied_total",
        "counter",
        "Stacks emptied from the kernel's stack maps as they took turns (each map is emptied every other slot).",
        vec![format!("slotprof_stacks_emptied_total {}", s.stacks_emptied)],
    );
    section(
        &mut out,
        "slotprof_user_stacks_total",
        "counter",
        "User stacks unwound (from copies, with the modules' CFI), by how they ended: complete (the thread's first frame), truncated (128 frames), stack_copy_ended, no_unwind_info, unwind_error.",
        s.user_stacks
            .iter()
            .map(|(e, n)| format!("slotprof_user_stacks_total{{end=\"{}\"}} {n}", escape(e)))
            .collect(),
    );
    section(
        &mut out,
        "slotprof_unwind_table_bytes",
        "gauge",
        "Bytes of unwind tables (.eh_frame, .debug_frame) held for the target's modules.",
        vec![format!("slotprof_unwind_table_bytes {}", s.unwind_table_bytes)],
    );
    section(
        &mut out,
        "slotprof_symbol_table_releases_total",
        "counter",
        "Times the parsed symbol tables (debug info, kernel symbols) were released after a minute unused; a lookup after that parses them again.",
        vec![format!("slotprof_symbol_table_releases_total {}", s.symbol_releases)],
    );
    section(
        &mut out,
        "slotprof_process_cpu_seconds_total",
        "counter",
        "slotprof's own CPU time (user + system).",
        vec![format!("slotprof_process_cpu_seconds_total {own_cpu_s}")],
    );
    section(
        &mut out,
        "slotprof_process_resident_memory_bytes",
        "gauge",
        "slotprof's own resident memory.",
        vec![format!("slotprof_process_resident_memory_bytes {own_rss}")],
    );
    if let Some((in_use, free)) = heap_bytes() {
        section(
            &mut out,
            "slotprof_heap_bytes",
            "gauge",
            "slotprof's malloc heap: bytes in use, and bytes free but still held (fragmentation).",
            vec![
                format!("slotprof_heap_bytes{{state=\"in_use\"}} {in_use}"),
                format!("slotprof_heap_bytes{{state=\"free\"}} {free}"),
            ],
        );
    }
    out
}

/// glibc's heap: (bytes in use, bytes free but held), all arenas.
fn heap_bytes() -> Option<(u64, u64)> {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallinfo2 only reads the allocator's counters.
        let m = unsafe { libc::mallinfo2() };
        Some(((m.uordblks + m.hblkhd) as u64, m.fordblks as u64))
    }
    #[cfg(not(target_env = "gnu"))]
    None
}

/// Serves /metrics and / until the task is dropped.
/// Connections served at once; one more is closed as soon as it is
/// accepted (a scraper needs one; idle clients must not take the
/// descriptors the profiling itself needs).
pub const MAX_CONNECTIONS: usize = 32;

pub async fn serve(listener: TcpListener, state: Arc<Mutex<Snapshot>>, index: PathBuf) {
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let mut conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            // Out of descriptors (or another transient failure): the
            // listener stays readable, so wait instead of spinning.
            Err(_) => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            drop(conn);
            continue;
        };
        let state = state.clone();
        let index = index.clone();
        tokio::spawn(async move {
            let _permit = permit;
            // The request line may come in several segments: read until the
            // end of the head (or 4 KiB, or 3 s), never answering a part.
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
            while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                match tokio::time::timeout_at(deadline, conn.read(&mut buf[n..])).await {
                    Ok(Ok(0)) => break,
                    Ok(Ok(got)) => n += got,
                    _ => return,
                }
            }
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request
                .lines()
                .next()
                .and_then(|l| l.strip_prefix("GET "))
                .and_then(|l| l.split(' ').next())
                .unwrap_or("");
            let (status, kind, body) = match path {
                "/metrics" => {
                    let snapshot = state.lock().unwrap().clone();
                    let (cpu, rss) = own_usage();
                    (
                        "200 OK",
                        "text/plain; version=0.0.4",
                        render(&snapshot, cpu, rss).into_bytes(),
                    )
                }
                "/" | "/index.html" => match std::fs::read(&index) {
                    Ok(b) => ("200 OK", "text/html; charset=utf-8", b),
                    Err(_) => ("404 Not Found", "text/plain", b"no index.html yet\n".to_vec()),
                },
                _ => ("404 Not Found", "text/plain", b"try /metrics or /\n".to_vec()),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(&body).await;
        });
    }
}

#[cfg(test)]
mod tests {
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
        let text = render(&snapshot(), 1.5, 64 << 20);
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
            value(&scrape, "slotprof_process_resident_memory_bytes", None),
            (64 << 20) as f64
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
        let server = tokio::spawn(serve(
            listener,
            Arc::new(Mutex::new(snapshot())),
            dir.join("index.html"),
        ));
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
        assert!(value(&scrape, "slotprof_process_resident_memory_bytes", None) > 0.0);
        assert!(get("/").await.ends_with("<html>slots</html>"));
        assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
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
    }

    fn open_descriptors() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
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
            std::path::PathBuf::from("/nonexistent/index.html"),
        ));
        let before = open_descriptors();
        let mut idle = Vec::new();
        for _ in 0..1100 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let held_by_server = open_descriptors() - before - idle.len();
        assert!(
            held_by_server <= MAX_CONNECTIONS + 4,
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
