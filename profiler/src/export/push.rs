//! Pushing profiles to a fleet's profiling backend: Grafana Pyroscope's
//! ingest API (`POST /ingest`, a pprof upload) and OTLP profiles over
//! HTTP (`POST /v1development/profiles`), off unless configured
//! (`[push]` in slotprof.toml, `--push-*` for attach and record).
//!
//! Slots are gathered into batches of `push.every` (10 s) of slot time:
//! one pprof profile whose samples carry their slot, leader flag and phase
//! as sample labels (a slot is not a series label: it changes every
//! 400 ms), their thread and CPU, with the node's identity, host name and
//! slotprof's version as series labels (Pyroscope) or resource attributes
//! (OTLP). A batch is encoded once per endpoint and queued; each endpoint
//! has its own queue, bounded in bytes (`push.queue`), and its own sender
//! task. Profiling never waits for a push: a full queue drops its oldest
//! batch (counted), a failed request is retried with backoff (1 s
//! doubling to 60 s), a request the receiver refuses as malformed (4xx
//! but 408 and 429) is dropped and said. A backend that is down costs the
//! queue's bytes and nothing else. `/metrics` counts batches pushed,
//! dropped and rejected, failed attempts, and the bytes queued.
//!
//! Plain HTTP only: for TLS or authentication, push to a local Grafana
//! Alloy (`pyroscope.receive_http`) or OpenTelemetry Collector, which
//! forwards.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use bytes::Bytes;
use flamegraphs::pprof::{self, ProfileMeta};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioTimer},
};

use super::{
    report::{add_rows, pprof_types, SlotLabels},
    SlotExport, SlotResult,
};
pub use crate::spec::{parse_url, PushConfig};
use crate::{slot_sources::SharedSlotLog, spec::valid_value};

/// An endpoint's counts, read by /metrics and the session summary.
#[derive(Debug)]
pub struct Stats {
    /// "pyroscope" or "otlp".
    pub endpoint: &'static str,
    pub url: String,
    /// The queue's bound in bytes.
    pub limit: u64,
    /// Batches the receiver took.
    pub pushed: AtomicU64,
    /// Batches dropped unsent: the queue was full (the oldest goes), or
    /// they were still queued when slotprof stopped.
    pub dropped: AtomicU64,
    /// Batches the receiver refused (4xx other than 408 and 429): not
    /// sent again.
    pub rejected: AtomicU64,
    /// Attempts that failed (connection, timeout, 5xx, 408, 429): retried.
    pub failed: AtomicU64,
    pub queued_bytes: AtomicU64,
    /// The last batch taken (Unix ms; 0: none yet).
    pub last_pushed_unix_ms: AtomicU64,
    /// Time spent encoding this endpoint's batches (on the profiling
    /// side: what pushing costs it).
    pub encode_ns: AtomicU64,
}

impl Stats {
    pub(crate) fn new(endpoint: &'static str, url: String, limit: u64) -> Self {
        Self {
            endpoint,
            url,
            limit,
            pushed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            queued_bytes: AtomicU64::new(0),
            last_pushed_unix_ms: AtomicU64::new(0),
            encode_ns: AtomicU64::new(0),
        }
    }

    /// As summary.json says it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "endpoint": self.endpoint,
            "url": self.url,
            "pushed": self.pushed.load(Relaxed),
            "dropped": self.dropped.load(Relaxed),
            "rejected": self.rejected.load(Relaxed),
            "failed_attempts": self.failed.load(Relaxed),
            "queued_bytes": self.queued_bytes.load(Relaxed),
            "queue_limit_bytes": self.limit,
            "encode_seconds": self.encode_ns.load(Relaxed) as f64 / 1e9,
        })
    }
}

/// One encoded batch, ready to send.
#[derive(Clone)]
struct Item {
    seq: u64,
    uri: hyper::Uri,
    content_type: String,
    /// `Content-Encoding` (OTLP's body is gzipped).
    encoding: Option<&'static str>,
    body: Bytes,
    /// Its first and last slot, for messages.
    slots: (u64, u64),
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Item>,
    bytes: u64,
    next_seq: u64,
}

