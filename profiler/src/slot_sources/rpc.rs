//! Slot source `rpc=http://HOST:PORT`: the validator's own JSON-RPC.
//!
//! getIdentity, getEpochInfo and getLeaderSchedule give this node's leader
//! slots (relative indices made absolute; refetched at each new epoch);
//! slot starts come from the websocket `slotSubscribe` (PORT + 1, Agave's
//! layout), with `getSlot` polling as the fallback. When the RPC is down
//! or answers garbage, the source retries with backoff and the session
//! goes on: the slots it missed are estimated and marked unaligned, and
//! the operator is told once.

use std::{collections::HashMap, time::Duration};

use anyhow::{anyhow, bail};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::{TokioExecutor, TokioTimer},
};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::{
    follower::{Follower, Mode, Step, WS_SILENCE},
    EpochSchedule, SharedSlotLog,
};
use crate::slots::monotonic_ns;
pub use tokio_tungstenite::tungstenite;
use tungstenite::Message;

/// Where to reach the RPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RpcEndpoint {
    /// The HTTP JSON-RPC, path included (`http://host:port/path`).
    pub uri: hyper::Uri,
    /// `ws://host:port` of the websocket (HTTP port + 1).
    pub ws: String,
    /// As given, for messages.
    pub url: String,
}

impl RpcEndpoint {
    /// Parses `http://host:port[/path]`; the websocket is at port + 1.
    pub fn parse(url: &str) -> Result<Self, String> {
        if url.starts_with("https://") {
            return Err(format!(
                "rpc={url}: give the validator's plain-HTTP RPC, e.g. rpc=http://127.0.0.1:8899 (https is not supported)"
            ));
        }
        let expected = || format!("rpc={url}: expected http://HOST:PORT, e.g. rpc=http://127.0.0.1:8899");
        let uri: hyper::Uri = url.parse().map_err(|_| expected())?;
        if uri.scheme_str() != Some("http") {
            return Err(expected());
        }
        let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
            return Err(expected());
        };
        let ws_port = port
            .checked_add(1)
            .ok_or_else(|| format!("rpc={url}: the websocket is at the RPC port + 1, and {port} has none"))?;
        Ok(Self {
            ws: format!("ws://{}:{ws_port}", uri.authority().map_or(host, |a| a.host())),
            uri,
            url: url.to_string(),
        })
    }
}

/// One call may take this long, connection included.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// The largest answer read for a small call (slot, identity, epoch).
const SMALL_ANSWER: usize = 64 << 10;
/// The largest leader schedule read: this node's slot indices in an epoch
/// (432,000 slots when it leads them all, as a one-node cluster does:
/// ~3 MB of JSON).
const SCHEDULE_ANSWER: usize = 8 << 20;
/// The largest websocket message (a slot notification is ~150 bytes).
pub const WS_MESSAGE: usize = 64 << 10;
/// Bytes of a bad answer quoted in a message.
const QUOTE: usize = 200;

/// At most [`QUOTE`] bytes of `bytes`, as text, with how much was cut.
pub(crate) fn quote(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(QUOTE)]);
    if bytes.len() <= QUOTE {
        text.into_owned()
    } else {
        format!("{text}... ({} bytes in all)", bytes.len())
    }
}

/// A JSON-RPC reply: `result` is `None` when null or absent.
#[derive(serde::Deserialize)]
struct Reply<T> {
    result: Option<T>,
    error: Option<Value>,
}

/// A JSON-RPC answer's `result` (`None` when null), or why there is none:
/// an error answer, or one of the wrong shape (quoted in at most a few
/// hundred bytes).
pub fn decode_answer<T: DeserializeOwned>(method: &str, body: &[u8]) -> anyhow::Result<Option<T>> {
    let reply: Reply<T> = serde_json::from_slice(body)
        .map_err(|e| anyhow!("{method}: an answer of the wrong shape ({e}): {}", quote(body)))?;
    if let Some(e) = reply.error {
        bail!("{method}: error {}", quote(e.to_string().as_bytes()));
    }
    Ok(reply.result)
}

