# Sourced by the scripts here: the real node of `cargo xtask validator` under
# a real client's load, on RPC port 18899.
#   start_node PREFIX LOAD_SECONDS
# sets $d (a fresh directory, removed at exit), $node and $load (pids), and
# kills them and every pid in $extra_pids at exit. The node's binary is
# copied into $d so that `pgrep`/comm find only this node.
V=${SLOTPROF_VALIDATOR:?set SLOTPROF_VALIDATOR to the solana-test-validator binary (cargo xtask validator unpacks it)}
L=${SLOTPROF_LOADGEN:?set SLOTPROF_LOADGEN to the tests/loadgen binary (cargo xtask test builds it)}
RPC=http://127.0.0.1:18899
extra_pids=""

stop_node() {
  kill $extra_pids $load $node 2>/dev/null
  # Only our children by pid: a bare `wait` would also wait for anything
  # the caller started in the background.
  for p in $extra_pids $load $node; do wait $p 2>/dev/null; done
  rm -rf "$d"
}

start_node() {
  local prefix=$1 load_secs=$2
  d=$(mktemp -d /tmp/$prefix.XXXXXX)
  cp "$V" $d/solana-test-validator
  $d/solana-test-validator --ledger $d/ledger --reset --quiet --rpc-port 18899 --faucet-port 19900 \
    --gossip-port 18000 --dynamic-port-range 18001-18100 > $d/node.log 2>&1 &
  node=$!
  load=""
  trap stop_node EXIT
  local up=""
  for _ in $(seq 60); do
    if curl -s -X POST -H 'content-type: application/json' -d '{"jsonrpc":"2.0","id":1,"method":"getSlot"}' $RPC | grep -q result; then
      up=1; break
    fi
    sleep 1
  done
  if [ -z "$up" ]; then
    echo "the node did not answer on $RPC within 60 s: see $d/node.log (is port 18899 taken?)" >&2
    tail -5 $d/node.log >&2
    exit 1
  fi
  "$L" --url $RPC --rate 100 --seconds "$load_secs" --report $d/load.json > /dev/null 2>&1 &
  load=$!
}
