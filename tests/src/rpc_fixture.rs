//! A loopback stand-in for a validator's JSON-RPC: `getSlot`,
//! `getEpochInfo`, `getIdentity`, `getLeaderSchedule` over HTTP on `port`
//! and `slotSubscribe` over a websocket on `port + 1` (Agave's 8899/8900
//! layout), in the response shapes Agave uses. The program that owns it
//! drives it with [`RpcFixture::set_slot`], so its slots and the ones it
//! reports come from one clock.

use std::{
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{broadcast, oneshot},
};

/// What the fixture says about the chain and this node.
#[derive(Clone, Debug)]
pub struct ChainConfig {
    /// This node's identity (base58 pubkey text).
    pub identity: String,
    pub slots_in_epoch: u64,
    /// This node leads the first `leader.0` slots of every `leader.1`,
    /// counted from the epoch's first slot.
    pub leader: (u64, u64),
}

/// A way for the fixture's HTTP answers to go wrong (the fault soak).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    #[default]
    None,
    /// Every result is the string "123".
    WrongTypes,
    /// Every answer announces 50 MB and sends it while the client reads.
    Huge,
}

/// A way for the fixture's websocket to misbehave (the fault soak), from
/// the moment it is set, on every subscription.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WsFault {
    #[default]
    None,
    /// Connected, but no notification is sent.
    Silent,
    /// A message that is not JSON in place of each notification.
    Garbage,
    /// Each notification sent 2,000 times over (the same slot: a flood
    /// that does not move the node's numbering).
    Flood,
    /// A binary frame announcing 2^62 bytes, then nothing.
    HugeFrame,
    /// The connection closed at the next notification.
    Close,
}

/// The running fixture; dropping it (or [`RpcFixture::stop`]) closes every
/// socket.
pub struct RpcFixture {
    fault: Arc<Mutex<Fault>>,
    ws_fault: Arc<Mutex<WsFault>>,
    slot: Arc<Mutex<u64>>,
    slots: broadcast::Sender<u64>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl RpcFixture {
    /// Listens on 127.0.0.1:`port` (HTTP) and `port + 1` (websocket).
    pub fn start(port: u16, chain: ChainConfig, first_slot: u64) -> std::io::Result<Self> {
        let http = std::net::TcpListener::bind(("127.0.0.1", port))?;
        let ws = std::net::TcpListener::bind(("127.0.0.1", port + 1))?;
        http.set_nonblocking(true)?;
        ws.set_nonblocking(true)?;
        let slot = Arc::new(Mutex::new(first_slot));
        let fault = Arc::new(Mutex::new(Fault::None));
        let ws_fault = Arc::new(Mutex::new(WsFault::None));
        let (slots, _) = broadcast::channel(64);
        let (stop_tx, stop_rx) = oneshot::channel();
        let (s2, tx2, f2, w2) = (slot.clone(), slots.clone(), fault.clone(), ws_fault.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let http = TcpListener::from_std(http).unwrap();
                let ws = TcpListener::from_std(ws).unwrap();
                tokio::select! {
                    _ = serve_http(http, chain, s2, f2) => {}
                    _ = serve_ws(ws, tx2, w2) => {}
                    _ = stop_rx => {}
                }
            });
            // Dropping the runtime cancels every connection task.
        });
        Ok(Self {
            fault,
            ws_fault,
            slot,
            slots,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The node is now at `slot`: answer getSlot with it and notify
    /// subscribers.
    pub fn set_slot(&self, slot: u64) {
        *self.slot.lock().unwrap() = slot;
        let _ = self.slots.send(slot);
    }

    /// How the HTTP answers go wrong from now on.
    pub fn set_fault(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }

    /// How the websocket misbehaves from now on.
    pub fn set_ws_fault(&self, fault: WsFault) {
        *self.ws_fault.lock().unwrap() = fault;
    }

    /// Stops answering: listeners and connections close.
    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RpcFixture {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve_http(
    listener: TcpListener,
    chain: ChainConfig,
    slot: Arc<Mutex<u64>>,
    fault: Arc<Mutex<Fault>>,
) {
    while let Ok((stream, _)) = listener.accept().await {
        let (chain, slot, fault) = (chain.clone(), slot.clone(), fault.clone());
        tokio::spawn(async move {
            let fault = *fault.lock().unwrap();
            let _ = handle_http(stream, &chain, &slot, fault).await;
        });
    }
}

async fn handle_http(
    mut stream: TcpStream,
    chain: &ChainConfig,
    slot: &Mutex<u64>,
    fault: Fault,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let body_start = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..body_start]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < body_start + len {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = &buf[body_start..(body_start + len).min(buf.len())];
    let reply = match serde_json::from_slice::<Value>(body) {
        Ok(req) => answer(&req, chain, *slot.lock().unwrap()),
        Err(_) => json!({"jsonrpc": "2.0", "error": {"code": -32700, "message": "Parse error"}, "id": null}),
    };
    let text = match fault {
        Fault::None => reply.to_string(),
        Fault::WrongTypes => json!({"jsonrpc": "2.0", "result": "123", "id": 1}).to_string(),
        Fault::Huge => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\nConnection: close\r\n\r\n";
            stream.write_all(head.as_bytes()).await?;
            let piece = vec![b' '; 1 << 20];
            for _ in 0..48 {
                stream.write_all(&piece).await?;
            }
            return stream.shutdown().await;
        }
    };
    let resp = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    stream.write_all(resp.as_bytes()).await?;
    stream.shutdown().await
}

/// The block the fixture serves for `slot`: (transactions, compute units).
pub fn block_of(slot: u64) -> (u64, u64) {
    let txs = slot % 5 + 1;
    (txs, txs * 1000)
}

/// The JSON-RPC answer to one request, in Agave's shapes.
pub fn answer(req: &Value, chain: &ChainConfig, slot: u64) -> Value {
    let id = req.get("id").cloned().unwrap_or(Value::Null);
    let epoch = slot / chain.slots_in_epoch;
    let epoch_start = epoch * chain.slots_in_epoch;
    let result = match req.get("method").and_then(Value::as_str) {
        Some("getSlot") => json!(slot),
        Some("getIdentity") => json!({"identity": chain.identity}),
        Some("getEpochInfo") => json!({
            "absoluteSlot": slot,
            "blockHeight": slot - slot / 20,
            "epoch": epoch,
            "slotIndex": slot - epoch_start,
            "slotsInEpoch": chain.slots_in_epoch,
            "transactionCount": slot * 1000,
        }),
        // A block per slot up to the current one, of (slot % 5) + 1
        // transactions, each of 1000 compute units (what `block_of` says).
        Some("getBlock") => {
            let want = req["params"][0].as_u64().unwrap_or(u64::MAX);
            if want > slot {
                return json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32004,
                    "message": format!("Block not available for slot {want}")}});
            }
            let (txs, _) = block_of(want);
            let txs: Vec<Value> = (0..txs)
                .map(|_| json!({"meta": {"err": null, "fee": 5000, "computeUnitsConsumed": 1000}, "transaction": ["", "base64"]}))
                .collect();
            json!({"blockHeight": want, "parentSlot": want.saturating_sub(1), "transactions": txs})
        }
        Some("getLeaderSchedule") => {
            let (k, m) = chain.leader;
            let indices: Vec<u64> = (0..chain.slots_in_epoch).filter(|i| i % m < k).collect();
            json!({ chain.identity.clone(): indices })
        }
        _ => {
            return json!({"jsonrpc": "2.0", "error": {"code": -32601, "message": "Method not found"}, "id": id});
        }
    };
    json!({"jsonrpc": "2.0", "result": result, "id": id})
}