/// The slot of a websocket message: `Some` for a slot notification,
/// `None` for any other message (the subscription's confirmation).
pub fn notification_slot(text: &str) -> anyhow::Result<Option<u64>> {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        bail!(
            "slotSubscribe: a message that is not JSON: {}",
            quote(text.as_bytes())
        );
    };
    if v.get("method").and_then(Value::as_str) != Some("slotNotification") {
        return Ok(None);
    }
    v["params"]["result"]["slot"]
        .as_u64()
        .map(Some)
        .ok_or_else(|| anyhow!("slotNotification without a slot: {}", quote(text.as_bytes())))
}

/// This node's leader schedule for the epoch `getEpochInfo` describes,
/// from `getLeaderSchedule`'s answer (`None`: no schedule for it).
pub fn schedule_from(
    info: &Value,
    schedule: Option<HashMap<String, Vec<u64>>>,
    identity: &str,
) -> anyhow::Result<EpochSchedule> {
    let absolute = u64_field(info, "absoluteSlot", "getEpochInfo")?;
    let index = u64_field(info, "slotIndex", "getEpochInfo")?;
    let slots_in_epoch = u64_field(info, "slotsInEpoch", "getEpochInfo")?;
    let first_slot = absolute
        .checked_sub(index)
        .ok_or_else(|| anyhow!("getEpochInfo: slotIndex > absoluteSlot"))?;
    if index >= slots_in_epoch || first_slot.checked_add(slots_in_epoch).is_none() {
        bail!("getEpochInfo: slot {absolute} is not in an epoch of {slots_in_epoch} slots from {first_slot}");
    }
    // No entry: not a leader this epoch (or no schedule yet).
    let indices = schedule.and_then(|mut s| s.remove(identity)).unwrap_or_default();
    if indices.iter().any(|&i| i >= slots_in_epoch) {
        bail!("getLeaderSchedule: a slot index past the epoch's {slots_in_epoch} slots");
    }
    Ok(EpochSchedule {
        first_slot,
        slots_in_epoch,
        leader_runs: super::leader_runs(indices.into_iter().map(|i| first_slot + i).collect()),
    })
}

/// The JSON-RPC client: one kept-alive connection (hyper's pool), every
/// call bounded in time and in answer size.
pub struct Rpc {
    client: Client<HttpConnector, Full<Bytes>>,
    ep: RpcEndpoint,
}

impl Rpc {
    pub fn new(ep: RpcEndpoint) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CALL_TIMEOUT));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(2)
            .build(connector);
        Self { client, ep }
    }

    /// One call; `Ok(None)` when the result is null.
    async fn call_opt<T: DeserializeOwned>(
        &self,
        method: &str,
        params: Value,
        limit: usize,
    ) -> anyhow::Result<Option<T>> {
        let body = self.call_raw(method, params, limit).await?;
        decode_answer(method, &body)
    }

    /// One call's answer as it came (HTTP success, at most `limit` bytes,
    /// within the call timeout): for callers that read the error codes.
    pub async fn call_raw(&self, method: &str, params: Value, limit: usize) -> anyhow::Result<Bytes> {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
        let request = hyper::Request::post(self.ep.uri.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| anyhow!("{method}: {:#}", anyhow::Error::from(e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), limit)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        anyhow!("{method}: the answer is larger than {limit} bytes; not read")
                    } else {
                        anyhow!("{method}: reading the answer: {e}")
                    }
                })?
                .to_bytes();
            anyhow::Ok((status, body))
        };
        let (status, body) = tokio::time::timeout(CALL_TIMEOUT, exchange)
            .await
            .map_err(|_| anyhow!("{method}: no answer within {} s", CALL_TIMEOUT.as_secs()))??;
        if !status.is_success() {
            bail!("{method}: HTTP {status}: {}", quote(&body));
        }
        Ok(body)
    }

    /// One call whose result must be there.
    async fn call<T: DeserializeOwned>(&self, method: &str, params: Value) -> anyhow::Result<T> {
        self.call_opt(method, params, SMALL_ANSWER)
            .await?
            .ok_or_else(|| anyhow!("{method}: the answer has no result"))
    }
}

