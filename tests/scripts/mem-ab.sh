#!/bin/bash
# Two attaches at once on the real node under load (old and new build), max RSS of each.
set -u
secs=$1; old=$2; new=$3
. "$(dirname "$0")/node.sh"
start_node mem $(( secs + 60 ))
sleep 15
/usr/bin/time -f "old maxrss %M KiB" $old attach --pid $node --duration ${secs}s --slot-source clock=400ms --out $d/old > /dev/null 2> $d/old.err &
a=$!
extra_pids="$a"
/usr/bin/time -f "new maxrss %M KiB" $new attach --pid $node --duration ${secs}s --slot-source clock=400ms --out $d/new > /dev/null 2> $d/new.err &
b=$!
extra_pids="$a $b"
wait $a $b
tail -1 $d/old.err; tail -1 $d/new.err
python3 -c "
import json
for m in ('old','new'):
    s=json.load(open('$d/'+m+'/summary.json'))
    print(m, 'counts', s.get('counts'))
"
