//! What became of this node's leader slots, from its own RPC: the block's
//! transactions and compute units (`getBlock`), or that the slot was
//! skipped. `slotprof run` fetches them as leader slots end, within a
//! request budget, and appends them to `hours/<hour>/outcomes.jsonl`,
//! where `slotprof explain --blocks` reads them (the incident judged a
//! block small below 7,000,000 compute units).
//!
//! The node's answers are checked like any outside input: an answer of
//! the wrong shape is counted as failed and quoted, never trusted.

use std::{
    collections::VecDeque,
    io::Write,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::rpc::{quote, Rpc, RpcEndpoint};

/// One leader slot's block, as the node's RPC told it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockOutcome {
    pub slot: u64,
    /// Where it came from (`rpc getBlock`).
    pub source: String,
    /// No block: the slot was skipped.
    pub skipped: bool,
    /// Transactions in the block, votes included.
    #[serde(default)]
    pub transactions: Option<u64>,
    /// The block's compute units: the sum of its transactions'
    /// `computeUnitsConsumed` (None when the node gave none).
    #[serde(default)]
    pub compute_units: Option<u64>,
}

/// Where the block's `getBlock` answer is read from.
pub const SOURCE: &str = "rpc getBlock";

/// `getBlock` answers: "Block not available for slot" (-32004: not yet
/// confirmed, ask again), skipped (-32007; -32009: skipped or gone from
/// long-term storage).
const NOT_AVAILABLE: i64 = -32004;
const SKIPPED: [i64; 2] = [-32007, -32009];

/// The outcome in a `getBlock` answer; `Ok(None)`: not available yet.
pub fn outcome_from_answer(slot: u64, body: &[u8]) -> anyhow::Result<Option<BlockOutcome>> {
    #[derive(Deserialize)]
    struct Reply {
        result: Option<Value>,
        error: Option<Value>,
    }
    let reply: Reply = serde_json::from_slice(body).map_err(|e| {
        anyhow::anyhow!(
            "getBlock {slot}: an answer of the wrong shape ({e}): {}",
            quote(body)
        )
    })?;
    if let Some(e) = reply.error {
        let code = e.get("code").and_then(Value::as_i64);
        return match code {
            Some(c) if SKIPPED.contains(&c) => Ok(Some(BlockOutcome {
                slot,
                source: SOURCE.into(),
                skipped: true,
                transactions: None,
                compute_units: None,
            })),
            Some(NOT_AVAILABLE) => Ok(None),
            _ => anyhow::bail!("getBlock {slot}: error {}", quote(e.to_string().as_bytes())),
        };
    }
    let Some(block) = reply.result else {
        return Ok(None);
    };
    let txs = block
        .get("transactions")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "getBlock {slot}: no `transactions` list in {}",
                quote(block.to_string().as_bytes())
            )
        })?;
    let units: Vec<u64> = txs
        .iter()
        .filter_map(|t| t.get("meta")?.get("computeUnitsConsumed")?.as_u64())
        .collect();
    Ok(Some(BlockOutcome {
        slot,
        source: SOURCE.into(),
        skipped: false,
        transactions: Some(txs.len() as u64),
        compute_units: (!units.is_empty() || txs.is_empty()).then(|| units.iter().sum()),
    }))
}

/// What the fetcher did (for the summary and the metrics).
#[derive(Debug, Default)]
pub struct BlockCounts {
    pub fetched: AtomicU64,
    pub skipped: AtomicU64,
    /// Calls that failed or answers refused (after the retries).
    pub failed: AtomicU64,
    /// Slots not asked for: the queue was full (the RPC slower than the
    /// budget), the block never became available, or the target exited
    /// before their blocks were confirmed.
    pub dropped: AtomicU64,
    /// Slots queued and not yet done.
    pub pending: AtomicU64,
}

/// At most this many `getBlock` calls a second: the budget (the node
/// serves its own RPC; a leader makes 4 blocks per window).
pub const CALLS_PER_S: u64 = 4;
/// Slots waiting to be asked for at most.
pub const QUEUE: usize = 1024;
/// A block is asked for this long after its slot ended (confirmation),
/// and again every second while not available, at most this many times.
const FIRST_ASK: Duration = Duration::from_secs(2);
const TRIES: u32 = 10;
/// A block's answer is read up to this size (a mainnet block with its
/// transactions' meta, logs included, is a few MB).
const BLOCK_ANSWER: usize = 64 << 20;