fn u64_field(v: &Value, field: &str, method: &str) -> anyhow::Result<u64> {
    v.get(field).and_then(Value::as_u64).ok_or_else(|| {
        anyhow!(
            "{method}: no numeric `{field}` in {}",
            quote(v.to_string().as_bytes())
        )
    })
}

/// This node's leader slots for the current epoch.
async fn fetch_schedule(rpc: &Rpc, identity: &str) -> anyhow::Result<EpochSchedule> {
    let info: Value = rpc.call("getEpochInfo", json!([])).await?;
    let absolute = u64_field(&info, "absoluteSlot", "getEpochInfo")?;
    // Only this identity's entry is asked for; read straight into numbers
    // (a one-node cluster leads all 432,000 slots of an epoch).
    let schedule: Option<HashMap<String, Vec<u64>>> = rpc
        .call_opt(
            "getLeaderSchedule",
            json!([absolute, {"identity": identity}]),
            SCHEDULE_ANSWER,
        )
        .await?;
    schedule_from(&info, schedule, identity)
}

/// The websocket's limits: a message or frame of at most [`WS_MESSAGE`]
/// bytes (a frame announcing more is an error before it is read).
pub fn ws_config() -> tungstenite::protocol::WebSocketConfig {
    tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(WS_MESSAGE))
        .max_frame_size(Some(WS_MESSAGE))
}

/// What a [`Step`] asks: its warnings said (stderr and the session's
/// summary), its slot recorded, and the leader schedule fetched when the
/// slot is of an epoch not known yet.
async fn apply(
    rpc: &Rpc,
    identity: &str,
    log: &SharedSlotLog,
    follower: &mut Follower,
    step: Step,
    now: u64,
) -> anyhow::Result<()> {
    let known = {
        let mut l = log.lock().unwrap();
        for w in step.warnings {
            eprintln!("slotprof: warning: {w}");
            l.warnings.push(w);
        }
        let Some(slot) = step.take else {
            return Ok(());
        };
        l.starts.push((slot, now));
        l.healthy = true;
        l.epochs.iter().any(|e| e.contains(slot))
    };
    if !known && follower.fetch_schedule(now) {
        let e = fetch_schedule(rpc, identity).await?;
        let mut l = log.lock().unwrap();
        if !l.epochs.contains(&e) {
            l.epochs.push(e);
        }
    }
    Ok(())
}

/// One connected stretch: identity, schedule, then slots from the
/// websocket or from getSlot polling, as the [`Follower`] says, until the
/// mode changes (`Ok`) or an HTTP call fails (`Err`).
async fn connected(rpc: &Rpc, log: &SharedSlotLog, follower: &mut Follower) -> anyhow::Result<()> {
    let identity: Value = rpc.call("getIdentity", json!([])).await?;
    let identity = identity
        .get("identity")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            anyhow!(
                "getIdentity: no `identity` in {}",
                quote(identity.to_string().as_bytes())
            )
        })?
        .to_string();
    let schedule = fetch_schedule(rpc, &identity).await?;
    {
        let mut l = log.lock().unwrap();
        if !l.epochs.contains(&schedule) {
            l.epochs.push(schedule);
        }
        l.identity = Some(identity.clone());
    }
    match follower.connected(monotonic_ns()) {
        Mode::Websocket => websocket(rpc, &identity, log, follower).await,
        _ => {
            // Every 20 ms (or a twentieth of the measured slot length, if
            // longer), on one kept-alive connection, until the websocket
            // is tried again.
            while follower.keep_polling(monotonic_ns()) {
                let slot: u64 = rpc.call("getSlot", json!([])).await?;
                let now = monotonic_ns();
                let step = follower.polled(slot, now);
                apply(rpc, &identity, log, follower, step, now).await?;
                tokio::time::sleep(follower.poll_every()).await;
            }
            Ok(())
        }
    }
}

