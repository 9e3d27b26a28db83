#!/bin/bash
# Where `slotprof run`'s own CPU goes on the real node: run as shipped
# (pointed at the node by name) for WARMUP seconds, then `perf record
# --call-graph dwarf` on it for SECONDS; prints its CPU over the window
# and the inclusive share of its top functions (slotprof's own frames).
#   prof-run.sh SLOTPROF WARMUP SECONDS OUTDIR
set -u
sp=$1; warm=$2; secs=$3; out=$4; mkdir -p $out
. "$(dirname "$0")/node.sh"
start_node prof $(( warm + secs + 90 ))
$sp run --print-config | sed -e 's|^comm = .*|comm = "solana-test-validator"|' -e 's|^source = .*|source = "rpc=http://127.0.0.1:18899"|' -e "s|^dir = .*|dir = \"$d/export\"|" -e 's|^listen = .*|listen = "127.0.0.1:18440"|' > $out/config.toml
sleep 10
$sp run --config $out/config.toml > $out/run.out 2> $out/run.err &
pid=$!
extra_pids=$pid
sleep $warm
t0=$(awk '{print $14+$15}' /proc/$pid/stat)
perf record -q -F 499 --call-graph dwarf,16384 -p $pid -o $out/perf.data -- sleep $secs 2> $out/perf.err
t1=$(awk '{print $14+$15}' /proc/$pid/stat)
echo "slotprof CPU over the window (perf running): $(( (t1 - t0) * 100 / $(getconf CLK_TCK) / secs ))% of one CPU (ticks $((t1 - t0)))" | tee $out/cpu.txt
grep VmRSS /proc/$pid/status | tee -a $out/cpu.txt
kill -TERM $pid; wait $pid
perf report -i $out/perf.data --no-inline --children --sort symbol --stdio -q --percent-limit 2 -g none 2>/dev/null \
  | grep -v '^$' | head -60 > $out/children.txt
perf report -i $out/perf.data --no-inline --sort comm --stdio -q -g none 2>/dev/null | head -12 > $out/threads.txt
cat $out/threads.txt $out/children.txt
