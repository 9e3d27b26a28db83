#!/bin/bash
# A/B of slotprof builds' per-probe cost on the real node under load:
# probe-ab.sh SECONDS ROUNDS "LABEL=BIN [ARGS]" ... ; interleaved, same node.
set -u
secs=$1; rounds=$2; shift 2
. "$(dirname "$0")/node.sh"
start_node ab $(( (secs + 15) * rounds * $# + 60 ))
sleep 20
for r in $(seq $rounds); do
  for spec in "$@"; do
    label=${spec%%=*}; cmd=${spec#*=}; bin=${cmd%% *}; extra=""; [ "$bin" != "$cmd" ] && extra=${cmd#* }
    out=$d/out-$r-$label
    $bin attach --pid $node --duration ${secs}s --probe-stats --slot-source clock=400ms $extra --out $out > /dev/null 2> $out.err
    python3 - "$out" "$label" <<'PY'
import json,sys
s=json.load(open(sys.argv[1]+'/summary.json'))
pc=s.get('probe_cost') or {}
progs=sorted(pc.get('programs',[]),key=lambda p:-p.get('total_ns',0))
print(sys.argv[2], 'machine%', pc.get('cpu_percent'))
for p in progs[:6]:
    print('   ', {k:p[k] for k in p if k in ('program','runs','avg_ns','total_ns')})
u=s.get('unwinding') or {}
src=u.get('sources') or {}
print('    copies: exit', u.get('kernel_copies_at_syscall_exit'), 'switch_out', u.get('kernel_copies_at_switch_out'), 'samples', u.get('kernel_copies_for_samples'), 'repeats', u.get('kernel_exit_repeats'), 'folded', u.get('kernel_offcpu_folded'), 'bytes', src.get('copy_bytes'), 'copies', src.get('copies'), 'waker_used', src.get('waker_copies_used'))
print('    slots/s', len(s.get('slots',[])) if isinstance(s.get('slots'),list) else None)
PY
  done
done
