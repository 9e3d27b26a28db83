#!/bin/bash
# heaptrack on `slotprof run` (shipped config) following the real node under
# 100 tx/s for MINUTES; RSS sampled every 30 s.  heap-run.sh SLOTPROF MINUTES OUTDIR
set -u
sp=$1; mins=$2; out=$3; mkdir -p $out
V=${SLOTPROF_VALIDATOR:?set SLOTPROF_VALIDATOR to the solana-test-validator binary (cargo xtask validator unpacks it)}
L=${SLOTPROF_LOADGEN:?set SLOTPROF_LOADGEN to the tests/loadgen binary (cargo xtask test builds it)}
d=$(mktemp -d /tmp/heap.XXXXXX)
cp $V $d/solana-test-validator
$d/solana-test-validator --ledger $d/ledger --reset --quiet --rpc-port 18899 --faucet-port 19900 --gossip-port 18000 --dynamic-port-range 18001-18100 > $d/node.log 2>&1 &
node=$!
trap 'kill $node $load $hp 2>/dev/null; wait 2>/dev/null; rm -rf $d' EXIT
for i in $(seq 60); do curl -s -X POST -H 'content-type: application/json' -d '{"jsonrpc":"2.0","id":1,"method":"getSlot"}' http://127.0.0.1:18899 | grep -q result && break; sleep 1; done
$L --url http://127.0.0.1:18899 --rate 100 --seconds $(( mins * 60 + 120 )) --report $d/load.json > /dev/null 2>&1 &
load=$!
$sp run --print-config | sed -e 's|^comm = .*|comm = "solana-test-validator"|' -e 's|^source = .*|source = "rpc=http://127.0.0.1:18899"|' -e "s|^dir = .*|dir = \"$d/export\"|" -e 's|^listen = .*|listen = "127.0.0.1:18440"|' > $out/config.toml
sleep 10
${HEAPTRACK:-heaptrack} -o $out/heap $sp run --config $out/config.toml > $out/run.out 2> $out/run.err &
hp=$!
sleep 5
pid=$(pgrep -f "slotprof run --config $out/config.toml" | grep -v "^$hp$" | head -1)
echo "slotprof pid $pid" > $out/rss.txt
for i in $(seq $(( mins * 2 ))); do sleep 30; echo "$((i*30)) s $(grep VmRSS /proc/$pid/status)" >> $out/rss.txt; done
kill -TERM $pid; wait $hp