/// Slots from the websocket's notifications until it misbehaves (then
/// `Ok`: the follower polls instead).
async fn websocket(
    rpc: &Rpc,
    identity: &str,
    log: &SharedSlotLog,
    follower: &mut Follower,
) -> anyhow::Result<()> {
    let connect = tokio_tungstenite::connect_async_with_config(rpc.ep.ws.as_str(), Some(ws_config()), true);
    let Some((mut ws, _)) = tokio::time::timeout(CALL_TIMEOUT, connect)
        .await
        .ok()
        .and_then(Result::ok)
    else {
        follower.websocket_unreachable(monotonic_ns());
        return Ok(());
    };
    let sub = json!({"jsonrpc": "2.0", "id": 1, "method": "slotSubscribe"});
    if let Err(e) = ws.send(sub.to_string().into()).await {
        follower.websocket_failed(&format!("slotSubscribe: {e}"), monotonic_ns());
        return Ok(());
    }
    loop {
        // A flood of ready messages still lets the session stop the task
        // (its budget spent, the task yields).
        tokio::task::consume_budget().await;
        let text = match tokio::time::timeout(WS_SILENCE, ws.next()).await {
            Err(_) => Err(format!(
                "the websocket {} sent no slot for {} s",
                rpc.ep.ws,
                WS_SILENCE.as_secs()
            )),
            Ok(None) => Err(format!("the websocket {} closed", rpc.ep.ws)),
            Ok(Some(Err(e))) => Err(format!("the websocket {}: {e}", rpc.ep.ws)),
            Ok(Some(Ok(Message::Text(text)))) => Ok(text.as_str().to_owned()),
            Ok(Some(Ok(Message::Close(_)))) => Err(format!("the websocket {} closed", rpc.ep.ws)),
            // Binary, ping and pong frames carry no slot.
            Ok(Some(Ok(_))) => continue,
        };
        let now = monotonic_ns();
        let step = match text {
            Ok(text) => follower.websocket_text(&text, now),
            Err(why) => follower.websocket_failed(&why, now),
        };
        let leave = step.leave_websocket;
        apply(rpc, identity, log, follower, step, now).await?;
        if leave {
            return Ok(());
        }
    }
}

/// Follows the RPC for as long as the session runs (cancel the task to
/// stop): the I/O of the [`Follower`] state machine, which decides.
pub async fn follow(ep: RpcEndpoint, log: SharedSlotLog) {
    let rpc = Rpc::new(ep);
    let mut follower = Follower::new(monotonic_ns());
    loop {
        let Err(e) = connected(&rpc, &log, &mut follower).await else {
            continue;
        };
        let (warning, wait) = follower.rpc_failed(&format!("{e:#}"), &rpc.ep.url, monotonic_ns());
        {
            let mut l = log.lock().unwrap();
            l.healthy = false;
            if let Some(w) = warning {
                eprintln!("slotprof: warning: {w}");
                l.warnings.push(w);
            }
        }
        tokio::time::sleep(wait).await;
    }
}

/// [`follow`] on a thread of its own ([`crate::background`]): a slot
/// start is stamped when its notification arrives, not when the session's
/// loop is next free (a heavy slot's symbolizing and export on that loop
/// delayed the next boundary's timestamp by as long).
pub fn follow_in_background(
    ep: RpcEndpoint,
    log: SharedSlotLog,
) -> std::io::Result<crate::background::Background> {
    crate::background::Background::spawn("slotprof-slots", move || follow(ep, log))
}

#[cfg(test)]
mod tests {
    use std::{
        net::SocketAddr,
        sync::{
            atomic::{AtomicUsize, Ordering},
            Arc, Mutex,
        },
    };

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

    #[test]
    fn endpoints() {
        let e = RpcEndpoint::parse("http://127.0.0.1:8899").unwrap();
        assert_eq!(
            (e.uri.to_string().as_str(), e.ws.as_str()),
            ("http://127.0.0.1:8899/", "ws://127.0.0.1:8900")
        );
        let e = RpcEndpoint::parse("http://[::1]:8899/rpc/v1").unwrap();
        assert_eq!((e.uri.path(), e.ws.as_str()), ("/rpc/v1", "ws://[::1]:8900"));
        assert!(RpcEndpoint::parse("https://x:1").unwrap_err().contains("https"));
        assert!(RpcEndpoint::parse("http://x").unwrap_err().contains("HOST:PORT"));
        assert!(RpcEndpoint::parse("ftp://x:1").unwrap_err().contains("HOST:PORT"));
        assert!(RpcEndpoint::parse("http://x:65535")
            .unwrap_err()
            .contains("port + 1"));
    }