/// The handle `run` feeds leader slots to; the fetching is a task of its
/// own, which never blocks the profiling.
pub struct Fetcher {
    tx: Option<tokio::sync::mpsc::Sender<(u64, tokio::time::Instant)>>,
    pub counts: Arc<BlockCounts>,
    task: tokio::task::JoinHandle<()>,
}

impl Fetcher {
    /// Starts fetching into `export_dir/hours/<hour>/outcomes.jsonl`.
    pub fn start(ep: RpcEndpoint, export_dir: PathBuf) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
        let counts = Arc::new(BlockCounts::default());
        let task = tokio::spawn(fetch(Rpc::new(ep), export_dir, rx, counts.clone()));
        Self {
            tx: Some(tx),
            counts,
            task,
        }
    }

    /// No more slots: the ones queued are fetched, for up to `within`
    /// (their blocks confirm seconds after the slot); the rest are counted
    /// as not asked. Returns the summary line.
    pub async fn finish(mut self, within: Duration) -> String {
        self.tx = None;
        if tokio::time::timeout(within, &mut self.task).await.is_err() {
            self.task.abort();
            let left = self.counts.pending.swap(0, Ordering::Relaxed);
            self.counts.dropped.fetch_add(left, Ordering::Relaxed);
        }
        self.summary()
    }

    /// A leader slot ended: ask for its block (never waits; a full queue
    /// drops it, counted).
    pub fn ended(&self, slot: u64) {
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.try_send((slot, tokio::time::Instant::now())).is_ok());
        if sent {
            self.counts.pending.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A leader slot whose block is not asked for (its boundaries were
    /// guessed, not from the slot source: its number may not be the
    /// node's): counted, so that every exported leader slot is accounted.
    pub fn not_asked(&self) {
        self.counts.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// One line for the log.
    pub fn summary(&self) -> String {
        let c = &self.counts;
        format!(
            "block outcomes from the RPC: {} blocks, {} skipped slots, {} failed, {} not asked",
            c.fetched.load(Ordering::Relaxed),
            c.skipped.load(Ordering::Relaxed),
            c.failed.load(Ordering::Relaxed),
            c.dropped.load(Ordering::Relaxed)
        )
    }
}

impl Drop for Fetcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn fetch(
    rpc: Rpc,
    dir: PathBuf,
    mut rx: tokio::sync::mpsc::Receiver<(u64, tokio::time::Instant)>,
    counts: Arc<BlockCounts>,
) {
    // (slot, when to ask, tries so far), in due order.
    let mut due: VecDeque<(u64, tokio::time::Instant, u32)> = VecDeque::new();
    let gap = Duration::from_millis(1000 / CALLS_PER_S);
    let mut warned = false;
    loop {
        while let Ok((slot, ended)) = rx.try_recv() {
            due.push_back((slot, ended + FIRST_ASK, 0));
        }
        let Some(&(slot, at, tries)) = due.front() else {
            match rx.recv().await {
                Some((slot, ended)) => {
                    due.push_back((slot, ended + FIRST_ASK, 0));
                    continue;
                }
                None => return,
            }
        };
        tokio::time::sleep_until(at).await;
        due.pop_front();
        // "full": only it carries each transaction's computeUnitsConsumed
        // ("accounts" and "signatures" leave it out; checked on Agave
        // 4.4.0); base64 keeps the transactions themselves small.
        let params = json!([slot, {
            "encoding": "base64",
            "transactionDetails": "full",
            "rewards": false,
            "maxSupportedTransactionVersion": 0,
            "commitment": "confirmed",
        }]);
        // Unreachable or silent (the node restarting): asked again, like a
        // block not yet available; an answer of the wrong shape is not.
        let (answer, retry) = match rpc.call_raw("getBlock", params, BLOCK_ANSWER).await {
            Ok(body) => (outcome_from_answer(slot, &body), false),
            Err(e) => (Err(e), true),
        };
        let retry = retry || matches!(answer, Ok(None));
        match answer {
            Ok(Some(o)) => {
                let c = if o.skipped {
                    &counts.skipped
                } else {
                    &counts.fetched
                };
                c.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = append(&dir, &o) {
                    counts.failed.fetch_add(1, Ordering::Relaxed);
                    if !warned {
                        eprintln!("slotprof: warning: block outcomes: {e:#} (said once)");
                        warned = true;
                    }
                }
            }
            _ if retry && tries + 1 < TRIES => {
                let again = tokio::time::Instant::now() + Duration::from_secs(1);
                let at = due.partition_point(|d| d.1 <= again);
                due.insert(at, (slot, again, tries + 1));
                tokio::time::sleep(gap).await;
                continue;
            }
            Ok(None) => {
                counts.dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
                if !warned {
                    eprintln!("slotprof: warning: block outcomes: {e:#} (said once; counted in the summary)");
                    warned = true;
                }
            }
        }
        counts.pending.fetch_sub(1, Ordering::Relaxed);
        tokio::time::sleep(gap).await;
    }
}

/// Appends `o` to this hour's `outcomes.jsonl`.
fn append(dir: &std::path::Path, o: &BlockOutcome) -> anyhow::Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs() as i64;
    let hour = dir.join("hours").join(crate::output::hour_name(now));
    std::fs::create_dir_all(&hour).map_err(|e| anyhow::anyhow!("cannot create {}: {e}", hour.display()))?;
    let path = hour.join(OUTCOMES_FILE);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    let mut line = serde_json::to_vec(o)?;
    line.push(b'\n');
    f.write_all(&line)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
}

/// The file name of each hour's outcomes.
pub const OUTCOMES_FILE: &str = "outcomes.jsonl";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_skipped_not_yet_and_refused_answer() {
        let ok = br#"{"jsonrpc":"2.0","id":1,"result":{"blockHeight":5,"transactions":[
            {"meta":{"computeUnitsConsumed":2100,"fee":5000}},
            {"meta":{"computeUnitsConsumed":150,"fee":5000}},
            {"meta":{"fee":5000}}]}}"#;
        let o = outcome_from_answer(7, ok).unwrap().unwrap();
        assert_eq!(
            (o.skipped, o.transactions, o.compute_units, o.source.as_str()),
            (false, Some(3), Some(2250), SOURCE)
        );
        // An empty block has 0 units; a block whose meta has no units, none known.
        let empty = br#"{"jsonrpc":"2.0","id":1,"result":{"transactions":[]}}"#;
        assert_eq!(
            outcome_from_answer(7, empty).unwrap().unwrap().compute_units,
            Some(0)
        );
        let no_units = br#"{"jsonrpc":"2.0","id":1,"result":{"transactions":[{"meta":{}}]}}"#;
        assert_eq!(
            outcome_from_answer(7, no_units).unwrap().unwrap().compute_units,
            None
        );
        for code in [-32007, -32009] {
            let skipped = format!(
                r#"{{"jsonrpc":"2.0","id":1,"error":{{"code":{code},"message":"Slot 7 was skipped"}}}}"#
            );
            assert!(
                outcome_from_answer(7, skipped.as_bytes())
                    .unwrap()
                    .unwrap()
                    .skipped
            );
        }
        let later =
            br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32004,"message":"Block not available for slot 7"}}"#;
        assert_eq!(outcome_from_answer(7, later).unwrap(), None);
        assert_eq!(
            outcome_from_answer(7, br#"{"jsonrpc":"2.0","id":1,"result":null}"#).unwrap(),
            None
        );
        // Hostile or broken answers are errors that quote what came.
        for bad in [
            &br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32600,"message":"nope"}}"#[..],
            br#"{"jsonrpc":"2.0","id":1,"result":{"transactions":5}}"#,
            b"<html>502</html>",
        ] {
            let e = outcome_from_answer(7, bad).unwrap_err().to_string();
            assert!(e.starts_with("getBlock 7:"), "{e}");
        }
    }

    #[test]
    fn outcomes_round_trip_as_lines() {
        let o = BlockOutcome {
            slot: 9,
            source: SOURCE.into(),
            skipped: false,
            transactions: Some(4),
            compute_units: Some(7_000_001),
        };
        let line = serde_json::to_string(&o).unwrap();
        assert_eq!(serde_json::from_str::<BlockOutcome>(&line).unwrap(), o);
    }
}
