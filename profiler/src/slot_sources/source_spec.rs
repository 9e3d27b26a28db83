//! `--slot-source` and `slots.source`: which source gives the slot
//! boundaries, parsed and checked (the sources themselves are in
//! `slot_sources`, the timeline they build in `slots`).

use std::{str::FromStr, time::Duration};

/// Where slot boundaries come from (`--slot-source`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotSourceSpec {
    /// `clock=400ms[,origin=NS][,leader=K/M]`: fixed-length slots from
    /// `origin` (CLOCK_MONOTONIC ns; default: session start). With
    /// `leader=K/M`, the first K slots of every M are this node's (K a
    /// multiple of 4 gives whole leader windows).
    Clock {
        slot: Duration,
        origin_ns: Option<u64>,
        leader: Option<(u64, u64)>,
    },
    /// `rpc=http://HOST:PORT`: the validator's JSON-RPC (websocket at PORT+1).
    Rpc(crate::slot_sources::rpc::RpcEndpoint),
    /// `uprobe=BINARY:FUNCTION[,slot=arg0][,rpc=http://HOST:PORT]`: a slot
    /// starts whenever the target calls FUNCTION (matched by demangled
    /// name, e.g. `PohRecorder::set_bank`). Slot numbers come from the RPC
    /// when given, from the function's first argument with `slot=arg0`,
    /// else from a counter.
    Uprobe {
        binary: std::path::PathBuf,
        function: String,
        numbers: SlotNumbers,
        rpc: Option<crate::slot_sources::rpc::RpcEndpoint>,
    },
}

/// Where a uprobe slot source takes slot numbers from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotNumbers {
    /// Counting from 0 at the first call, or matched to the RPC's slots.
    Counter,
    /// The probed function's first argument.
    FirstArgument,
}

impl SlotSourceSpec {
    /// The node's RPC endpoint, when the source has one.
    pub fn rpc(&self) -> Option<&crate::slot_sources::rpc::RpcEndpoint> {
        match self {
            SlotSourceSpec::Rpc(ep) | SlotSourceSpec::Uprobe { rpc: Some(ep), .. } => Some(ep),
            _ => None,
        }
    }
}

