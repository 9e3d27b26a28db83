//! A local receiver for a Solana node's metrics (`SOLANA_METRICS_CONFIG=
//! host=http://127.0.0.1:PORT,db=...,u=...,p=...`): the node POSTs InfluxDB
//! line protocol to `/write?db=...` every few seconds. The points are kept
//! for a test to read: the node's own view of its slots, independent of
//! slotprof and of its RPC.
//!
//! What arrives is treated as hostile: requests over the bounds of
//! [`crate::http_receiver`] and lines that do not parse are counted and
//! dropped, never trusted.

use crate::http_receiver::{read_request, Incoming};
use std::{
    io::{BufReader, Write},
    net::{TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

/// One point: measurement, tags and fields as text, time in ns since the
/// Unix epoch (the node's CLOCK_REALTIME when it made the point).
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub measurement: String,
    pub tags: Vec<(String, String)>,
    pub fields: Vec<(String, String)>,
    pub unix_ns: u64,
}

impl Point {
    /// An integer field (`123i` in line protocol, or a plain number).
    pub fn int(&self, name: &str) -> Option<i64> {
        let v = &self.fields.iter().find(|(k, _)| k == name)?.1;
        v.strip_suffix('i').unwrap_or(v).parse().ok()
    }
}

/// Splits `s` on `sep` outside double quotes and backslash escapes.
fn split_unquoted(s: &str, sep: char) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
        } else if c == sep && !quoted {
            out.push(&s[start..i]);
            start = i + c.len_utf8();
        }
    }
    out.push(&s[start..]);
    out
}

/// Parses one line of InfluxDB line protocol (`measurement,tag=v field=v
/// TIMESTAMP`); `None` for anything else.
pub fn parse_line(line: &str) -> Option<Point> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let parts = split_unquoted(line, ' ');
    let parts: Vec<&str> = parts.into_iter().filter(|p| !p.is_empty()).collect();
    let [key, fields, ts] = parts.as_slice() else {
        return None;
    };
    let mut key = split_unquoted(key, ',').into_iter();
    let measurement = key.next().filter(|m| !m.is_empty())?.to_string();
    let pair = |kv: &str| -> Option<(String, String)> {
        let (k, v) = kv.split_once('=')?;
        Some((k.to_string(), v.trim_matches('"').to_string()))
    };
    let tags = key.map(pair).collect::<Option<Vec<_>>>()?;
    let fields = split_unquoted(fields, ',')
        .into_iter()
        .map(pair)
        .collect::<Option<Vec<_>>>()?;
    if fields.is_empty() {
        return None;
    }
    Some(Point {
        measurement,
        tags,
        fields,
        unix_ns: ts.parse().ok()?,
    })
}

/// The receiver: a listening thread; points accumulate until it is
/// dropped.
pub struct MetricsReceiver {
    pub port: u16,
    points: Arc<Mutex<Vec<Point>>>,
    rejected: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MetricsReceiver {
    pub fn start() -> std::io::Result<MetricsReceiver> {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let points = Arc::new(Mutex::new(Vec::new()));
        let rejected = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, r, s) = (points.clone(), rejected.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (p, r) = (p.clone(), r.clone());
                        std::thread::spawn(move || serve(conn, &p, &r));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(MetricsReceiver {
            port,
            points,
            rejected,
            stop,
            thread: Some(thread),
        })
    }

    /// The value for `SOLANA_METRICS_CONFIG`.
    pub fn config(&self) -> String {
        format!(
            "host=http://127.0.0.1:{},db=slotprof,u=slotprof,p=slotprof",
            self.port
        )
    }

    /// Every point of `measurement` received so far.
    pub fn points(&self, measurement: &str) -> Vec<Point> {
        self.points
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.measurement == measurement)
            .cloned()
            .collect()
    }

    /// The measurements received, by name.
    pub fn measurements(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .points
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.measurement.clone())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// How many points arrived, of how many measurements.
    pub fn counts(&self) -> (usize, usize) {
        let points = self.points.lock().unwrap();
        let mut names: Vec<&str> = points.iter().map(|p| p.measurement.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        (points.len(), names.len())
    }

    /// Lines and requests dropped as malformed or too large.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}

impl Drop for MetricsReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves one connection (HTTP/1.1, keep-alive): each POST body is parsed
/// line by line; every request is answered 204.
fn serve(conn: TcpStream, points: &Mutex<Vec<Point>>, rejected: &AtomicU64) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut writer) = conn.try_clone() else { return };
    let mut reader = BufReader::new(conn);
    loop {
        let body = match read_request(&mut reader) {
            Incoming::Request(r) => r.body,
            Incoming::Closed => return,
            Incoming::Refused => {
                // Too large, or no length: answer and close.
                rejected.fetch_add(1, Ordering::Relaxed);
                let _ = writer.write_all(
                    b"HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                return;
            }
        };
        let text = String::from_utf8_lossy(&body);
        let mut parsed = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match parse_line(line) {
                Some(p) => parsed.push(p),
                None => {
                    rejected.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        points.lock().unwrap().extend(parsed);
        if writer
            .write_all(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            .is_err()
        {
            return;
        }
    }
}
