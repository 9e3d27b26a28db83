//! Slot source `rpc=http://HOST:PORT`: the validator's own JSON-RPC.
//!
//! getIdentity, getEpochInfo and getLeaderSchedule give this node's leader
//! slots (relative indices made absolute; refetched at each new epoch);
//! slot starts come from the websocket `slotSubscribe` (PORT + 1, Agave's
//! layout), with `getSlot` polling as the fallback. When the RPC is down
//! or answers garbage, the source retries with backoff and the session
//! goes on: the slots it missed are estimated and marked unaligned, and
//! the operator is told once.

use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::{EpochSchedule, SharedSlotLog};
use crate::slots::monotonic_ns;

/// Where to reach the RPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RpcEndpoint {
    /// `host:port` of the HTTP JSON-RPC.
    pub http: String,
    /// `ws://host:port` of the websocket (HTTP port + 1).
    pub ws: String,
    /// As given, for messages.
    pub url: String,
}

impl RpcEndpoint {
    /// Parses `http://host:port`; the websocket is at port + 1.
    pub fn parse(url: &str) -> Result<Self, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("rpc={url}: give the validator's plain-HTTP RPC, e.g. rpc=http://127.0.0.1:8899 (https is not supported)")
        })?;
        let hostport = rest.split('/').next().unwrap_or(rest);
        let (host, port) = hostport
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("rpc={url}: expected http://HOST:PORT"))?;
        Ok(Self {
            http: format!("{host}:{port}"),
            ws: format!("ws://{host}:{}", port.wrapping_add(1)),
            url: url.to_string(),
        })
    }
}

/// One JSON-RPC call over HTTP/1.1; returns `result`.
async fn call(ep: &RpcEndpoint, method: &str, params: Value) -> anyhow::Result<Value> {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
    let exchange = async {
        let mut stream = TcpStream::connect(&ep.http).await?;
        let req = format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            ep.http,
            body.len()
        );
        stream.write_all(req.as_bytes()).await?;
        let mut resp = Vec::new();
        stream.read_to_end(&mut resp).await?;
        anyhow::Ok(resp)
    };
    let resp = tokio::time::timeout(Duration::from_secs(3), exchange)
        .await
        .map_err(|_| anyhow!("{method}: no answer within 3 s"))??;
    let split = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("{method}: not an HTTP response"))?;
    let status = String::from_utf8_lossy(&resp[..split]);
    if !status.starts_with("HTTP/1.1 200") && !status.starts_with("HTTP/1.0 200") {
        bail!("{method}: HTTP {}", status.lines().next().unwrap_or(""));
    }
    let v: Value = serde_json::from_slice(&resp[split + 4..])
        .with_context(|| format!("{method}: answer is not JSON"))?;
    if let Some(e) = v.get("error") {
        bail!("{method}: error {e}");
    }
    v.get("result")
        .cloned()
        .ok_or_else(|| anyhow!("{method}: answer has no result"))
}

fn u64_field(v: &Value, field: &str, method: &str) -> anyhow::Result<u64> {
    v.get(field)
        .and_then(Value::as_u64)
        .ok_or_else(|| anyhow!("{method}: no numeric `{field}` in {v}"))
}

/// This node's leader slots for the epoch holding `slot`.
async fn fetch_schedule(ep: &RpcEndpoint, identity: &str) -> anyhow::Result<EpochSchedule> {
    let info = call(ep, "getEpochInfo", json!([])).await?;
    let absolute = u64_field(&info, "absoluteSlot", "getEpochInfo")?;
    let index = u64_field(&info, "slotIndex", "getEpochInfo")?;
    let slots_in_epoch = u64_field(&info, "slotsInEpoch", "getEpochInfo")?;
    let first_slot = absolute
        .checked_sub(index)
        .ok_or_else(|| anyhow!("getEpochInfo: slotIndex > absoluteSlot"))?;
    let sched = call(ep, "getLeaderSchedule", json!([absolute, {"identity": identity}])).await?;
    let leader_slots = match sched.get(identity) {
        Some(Value::Array(idx)) => super::leader_runs(
            idx.iter()
                .filter_map(Value::as_u64)
                .filter_map(|i| first_slot.checked_add(i))
                .collect(),
        ),
        // Not a leader this epoch (or no schedule yet): no leader slots.
        _ if sched.is_null() || sched.is_object() => Vec::new(),
        _ => bail!("getLeaderSchedule: unexpected answer shape"),
    };
    Ok(EpochSchedule {
        first_slot,
        slots_in_epoch,
        leader_runs: leader_slots,
    })
}