/// What an endpoint's sender task shares with the pusher.
struct Endpoint {
    stats: Arc<Stats>,
    queue: Mutex<Queue>,
    wake: tokio::sync::Notify,
    timeout: Duration,
    /// Sent with every request (`push.headers`).
    headers: Vec<(String, String)>,
}

impl Endpoint {
    /// Queues `item`, dropping the oldest batches past the bound.
    fn enqueue(&self, mut item: Item) {
        let len = item.body.len() as u64;
        let mut q = self.queue.lock().unwrap();
        if len > self.stats.limit {
            self.stats.dropped.fetch_add(1, Relaxed);
            eprintln!(
                "slotprof: push to {} {}: the batch of slots {}-{} is {}, more than the whole queue \
                 (push.queue = {}); dropped: raise push.queue or lower push.every",
                self.stats.endpoint,
                self.stats.url,
                item.slots.0,
                item.slots.1,
                size(len),
                size(self.stats.limit)
            );
            return;
        }
        while q.bytes + len > self.stats.limit {
            let Some(old) = q.items.pop_front() else { break };
            q.bytes -= old.body.len() as u64;
            self.stats.dropped.fetch_add(1, Relaxed);
        }
        item.seq = q.next_seq;
        q.next_seq += 1;
        q.bytes += len;
        q.items.push_back(item);
        self.stats.queued_bytes.store(q.bytes, Relaxed);
        drop(q);
        self.wake.notify_one();
    }

    /// Removes the batch `seq` if it is still queued (the bound may have
    /// dropped it meanwhile).
    fn remove(&self, seq: u64) -> bool {
        let mut q = self.queue.lock().unwrap();
        let Some(i) = q.items.iter().position(|it| it.seq == seq) else {
            return false;
        };
        let it = q.items.remove(i).unwrap();
        q.bytes -= it.body.len() as u64;
        self.stats.queued_bytes.store(q.bytes, Relaxed);
        true
    }

    /// The oldest batch (its body shared, not copied).
    fn front(&self) -> Option<Item> {
        self.queue.lock().unwrap().items.front().cloned()
    }

    fn idle(&self) -> bool {
        // A batch stays queued while it is sent: an empty queue has none
        // under way (or only one the bound dropped meanwhile).
        self.queue.lock().unwrap().items.is_empty()
    }
}

/// How a request ended.
enum Sent {
    Taken,
    /// Worth trying again later.
    Retry(String),
    /// The receiver will not take it.
    Refused(String),
}

const MIN_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Bytes of a receiver's answer read (for its message).
const ANSWER_LIMIT: usize = 64 << 10;

/// One request for `item`.
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    item: Item,
    headers: &[(String, String)],
    timeout: Duration,
) -> Sent {
    let mut request = hyper::Request::post(item.uri)
        .header(hyper::header::CONTENT_TYPE, item.content_type)
        .header(
            hyper::header::USER_AGENT,
            concat!("slotprof/", env!("CARGO_PKG_VERSION")),
        );
    if let Some(e) = item.encoding {
        request = request.header(hyper::header::CONTENT_ENCODING, e);
    }
    for (k, v) in headers {
        request = request.header(k.as_str(), v.as_str());
    }
    let request = match request.body(Full::new(item.body)) {
        Ok(r) => r,
        Err(e) => return Sent::Refused(format!("cannot build the request: {e}")),
    };
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("{:#}", anyhow::Error::from(e)))?;
        let status = response.status();
        let answer = Limited::new(response.into_body(), ANSWER_LIMIT)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok::<_, String>((status, answer))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => Sent::Retry(format!("no answer within {:?}", timeout)),
        Ok(Err(e)) => Sent::Retry(e),
        Ok(Ok((status, answer))) => {
            let said = || {
                format!(
                    "HTTP {status}: {}",
                    crate::slot_sources::rpc::quote(&answer).trim()
                )
            };
            if status.is_success() {
                Sent::Taken
            } else if status.is_server_error()
                || status == hyper::StatusCode::TOO_MANY_REQUESTS
                || status == hyper::StatusCode::REQUEST_TIMEOUT
            {
                Sent::Retry(said())
            } else {
                Sent::Refused(said())
            }
        }
    }
}