async fn serve_ws(listener: TcpListener, slots: broadcast::Sender<u64>, fault: Arc<Mutex<WsFault>>) {
    let mut next_sub = 0u64;
    while let Ok((stream, _)) = listener.accept().await {
        next_sub += 1;
        let (rx, sub, fault) = (slots.subscribe(), next_sub, fault.clone());
        tokio::spawn(async move {
            let _ = handle_ws(stream, rx, sub, &fault).await;
        });
    }
}

async fn handle_ws(
    stream: TcpStream,
    mut slots: broadcast::Receiver<u64>,
    sub: u64,
    fault: &Mutex<WsFault>,
) -> anyhow_free::Result<()> {
    let mut ws = tokio_tungstenite::accept_async(stream).await?;
    // Wait for slotSubscribe.
    loop {
        let Some(msg) = ws.next().await else { return Ok(()) };
        let msg = msg?;
        let Ok(req) = serde_json::from_str::<Value>(msg.to_text().unwrap_or("")) else {
            continue;
        };
        if req["method"] == "slotSubscribe" {
            let ok = json!({"jsonrpc": "2.0", "result": sub, "id": req["id"]});
            ws.send(ok.to_string().into()).await?;
            break;
        }
    }
    loop {
        tokio::select! {
            slot = slots.recv() => {
                let Ok(slot) = slot else { continue };
                let note = json!({
                    "jsonrpc": "2.0",
                    "method": "slotNotification",
                    "params": {"result": {"parent": slot.saturating_sub(1), "root": slot.saturating_sub(32), "slot": slot}, "subscription": sub},
                });
                let fault = *fault.lock().unwrap();
                match fault {
                    WsFault::None => ws.send(note.to_string().into()).await?,
                    WsFault::Silent => {}
                    WsFault::Garbage => ws.send("garbage{".into()).await?,
                    WsFault::Flood => {
                        for _ in 0..2_000 {
                            ws.feed(note.to_string().into()).await?;
                        }
                        ws.flush().await?;
                    }
                    WsFault::HugeFrame => {
                        let mut header = vec![0x82u8, 0x7f];
                        header.extend((1u64 << 62).to_be_bytes());
                        ws.get_mut().write_all(&header).await?;
                        // Nothing more: the client reads the header and
                        // gives up on the connection.
                        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
                        return Ok(());
                    }
                    WsFault::Close => return Ok(()),
                }
            }
            msg = ws.next() => {
                if !matches!(msg, Some(Ok(_))) {
                    return Ok(());
                }
            }
        }
    }
}

/// Errors of the websocket side, boxed (the fixture only logs nothing).
mod anyhow_free {
    pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
}
