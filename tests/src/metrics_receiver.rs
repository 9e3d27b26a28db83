//! A local receiver for a Solana node's metrics (`SOLANA_METRICS_CONFIG=
//! host=http://127.0.0.1:PORT,db=...,u=...,p=...`): the node POSTs InfluxDB
//! line protocol to `/write?db=...` every few seconds. The points are kept
//! for a test to read: the node's own view of its slots, independent of
//! slotprof and of its RPC.
//!
//! What arrives is treated as hostile: requests over the bounds of
//! [`crate::http_receiver`] and lines that do not parse are counted and
//! dropped, never trusted.

use std::time::Duration;

use crate::http_receiver::HttpReceiver;

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

/// The receiver: an [`HttpReceiver`] answering 204, its request bodies
/// read as line protocol when asked.
pub struct MetricsReceiver {
    pub port: u16,
    http: HttpReceiver,
}

impl MetricsReceiver {
    pub fn start() -> std::io::Result<MetricsReceiver> {
        let http = HttpReceiver::start(Box::new(|_| (204, Duration::ZERO)))?;
        Ok(MetricsReceiver {
            port: http.port,
            http,
        })
    }

    /// The value for `SOLANA_METRICS_CONFIG`.
    pub fn config(&self) -> String {
        format!(
            "host=http://127.0.0.1:{},db=slotprof,u=slotprof,p=slotprof",
            self.port
        )
    }

    /// Every point received so far, and the lines that did not parse.
    fn parsed(&self) -> (Vec<Point>, u64) {
        let (mut points, mut rejected) = (Vec::new(), 0);
        for (req, _) in self.http.requests() {
            for line in String::from_utf8_lossy(&req.body)
                .lines()
                .filter(|l| !l.trim().is_empty())
            {
                match parse_line(line) {
                    Some(p) => points.push(p),
                    None => rejected += 1,
                }
            }
        }
        (points, rejected)
    }

    /// Every point of `measurement` received so far.
    pub fn points(&self, measurement: &str) -> Vec<Point> {
        self.parsed()
            .0
            .into_iter()
            .filter(|p| p.measurement == measurement)
            .collect()
    }

    /// The measurements received, by name.
    pub fn measurements(&self) -> Vec<String> {
        let mut names: Vec<String> = self.parsed().0.into_iter().map(|p| p.measurement).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// How many points arrived, of how many measurements.
    pub fn counts(&self) -> (usize, usize) {
        let points = self.parsed().0;
        let mut names: Vec<&str> = points.iter().map(|p| p.measurement.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        (points.len(), names.len())
    }

    /// Lines and requests dropped as malformed or too large.
    pub fn rejected(&self) -> u64 {
        self.parsed().1 + self.http.refused()
    }
}