/// An endpoint's sender: the oldest batch first, each until it is taken,
/// refused or dropped by the bound; says when pushing starts failing and
/// when it works again.
async fn sender(ep: Arc<Endpoint>) {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(ep.timeout.min(Duration::from_secs(10))));
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(1)
        .build(connector);
    let mut backoff = MIN_BACKOFF;
    let mut failing: Option<u64> = None;
    let mut refusing = false;
    loop {
        let Some(item) = ep.front() else {
            ep.wake.notified().await;
            continue;
        };
        let (seq, slots) = (item.seq, item.slots);
        let sent = send(&client, item, &ep.headers, ep.timeout).await;
        let s = &ep.stats;
        match sent {
            Sent::Taken => {
                ep.remove(seq);
                s.pushed.fetch_add(1, Relaxed);
                s.last_pushed_unix_ms.store(crate::sys::unix_ms(), Relaxed);
                if let Some(attempts) = failing.take() {
                    eprintln!(
                        "slotprof: push to {} {} works again (after {attempts} failed attempts)",
                        s.endpoint, s.url
                    );
                }
                refusing = false;
                backoff = MIN_BACKOFF;
            }
            Sent::Refused(why) => {
                if ep.remove(seq) {
                    s.rejected.fetch_add(1, Relaxed);
                }
                // Said once until a batch is taken again (a wrong URL
                // refuses every batch).
                if !refusing {
                    refusing = true;
                    eprintln!(
                        "slotprof: push to {} {}: the receiver refused slots {}-{} ({why}); not sent again, \
                         nor is any batch it refuses (counted in slotprof_push_batches_total{{result=\"rejected\"}}): \
                         check the URL and that the receiver takes this format",
                        s.endpoint, s.url, slots.0, slots.1
                    );
                }
            }
            Sent::Retry(why) => {
                s.failed.fetch_add(1, Relaxed);
                let n = failing.get_or_insert(0);
                if *n == 0 {
                    eprintln!(
                        "slotprof: push to {} {} failed ({why}); profiling goes on, batches wait in a queue \
                         of at most {} (push.queue; the oldest dropped past it), retried with backoff",
                        s.endpoint,
                        s.url,
                        size(s.limit)
                    );
                }
                *n += 1;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// The batch being gathered.
struct Batch {
    b: pprof::Builder,
    meta: ProfileMeta,
    /// First slot's start and last slot's end (CLOCK_MONOTONIC ns).
    start_ns: u64,
    end_ns: u64,
    slots: (u64, u64),
}

/// Gathers slots into batches and queues them for each endpoint (see the
/// module's comment). Profiling's side: no I/O, no waiting.
pub struct Pusher {
    endpoints: Vec<(Arc<Endpoint>, Kind)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    batch: Option<Batch>,
    every_ns: u64,
    configured_application: Option<String>,
    application: String,
    labels: Vec<(String, String)>,
    /// The RPC slot source's log, for the node's identity.
    slot_log: Option<SharedSlotLog>,
    mono_to_unix: i128,
}

#[derive(Clone)]
enum Kind {
    Pyroscope { base: String },
    Otlp { uri: hyper::Uri },
}

impl Pusher {
    /// Starts a sender per configured endpoint (on the current tokio
    /// runtime); `application` is the default application name.
    pub fn start(config: &PushConfig, application: &str, slot_log: Option<SharedSlotLog>) -> Self {
        let mut endpoints = Vec::new();
        let mut add = |name: &'static str, uri: &hyper::Uri, kind: Kind| {
            endpoints.push((
                Arc::new(Endpoint {
                    stats: Arc::new(Stats::new(name, uri.to_string(), config.queue_bytes)),
                    queue: Mutex::new(Queue::default()),
                    wake: tokio::sync::Notify::new(),
                    timeout: config.timeout,
                    headers: config.headers.clone(),
                }),
                kind,
            ));
        };
        if let Some(u) = &config.pyroscope {
            let base = u.to_string().trim_end_matches('/').to_string();
            add("pyroscope", u, Kind::Pyroscope { base });
        }
        if let Some(u) = &config.otlp {
            let uri = if matches!(u.path(), "" | "/") {
                format!(
                    "{}{}",
                    u.to_string().trim_end_matches('/'),
                    flamegraphs::otlp::HTTP_PATH
                )
                .parse()
                .unwrap_or_else(|_| u.clone())
            } else {
                u.clone()
            };
            add("otlp", &uri.clone(), Kind::Otlp { uri });
        }
        let tasks = endpoints
            .iter()
            .map(|(ep, _)| tokio::spawn(sender(ep.clone())))
            .collect();
        let application = config
            .application
            .clone()
            .filter(|a| valid_value(a))
            .unwrap_or_else(|| sanitized(application));
        Self {
            endpoints,
            tasks,
            configured_application: config.application.clone(),
            batch: None,
            every_ns: config.every.as_nanos() as u64,
            application,
            labels: config.labels.clone(),
            slot_log,
            mono_to_unix: crate::sys::unix_ns() as i128 - crate::slots::monotonic_ns() as i128,
        }
    }

    /// Follows a (new) target: its name ([`crate::kernel::target::Target::name`]) is the application's
    /// when none is configured, its slot source's log gives the identity.
    pub fn follow(&mut self, comm: &str, slot_log: SharedSlotLog) {
        if self.configured_application.is_none() {
            self.application = sanitized(comm);
        }
        self.slot_log = Some(slot_log);
    }

    /// Each endpoint's counts.
    pub fn stats(&self) -> Vec<Arc<Stats>> {
        self.endpoints.iter().map(|(e, _)| e.stats.clone()).collect()
    }

    fn unix_ns(&self, mono: u64) -> i64 {
        (mono as i128 + self.mono_to_unix).clamp(0, i64::MAX as i128) as i64
    }

    /// The node's series labels / resource attributes.
    fn node_labels(&self) -> Vec<(String, String)> {
        let mut l = vec![
            ("hostname".to_string(), hostname()),
            (
                "slotprof_version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ),
        ];
        if let Some(id) = self
            .slot_log
            .as_ref()
            .and_then(|log| log.lock().unwrap().identity.clone())
            .filter(|id| valid_value(id))
        {
            l.push(("identity".to_string(), id));
        }
        l.extend(self.labels.iter().cloned());
        l
    }

    /// Encodes the batch gathered and queues it for every endpoint; the
    /// time each endpoint's encoding took is counted (the pprof profile's
    /// to the first).
    fn flush(&mut self) {
        let Some(batch) = self.batch.take() else { return };
        let began = std::time::Instant::now();
        let mut meta = batch.meta.clone();
        meta.time_nanos = self.unix_ns(batch.start_ns);
        meta.duration_nanos = batch.end_ns.saturating_sub(batch.start_ns).min(i64::MAX as u64) as i64;
        let gz = match batch.b.gzip(&meta) {
            Ok(gz) => Bytes::from(gz),
            Err(e) => {
                for (ep, _) in &self.endpoints {
                    ep.stats.dropped.fetch_add(1, Relaxed);
                }
                eprintln!(
                    "slotprof: push: the profile of slots {}-{} could not be built ({e}); dropped",
                    batch.slots.0, batch.slots.1
                );
                return;
            }
        };
        let labels = self.node_labels();
        let mut began = Some(began);
        for (ep, kind) in &self.endpoints {
            let start = began.take().unwrap_or_else(std::time::Instant::now);
            let item = match kind {
                Kind::Pyroscope { base } => self.pyroscope_item(base, &gz, &labels, &meta),
                Kind::Otlp { uri } => self.otlp_item(uri, &gz, &labels),
            };
            ep.stats
                .encode_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
            match item {
                Some(mut item) => {
                    item.slots = batch.slots;
                    ep.enqueue(item);
                }
                None => {
                    ep.stats.dropped.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// Pyroscope's ingest request: the application and the node's series
    /// labels in `name`, the batch's time span, the pprof in a form.
    fn pyroscope_item(
        &self,
        base: &str,
        gz: &[u8],
        labels: &[(String, String)],
        meta: &ProfileMeta,
    ) -> Option<Item> {
        let from_s = meta.time_nanos / 1_000_000_000;
        let until_s = ((meta.time_nanos + meta.duration_nanos + 999_999_999) / 1_000_000_000).max(from_s + 1);
        let name = format!(
            "{}{{{}}}",
            self.application,
            labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        );
        let hz = if meta.period > 0 {
            1_000_000_000 / meta.period
        } else {
            0
        };
        let uri = format!(
            "{base}/ingest?name={}&from={from_s}&until={until_s}&format=pprof&spyName=slotprof&sampleRate={hz}",
            percent_encode(&name)
        );
        let (content_type, body) = multipart(gz);
        Some(Item {
            seq: 0,
            uri: uri.parse().ok()?,
            content_type,
            encoding: None,
            body,
            slots: (0, 0),
        })
    }

    /// The OTLP export request of the batch's profile, gzipped, with the
    /// node as resource attributes.
    fn otlp_item(&self, uri: &hyper::Uri, gz: &[u8], labels: &[(String, String)]) -> Option<Item> {
        let p = pprof::decode_gzip(gz).ok()?;
        let mut resource: Vec<(&str, String)> = vec![
            ("service.name", self.application.clone()),
            ("host.name", hostname()),
        ];
        for (k, v) in labels {
            match k.as_str() {
                "hostname" => {}
                "identity" => {
                    resource.push(("service.instance.id", v.clone()));
                    resource.push(("solana.identity", v.clone()));
                }
                k => resource.push((k, v.clone())),
            }
        }
        let r = flamegraphs::otlp::request(
            &p,
            &resource,
            ("slotprof", env!("CARGO_PKG_VERSION")),
            &["offcpu"],
        );
        Some(Item {
            seq: 0,
            uri: uri.clone(),
            content_type: "application/x-protobuf".to_string(),
            encoding: Some("gzip"),
            body: Bytes::from(gzip(&flamegraphs::otlp::encode(&r)).ok()?),
            slots: (0, 0),
        })
    }

    /// Waits up to `within` for the queues to empty (at the end of a
    /// session or the daemon), then stops the senders; what is still
    /// queued is counted dropped and said, and each endpoint's counts.
    pub async fn drain(mut self, within: Duration) {
        self.flush();
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline && !self.endpoints.iter().all(|(e, _)| e.idle()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for t in &self.tasks {
            t.abort();
        }
        for (ep, _) in &self.endpoints {
            let left = {
                let mut q = ep.queue.lock().unwrap();
                let n = q.items.len() as u64;
                q.items.clear();
                q.bytes = 0;
                n
            };
            ep.stats.queued_bytes.store(0, Relaxed);
            if left > 0 {
                ep.stats.dropped.fetch_add(left, Relaxed);
                eprintln!(
                    "slotprof: push to {} {}: {left} batches not sent within {:?} of stopping; dropped",
                    ep.stats.endpoint, ep.stats.url, within
                );
            }
            let s = &ep.stats;
            eprintln!(
                "slotprof: push to {} {}: {} batches pushed, {} dropped, {} rejected, {} failed attempts; \
                 encoding took {:.3} s",
                s.endpoint,
                s.url,
                s.pushed.load(Relaxed),
                s.dropped.load(Relaxed),
                s.rejected.load(Relaxed),
                s.failed.load(Relaxed),
                s.encode_ns.load(Relaxed) as f64 / 1e9
            );
        }
    }
}

impl Drop for Pusher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl SlotExport for Pusher {
    fn slot(&mut self, r: &SlotResult<'_>) -> anyhow::Result<()> {
        let slot = r.slot;
        if self
            .batch
            .as_ref()
            .is_some_and(|b| slot.start_ns >= b.start_ns.saturating_add(self.every_ns))
        {
            self.flush();
        }
        let batch = self.batch.get_or_insert_with(|| Batch {
            b: pprof::Builder::new(&pprof_types()),
            meta: r.meta.clone(),
            start_ns: slot.start_ns,
            end_ns: slot.end_ns,
            slots: (slot.number, slot.number),
        });
        let labels = SlotLabels::of(slot, r.phase).labels();
        add_rows(&mut batch.b, &r.profiles.rows, r.meta.period.max(0), &labels);
        batch.end_ns = batch.end_ns.max(slot.end_ns);
        batch.slots.1 = slot.number;
        Ok(())
    }

    fn finish(&mut self, _meta: &ProfileMeta) -> anyhow::Result<()> {
        self.flush();
        Ok(())
    }
}

/// `bytes` gzipped (OTLP/HTTP's `Content-Encoding: gzip`).
fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    // Level 1 (see flamegraphs' pprof writer): pushed every few seconds.
    let mut gz =
        flate2::write::GzEncoder::new(Vec::with_capacity(bytes.len() / 3), flate2::Compression::fast());
    gz.write_all(bytes)?;
    gz.finish()
}

/// Bytes as people read them.
fn size(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

/// A process name as a label value.
fn sanitized(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if valid_value(&c.to_string()) { c } else { '_' })
        .collect();
    if s.is_empty() {
        "slotprof".into()
    } else {
        s
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| valid_value(h))
        .unwrap_or_else(|| "unknown".into())
}

/// Percent-encodes a query value (everything but unreserved characters).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Pyroscope's pprof upload: a multipart form with the gzipped profile in
/// its `profile` field. The content type and the body.
fn multipart(profile: &[u8]) -> (String, Bytes) {
    // A boundary that cannot occur in the profile: gzip output is random
    // bytes, so check.
    let mut n: u64 = crate::sys::random_u64().unwrap_or_else(crate::sys::unix_ns);
    let boundary = loop {
        let b = format!("slotprof-{n:016x}");
        if !profile.windows(b.len()).any(|w| w == b.as_bytes()) {
            break b;
        }
        n = n.wrapping_mul(6364136223846793005).wrapping_add(1);
    };
    let mut body = Vec::with_capacity(profile.len() + 256);
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(profile);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (
        format!("multipart/form-data; boundary={boundary}"),
        Bytes::from(body),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(limit: u64) -> Endpoint {
        Endpoint {
            stats: Arc::new(Stats::new("otlp", "http://x".into(), limit)),
            queue: Mutex::new(Queue::default()),
            wake: tokio::sync::Notify::new(),
            timeout: Duration::from_secs(1),
            headers: Vec::new(),
        }
    }

    fn item(len: usize, slot: u64) -> Item {
        Item {
            seq: 0,
            uri: "http://x/".parse().unwrap(),
            content_type: String::new(),
            encoding: None,
            body: Bytes::from(vec![0u8; len]),
            slots: (slot, slot),
        }
    }

    #[test]
    fn a_full_queue_drops_its_oldest_batches_and_stays_within_its_bound() {
        let ep = endpoint(1000);
        for s in 0..10 {
            ep.enqueue(item(300, s));
            assert!(ep.stats.queued_bytes.load(Relaxed) <= 1000);
        }
        assert_eq!(ep.queue.lock().unwrap().items.len(), 3);
        assert_eq!(ep.stats.dropped.load(Relaxed), 7);
        // The newest are kept.
        let first = ep.front().unwrap();
        assert_eq!(first.slots, (7, 7));
        // A batch larger than the whole queue is dropped at once.
        ep.enqueue(item(2000, 99));
        assert_eq!(ep.stats.dropped.load(Relaxed), 8);
        assert_eq!(ep.queue.lock().unwrap().items.len(), 3);
        // Removing what the bound already dropped does nothing.
        assert!(!ep.remove(0));
        assert!(ep.remove(first.seq));
        assert_eq!(ep.stats.queued_bytes.load(Relaxed), 600);
    }

    /// A receiver answering `status` to every request, counting them.
    async fn answering(status: u16) -> (u16, Arc<AtomicU64>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(AtomicU64::new(0));
        let counter = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 16];
                    let mut got = Vec::new();
                    // One request per connection: the head, then its body.
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        got.extend_from_slice(&buf[..n]);
                        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        if got.len() >= end + 4 + len {
                            counter.fetch_add(1, Relaxed);
                            let answer = format!(
                                "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            );
                            let _ = conn.write_all(answer.as_bytes()).await;
                            return;
                        }
                    }
                });
            }
        });
        (port, seen)
    }

    #[tokio::test]
    async fn a_refused_batch_is_counted_and_not_sent_again_and_a_taken_one_leaves_the_queue() {
        for (status, pushed, rejected) in [(404, 0, 3), (200, 3, 0)] {
            let (port, seen) = answering(status).await;
            let ep = Arc::new(endpoint(1 << 20));
            for s in 0..3 {
                let mut it = item(100, s);
                it.uri = format!("http://127.0.0.1:{port}/ingest").parse().unwrap();
                ep.enqueue(it);
            }
            let task = tokio::spawn(sender(ep.clone()));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while !ep.idle() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            task.abort();
            let st = &ep.stats;
            assert_eq!(
                (
                    st.pushed.load(Relaxed),
                    st.rejected.load(Relaxed),
                    st.failed.load(Relaxed)
                ),
                (pushed, rejected, 0),
                "HTTP {status}"
            );
            // Each batch was sent once, and the queue is empty.
            assert_eq!(seen.load(Relaxed), 3, "HTTP {status}");
            assert_eq!(st.queued_bytes.load(Relaxed), 0);
        }
    }

    #[test]
    fn urls_and_labels_are_checked_with_what_to_do() {
        assert!(parse_url("push.pyroscope", "http://127.0.0.1:4040").is_ok());
        let e = parse_url("push.otlp", "https://x:4318").unwrap_err().to_string();
        assert!(e.contains("Alloy") && e.contains("Collector"), "{e}");
        assert!(parse_url("push.otlp", "ftp://x").is_err());
        assert!(parse_url("push.otlp", "http://x:1/?a=b").is_err());
        let mut c = PushConfig {
            labels: vec![("cluster".into(), "mainnet".into())],
            ..Default::default()
        };
        assert!(c.check().is_ok());
        c.labels = vec![("9x".into(), "a".into())];
        assert!(c.check().unwrap_err().to_string().contains("label name"));
        c.labels = vec![("x".into(), "a,b".into())];
        assert!(c.check().is_err());
        c.labels.clear();
        c.headers = vec![("X-Scope-OrgID".into(), "validators".into())];
        assert!(c.check().is_ok());
        c.headers = vec![("Content-Type".into(), "text/plain".into())];
        assert!(c.check().unwrap_err().to_string().contains("slotprof's to set"));
        c.headers = vec![("bad header".into(), "x".into())];
        assert!(c.check().unwrap_err().to_string().contains("not an HTTP header"));
        c.headers.clear();
        c.every = Duration::from_millis(10);
        assert!(c.check().unwrap_err().to_string().contains("push.every"));
    }

    #[test]
    fn the_multipart_body_carries_the_profile_whole_under_its_boundary() {
        let profile = b"\x1f\x8b--slotprof-\r\n\x00binary".to_vec();
        let (ct, body) = multipart(&profile);
        let boundary = ct.strip_prefix("multipart/form-data; boundary=").unwrap();
        let text = body.to_vec();
        let start = text.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let end = text.len() - format!("\r\n--{boundary}--\r\n").len();
        assert_eq!(&text[start..end], &profile[..]);
        assert!(String::from_utf8_lossy(&text[..start]).contains("name=\"profile\""));
        assert_eq!(percent_encode("a{b=c,d}"), "a%7Bb%3Dc%2Cd%7D");
    }
}