impl FromStr for SlotSourceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, rest) = s.split_once('=').ok_or_else(|| {
            format!("--slot-source {s:?}: expected rpc=http://127.0.0.1:8899 or clock=400ms")
        })?;
        match kind {
            "clock" => {
                let mut parts = rest.split(',');
                let slot = crate::duration::parse(parts.next().unwrap_or(""))?;
                if slot < Duration::from_millis(1) {
                    return Err(format!("--slot-source {s:?}: a slot must last at least 1ms"));
                }
                let mut origin_ns = None;
                let mut leader = None;
                for p in parts {
                    match p.split_once('=') {
                        Some(("origin", v)) => {
                            origin_ns = Some(v.parse().map_err(|_| {
                                format!("--slot-source: origin={v:?} is not a CLOCK_MONOTONIC time in ns")
                            })?)
                        }
                        Some(("leader", v)) => {
                            let (k, m) = v
                                .split_once('/')
                                .and_then(|(k, m)| Some((k.parse().ok()?, m.parse().ok()?)))
                                .filter(|&(k, m): &(u64, u64)| k <= m && m > 0)
                                .ok_or_else(|| {
                                    format!("--slot-source: leader={v:?}: expected K/M, e.g. 4/16")
                                })?;
                            leader = Some((k, m));
                        }
                        _ => {
                            return Err(format!(
                                "--slot-source: unknown clock option {p:?} (origin=NS, leader=K/M)"
                            ))
                        }
                    }
                }
                Ok(Self::Clock {
                    slot,
                    origin_ns,
                    leader,
                })
            }
            "rpc" => Ok(Self::Rpc(crate::slot_sources::rpc::RpcEndpoint::parse(rest)?)),
            "uprobe" => {
                let mut parts = rest.split(',');
                let target = parts.next().unwrap_or("");
                let (binary, function) = target
                    .split_once(':')
                    .filter(|(b, f)| !b.is_empty() && !f.is_empty())
                    .ok_or_else(|| format!("--slot-source {s:?}: expected uprobe=BINARY:FUNCTION"))?;
                let mut numbers = SlotNumbers::Counter;
                let mut rpc = None;
                for p in parts {
                    match p.split_once('=') {
                        Some(("slot", "arg0")) => numbers = SlotNumbers::FirstArgument,
                        Some(("rpc", url)) => rpc = Some(crate::slot_sources::rpc::RpcEndpoint::parse(url)?),
                        _ => {
                            return Err(format!(
                                "--slot-source: unknown uprobe option {p:?} (slot=arg0, rpc=http://HOST:PORT)"
                            ))
                        }
                    }
                }
                Ok(Self::Uprobe {
                    binary: binary.into(),
                    function: function.to_string(),
                    numbers,
                    rpc,
                })
            }
            _ => Err(format!(
                "--slot-source {s:?}: unknown source {kind:?}; use rpc=http://127.0.0.1:8899 or clock=400ms"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_clock_specs_and_explains_bad_ones() {
        assert_eq!(
            "clock=400ms".parse::<SlotSourceSpec>().unwrap(),
            SlotSourceSpec::Clock {
                slot: Duration::from_millis(400),
                origin_ns: None,
                leader: None
            }
        );
        assert_eq!(
            "clock=250ms,origin=5,leader=4/16"
                .parse::<SlotSourceSpec>()
                .unwrap(),
            SlotSourceSpec::Clock {
                slot: Duration::from_millis(250),
                origin_ns: Some(5),
                leader: Some((4, 16))
            }
        );
        assert!("clock=fast"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("30s"));
        assert!("clock=400ms,leader=5"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("K/M"));
        assert!("ntp=1"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("unknown source"));
        match "uprobe=/usr/bin/agave-validator:PohRecorder::set_bank,rpc=http://127.0.0.1:8899"
            .parse::<SlotSourceSpec>()
            .unwrap()
        {
            SlotSourceSpec::Uprobe {
                binary,
                function,
                numbers,
                rpc,
            } => {
                assert_eq!(binary, std::path::PathBuf::from("/usr/bin/agave-validator"));
                assert_eq!(function, "PohRecorder::set_bank");
                assert_eq!(numbers, SlotNumbers::Counter);
                assert_eq!(rpc.unwrap().ws, "ws://127.0.0.1:8900");
            }
            other => panic!("{other:?}"),
        }
        assert!("uprobe=/bin/x"
            .parse::<SlotSourceSpec>()
            .unwrap_err()
            .contains("BINARY:FUNCTION"));
    }

    #[test]
    fn clock_and_uprobe_options_are_checked_at_their_edges() {
        let err = |s: &str| s.parse::<SlotSourceSpec>().unwrap_err();
        assert!("clock=1ms".parse::<SlotSourceSpec>().is_ok());
        assert!(err("clock=999us").contains("at least 1ms"));
        assert!("clock=400ms,leader=4/4".parse::<SlotSourceSpec>().is_ok());
        assert!(err("clock=400ms,leader=5/4").contains("K/M"));
        assert!(err("clock=400ms,leader=0/0").contains("K/M"));
        assert!(err("clock=400ms,origin=soon").contains("origin"));
        assert!(err("clock=400ms,jitter=1").contains("unknown clock option"));
        assert!(err("uprobe=:set_bank").contains("BINARY:FUNCTION"));
        assert!(err("uprobe=/bin/x:").contains("BINARY:FUNCTION"));
        assert!(err("uprobe=/bin/x:f,slot=arg1").contains("unknown uprobe option"));
        match "uprobe=/bin/x:f,slot=arg0".parse::<SlotSourceSpec>().unwrap() {
            SlotSourceSpec::Uprobe { numbers, rpc, .. } => {
                assert_eq!(numbers, SlotNumbers::FirstArgument);
                assert!(rpc.is_none());
            }
            other => panic!("{other:?}"),
        }
    }
}