/// Records a slot start; fetches the next epoch's schedule when it begins.
async fn saw_slot(ep: &RpcEndpoint, identity: &str, log: &SharedSlotLog, slot: u64) -> anyhow::Result<()> {
    let now = monotonic_ns();
    let known = {
        let mut l = log.lock().unwrap();
        if let Some(&(last, last_t)) = l.starts.iter().max_by_key(|s| s.1) {
            if slot > last
                && !super::plausible_advance(slot - last, now.saturating_sub(last_t))
                && !l.warnings.iter().any(|w| w.starts_with(super::JUMP_WARNING))
            {
                l.warnings.push(format!(
                    "{} from slot {last} to {slot} in {} ms: taken as a discontinuity (no slots \
                     are filled in between); said once",
                    super::JUMP_WARNING,
                    now.saturating_sub(last_t) / 1_000_000
                ));
            }
        }
        l.starts.push((slot, now));
        l.epochs.iter().any(|e| e.contains(slot))
    };
    if !known {
        let e = fetch_schedule(ep, identity).await?;
        log.lock().unwrap().epochs.push(e);
    }
    Ok(())
}

/// One connected stretch: identity, schedule, then slots until an error.
async fn connected(ep: &RpcEndpoint, log: &SharedSlotLog, healthy: &mut bool) -> anyhow::Result<()> {
    let identity = call(ep, "getIdentity", json!([])).await?;
    let identity = identity
        .get("identity")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("getIdentity: no `identity` in {identity}"))?
        .to_string();
    let schedule = fetch_schedule(ep, &identity).await?;
    {
        let mut l = log.lock().unwrap();
        if !l.epochs.contains(&schedule) {
            l.epochs.push(schedule);
        }
    }
    match tokio_tungstenite::connect_async(ep.ws.as_str()).await {
        Ok((mut ws, _)) => {
            let sub = json!({"jsonrpc": "2.0", "id": 1, "method": "slotSubscribe"});
            ws.send(sub.to_string().into()).await?;
            *healthy = true;
            while let Some(msg) = ws.next().await {
                let msg = msg?;
                let Ok(text) = msg.to_text() else { continue };
                let Ok(v) = serde_json::from_str::<Value>(text) else {
                    bail!("slotSubscribe: a message that is not JSON");
                };
                if v.get("method").and_then(Value::as_str) != Some("slotNotification") {
                    continue;
                }
                let slot = v["params"]["result"]["slot"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("slotNotification without a slot: {v}"))?;
                saw_slot(ep, &identity, log, slot).await?;
            }
            bail!("the websocket {} closed", ep.ws)
        }
        Err(_) => {
            // No websocket: poll getSlot often enough to place boundaries
            // within a few ms.
            *healthy = true;
            let mut last = None;
            loop {
                let slot = call(ep, "getSlot", json!([])).await?;
                let slot = slot
                    .as_u64()
                    .ok_or_else(|| anyhow!("getSlot: not a number: {slot}"))?;
                if last != Some(slot) {
                    saw_slot(ep, &identity, log, slot).await?;
                    last = Some(slot);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }
}

/// Follows the RPC for as long as the session runs (cancel the task to stop).
///
/// Says once if the RPC cannot be reached within the first seconds, and
/// once if it stops answering for more than a second after it worked (a
/// blip, or the validator exiting with the session, is not worth a
/// warning); retries with backoff.
pub async fn follow(ep: RpcEndpoint, log: SharedSlotLog) {
    let started = std::time::Instant::now();
    let mut outage_since: Option<std::time::Instant> = None;
    let mut backoff = Duration::from_millis(20);
    let mut ever_healthy = false;
    let (mut warned_unreachable, mut warned_stopped) = (false, false);
    loop {
        let mut healthy = false;
        let err = match connected(&ep, &log, &mut healthy).await {
            Ok(()) => continue,
            Err(e) => e,
        };
        if healthy {
            ever_healthy = true;
            backoff = Duration::from_millis(100);
            outage_since = Some(std::time::Instant::now());
        }
        let outage = outage_since.map_or(Duration::ZERO, |t| t.elapsed());
        let warning = if ever_healthy && !warned_stopped && outage > Duration::from_secs(1) {
            warned_stopped = true;
            Some(format!(
                "the slot source rpc={} stopped answering ({err}); profiling goes on, and the slots \
                 from here are estimated from the measured slot length and marked unaligned; retrying",
                ep.url
            ))
        } else if !ever_healthy && !warned_unreachable && started.elapsed() > Duration::from_secs(2) {
            warned_unreachable = true;
            Some(format!(
                "the slot source rpc={} does not answer ({err}); profiling goes on without slot \
                 boundaries until it does (is the validator's RPC enabled on that port?); retrying",
                ep.url
            ))
        } else {
            None
        };
        if let Some(w) = warning {
            eprintln!("slotprof: warning: {w}");
            log.lock().unwrap().warnings.push(w);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let e = RpcEndpoint::parse("http://127.0.0.1:8899").unwrap();
        assert_eq!(
            (e.http.as_str(), e.ws.as_str()),
            ("127.0.0.1:8899", "ws://127.0.0.1:8900")
        );
        assert!(RpcEndpoint::parse("https://x:1").unwrap_err().contains("https"));
        assert!(RpcEndpoint::parse("http://x").unwrap_err().contains("HOST:PORT"));
    }

    #[tokio::test]
    async fn a_dead_endpoint_is_an_error_not_a_hang() {
        // Port 9 on loopback: nothing listens.
        let ep = RpcEndpoint::parse("http://127.0.0.1:9").unwrap();
        assert!(call(&ep, "getSlot", json!([])).await.is_err());
    }
}
