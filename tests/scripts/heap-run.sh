#!/bin/bash
# `slotprof run` (shipped config) following the real node under 100 tx/s
# for MINUTES, RSS sampled every 30 s, under heaptrack (HEAPTRACK=none: by
# itself, for the RSS series as it is).  heap-run.sh SLOTPROF MINUTES OUTDIR
set -u
sp=$1; mins=$2; out=$3; mkdir -p $out
. "$(dirname "$0")/node.sh"
start_node heap $(( mins * 60 + 120 ))
$sp run --print-config | sed -e 's|^comm = .*|comm = "solana-test-validator"|' -e 's|^source = .*|source = "rpc=http://127.0.0.1:18899"|' -e "s|^dir = .*|dir = \"$d/export\"|" -e 's|^listen = .*|listen = "127.0.0.1:18440"|' > $out/config.toml
sleep 10
if [ "${HEAPTRACK:-heaptrack}" = none ]; then
  $sp run --config $out/config.toml > $out/run.out 2> $out/run.err &
  hp=$!
  pid=$hp
else
  ${HEAPTRACK:-heaptrack} -o $out/heap $sp run --config $out/config.toml > $out/run.out 2> $out/run.err &
  hp=$!
  sleep 5
  pid=$(pgrep -f "slotprof run --config $out/config.toml" | grep -v "^$hp$" | head -1)
fi
extra_pids=$hp
echo "slotprof pid $pid" > $out/rss.txt
for i in $(seq $(( mins * 2 ))); do
  sleep 30
  echo "$((i*30)) s $(grep VmRSS /proc/$pid/status) cpu_ticks $(awk '{print $14+$15}' /proc/$pid/stat)" >> $out/rss.txt
done
kill -TERM $pid; wait $hp