    #[tokio::test]
    async fn a_dead_endpoint_is_an_error_not_a_hang() {
        // Port 9 on loopback: nothing listens.
        let rpc = Rpc::new(RpcEndpoint::parse("http://127.0.0.1:9").unwrap());
        assert!(rpc.call::<u64>("getSlot", json!([])).await.is_err());
    }

    /// A JSON-RPC server on loopback (hyper, keep-alive): counts the
    /// connections it accepted and records each request's path and method.
    struct Fake {
        addr: SocketAddr,
        accepts: Arc<AtomicUsize>,
        requests: Arc<Mutex<Vec<(String, String)>>>,
    }

    impl Fake {
        /// Requests of `method` so far.
        fn calls(&self, method: &str) -> usize {
            self.requests
                .lock()
                .unwrap()
                .iter()
                .filter(|(_, m)| m == method)
                .count()
        }
    }

    async fn fake(answer: impl Fn(&str) -> String + Send + Sync + 'static) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepts = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let answer = Arc::new(answer);
        let (a, r) = (accepts.clone(), requests.clone());
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::Relaxed);
                let (answer, r) = (answer.clone(), r.clone());
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                            let (answer, r) = (answer.clone(), r.clone());
                            async move {
                                let path = req.uri().path().to_string();
                                let body = req.into_body().collect().await?.to_bytes();
                                let v: Value = serde_json::from_slice(&body).unwrap_or_default();
                                let method = v["method"].as_str().unwrap_or("").to_string();
                                r.lock().unwrap().push((path, method.clone()));
                                let text = answer(&method);
                                Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::from(text))))
                            }
                        });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        Fake {
            addr,
            accepts,
            requests,
        }
    }

    /// A node that answers everything but `getSlot`, which `get_slot`
    /// answers (its `result` value as JSON text).
    fn node(
        get_slot: impl Fn() -> String + Send + Sync + 'static,
    ) -> impl Fn(&str) -> String + Send + Sync + 'static {
        move |method| {
            let result = match method {
                "getIdentity" => r#"{"identity":"Node1111"}"#.to_string(),
                "getEpochInfo" => r#"{"absoluteSlot":100,"slotIndex":100,"slotsInEpoch":432000}"#.to_string(),
                "getLeaderSchedule" => r#"{"Node1111":[0,1,2,3,100,101,102,103]}"#.to_string(),
                "getSlot" => get_slot(),
                _ => "null".to_string(),
            };
            format!(r#"{{"jsonrpc":"2.0","result":{result},"id":1}}"#)
        }
    }

    #[tokio::test]
    async fn calls_share_one_kept_alive_connection_and_keep_the_urls_path() {
        let f = fake(|_| r#"{"jsonrpc":"2.0","result":5,"id":1}"#.into()).await;
        let rpc = Rpc::new(RpcEndpoint::parse(&format!("http://{}/rpc/v1", f.addr)).unwrap());
        for _ in 0..20 {
            assert_eq!(rpc.call::<u64>("getSlot", json!([])).await.unwrap(), 5);
        }
        assert_eq!(
            f.accepts.load(Ordering::Relaxed),
            1,
            "one connection for 20 calls"
        );
        let requests = f.requests.lock().unwrap();
        assert_eq!(requests.len(), 20);
        assert!(
            requests
                .iter()
                .all(|(path, m)| path == "/rpc/v1" && m == "getSlot"),
            "{requests:?}"
        );
    }

    /// A raw server: answers each connection's first request with `head`
    /// and then `body` written in pieces, as long as the client reads.
    async fn raw(head: String, body: Vec<Vec<u8>>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                let (head, body) = (head.clone(), body.clone());
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = stream.read(&mut buf).await;
                    if stream.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    for piece in body {
                        if stream.write_all(&piece).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_huge_answer_is_refused_without_being_read_whole() {
        // 50 MB announced, 1 MiB pieces written while the client reads.
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 50000000\r\n\r\n".to_string();
        let addr = raw(head, vec![vec![b' '; 1 << 20]; 48]).await;
        let rpc = Rpc::new(RpcEndpoint::parse(&format!("http://{addr}")).unwrap());
        let t = std::time::Instant::now();
        let e = rpc
            .call::<u64>("getSlot", json!([]))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than 65536 bytes"), "{e}");
        assert!(t.elapsed() < CALL_TIMEOUT, "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_chunked_answer_is_read() {
        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_string();
        let (a, b) = (r#"{"jsonrpc":"2.0","#, r#""result":7,"id":1}"#);
        let body = format!("{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n", a.len(), b.len());
        let addr = raw(head, vec![body.into_bytes()]).await;
        let rpc = Rpc::new(RpcEndpoint::parse(&format!("http://{addr}")).unwrap());
        assert_eq!(rpc.call::<u64>("getSlot", json!([])).await.unwrap(), 7);
    }

    #[tokio::test]
    async fn an_answer_of_the_wrong_type_is_said_in_a_few_hundred_bytes() {
        let pad = "x".repeat(20_000);
        let f = fake(move |_| format!(r#"{{"jsonrpc":"2.0","result":"123","pad":"{pad}","id":1}}"#)).await;
        let e = get_slot_error(&f).await;
        assert!(e.contains("wrong shape") && e.contains("invalid type"), "{e}");
        assert!(e.len() < 500, "{} bytes: {e}", e.len());
        let f = fake(|_| "HTTP/1.1 oops".repeat(10_000)).await;
        let e = get_slot_error(&f).await;
        assert!(e.len() < 500, "{} bytes: {e}", e.len());
    }

    /// The error a getSlot call to `f` ends in.
    async fn get_slot_error(f: &Fake) -> String {
        let rpc = Rpc::new(RpcEndpoint::parse(&format!("http://{}", f.addr)).unwrap());
        rpc.call::<u64>("getSlot", json!([]))
            .await
            .unwrap_err()
            .to_string()
    }

    fn shared_log() -> SharedSlotLog {
        Arc::new(Mutex::new(super::super::SlotLog::default()))
    }

    #[tokio::test]
    async fn a_getslot_of_the_wrong_type_is_said_once_with_its_reason_and_backed_off() {
        let f = fake(node(|| r#""123""#.into())).await;
        let log = shared_log();
        let ep = RpcEndpoint::parse(&format!("http://{}", f.addr)).unwrap();
        let _ = tokio::time::timeout(Duration::from_millis(3500), follow(ep, log.clone())).await;
        let l = log.lock().unwrap();
        let said: Vec<&String> = l
            .warnings
            .iter()
            .filter(|w| w.contains("answers with no slots"))
            .collect();
        assert_eq!(said.len(), 1, "{:?}", l.warnings);
        assert!(
            said[0].contains("getSlot: an answer of the wrong shape"),
            "{}",
            said[0]
        );
        assert!(!l.healthy);
        let polls = f.calls("getSlot");
        // Backoff 100, 200, 400, 800, 1600 ms: 5 or 6 tries in 3.5 s
        // (every 100 ms would be 35).
        assert!((3..=7).contains(&polls), "{polls} getSlot calls in 3.5 s");
    }

    /// How a fake websocket misbehaves once it has shaken hands.
    #[derive(Clone, Copy)]
    enum Ws {
        Silent,
        Garbage,
        /// A binary frame announcing 2^62 bytes.
        HugeFrame,
        /// Well-formed slot notifications as fast as the socket takes them.
        Flood,
    }

    /// A websocket server that misbehaves as `how` on every connection.
    async fn fake_ws(how: Ws) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                        return;
                    };
                    match how {
                        Ws::Silent => tokio::time::sleep(Duration::from_secs(3600)).await,
                        Ws::Garbage => {
                            let _ = ws.send("garbage{".into()).await;
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                        }
                        Ws::HugeFrame => {
                            let mut header = vec![0x82u8, 0x7f];
                            header.extend((1u64 << 62).to_be_bytes());
                            let _ = ws.get_mut().write_all(&header).await;
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                        }
                        Ws::Flood => {
                            for slot in 1_000u64.. {
                                let n = format!(
                                    r#"{{"jsonrpc":"2.0","method":"slotNotification","params":{{"result":{{"parent":{},"root":0,"slot":{slot}}},"subscription":0}}}}"#,
                                    slot - 1
                                );
                                if ws.send(n.into()).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        addr
    }

    /// An endpoint whose HTTP RPC is `http` and whose websocket is `ws`.
    fn endpoint(http: SocketAddr, ws: SocketAddr) -> RpcEndpoint {
        let mut ep = RpcEndpoint::parse(&format!("http://{http}")).unwrap();
        ep.ws = format!("ws://{ws}");
        ep
    }

    #[tokio::test]
    async fn case_4_a_silent_garbled_or_oversized_websocket_falls_back_to_getslot_polling() {
        for (how, name, wait) in [
            (Ws::Garbage, "garbage", 1500),
            (Ws::HugeFrame, "a 2^62-byte frame", 1500),
            (Ws::Silent, "silence", 1500 + WS_SILENCE.as_millis() as u64),
        ] {
            let f = fake(node(|| "100".into())).await;
            let ws = fake_ws(how).await;
            let log = shared_log();
            let _ = tokio::time::timeout(
                Duration::from_millis(wait),
                follow(endpoint(f.addr, ws), log.clone()),
            )
            .await;
            let l = log.lock().unwrap();
            let said: Vec<&String> = l
                .warnings
                .iter()
                .filter(|w| w.contains("websocket failed"))
                .collect();
            assert_eq!(said.len(), 1, "{name}: {:?}", l.warnings);
            assert!(f.calls("getSlot") > 0, "{name}: getSlot never polled");
            assert_eq!(l.starts.iter().map(|s| s.0).collect::<Vec<_>>(), [100], "{name}");
            assert!(l.healthy, "{name}");
        }
    }

    #[test]
    fn case_3_a_flood_of_notifications_is_dropped_past_one_a_millisecond_and_stop_is_prompt() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (http, ws) =
            runtime.block_on(async { (fake(node(|| "100".into())).await.addr, fake_ws(Ws::Flood).await) });
        // The fakes run on a runtime of their own thread; the follower on
        // its own, as in a session.
        let serve = std::thread::spawn(move || {
            runtime.block_on(async { tokio::time::sleep(Duration::from_secs(4)).await })
        });
        let log = shared_log();
        let (ep, l) = (endpoint(http, ws), log.clone());
        let mut source = crate::background::Background::spawn("slots", move || follow(ep, l)).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        let t = std::time::Instant::now();
        source.abort();
        let stop = t.elapsed();
        assert!(
            stop < Duration::from_secs(1),
            "the slot thread held stop for {stop:?}"
        );
        let l = log.lock().unwrap();
        let starts = l.starts.len();
        // One a millisecond at most (in 1.5 s, a few connection set-ups less).
        assert!(
            (10..=1_600).contains(&starts),
            "{starts} slots taken from a flood in 1.5 s"
        );
        assert!(l
            .starts
            .windows(2)
            .all(|w| w[1].0 > w[0].0 && w[1].1 - w[0].1 >= super::super::MIN_SLOT_NS));
        drop(l);
        let _ = serve.join();
    }

    #[tokio::test]
    async fn getslot_is_polled_no_faster_than_every_20_ms_on_one_connection() {
        let t0 = std::time::Instant::now();
        // A slot every 400 ms.
        let f = fake(node(move || (1000 + t0.elapsed().as_millis() / 400).to_string())).await;
        let log = shared_log();
        let ep = RpcEndpoint::parse(&format!("http://{}", f.addr)).unwrap();
        let _ = tokio::time::timeout(Duration::from_millis(1500), follow(ep, log.clone())).await;
        let polls = f.calls("getSlot");
        assert!(
            (10..=1500 / 20 + 2).contains(&polls),
            "{polls} getSlot calls in 1.5 s"
        );
        assert_eq!(
            f.accepts.load(Ordering::Relaxed),
            1,
            "connections for {polls} calls"
        );
        let l = log.lock().unwrap();
        assert!(l.starts.len() >= 3, "{:?}", l.starts);
        assert!(l.healthy && l.warnings.is_empty(), "{:?}", l.warnings);
    }
}
