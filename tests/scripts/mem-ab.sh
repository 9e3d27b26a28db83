#!/bin/bash
# Two attaches at once on the real node under load (old and new build), max RSS of each.
set -u
secs=$1; old=$2; new=$3
V=${SLOTPROF_VALIDATOR:?set SLOTPROF_VALIDATOR to the solana-test-validator binary (cargo xtask validator unpacks it)}
L=${SLOTPROF_LOADGEN:?set SLOTPROF_LOADGEN to the tests/loadgen binary (cargo xtask test builds it)}
d=$(mktemp -d /tmp/mem.XXXXXX)
cp $V $d/solana-test-validator
$d/solana-test-validator --ledger $d/ledger --reset --quiet --rpc-port 18899 --faucet-port 19900 --gossip-port 18000 --dynamic-port-range 18001-18100 > $d/node.log 2>&1 &
node=$!
trap 'kill $node $load 2>/dev/null; wait 2>/dev/null; rm -rf $d' EXIT
for i in $(seq 60); do curl -s -X POST -H 'content-type: application/json' -d '{"jsonrpc":"2.0","id":1,"method":"getSlot"}' http://127.0.0.1:18899 | grep -q result && break; sleep 1; done
$L --url http://127.0.0.1:18899 --rate 100 --seconds $(( secs + 60 )) --report $d/load.json > /dev/null 2>&1 &
load=$!
sleep 15
/usr/bin/time -f "old maxrss %M KiB" $old attach --pid $node --duration ${secs}s --slot-source clock=400ms --out $d/old > /dev/null 2> $d/old.err &
a=$!
/usr/bin/time -f "new maxrss %M KiB" $new attach --pid $node --duration ${secs}s --slot-source clock=400ms --out $d/new > /dev/null 2> $d/new.err &
b=$!
wait $a $b
tail -1 $d/old.err; tail -1 $d/new.err
python3 -c "
import json
for m in ('old','new'):
    s=json.load(open('$d/'+m+'/summary.json'))
    print(m, 'counts', s.get('counts'))
"
