#!/usr/bin/env python3
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
u = s["unwinding"]; src = u["sources"]
print(f"stacks {u['stacks']}, complete {u['complete']}, copy ended {u['stack_copy_ended']}, no unwind info {u['no_unwind_info']}, errors {u['unwind_errors']}, table {u['table_bytes']} B")
print(f"copies {src['copies']}, {src['copy_bytes']/1e6:.0f} MB ({src['copy_bytes']/max(src['copies'],1):.0f} B each), intervals at exit {src['offcpu_at_syscall_exit']}, at switch-out {src['offcpu_at_switch_out']}, not taken {src['offcpu_not_taken']}, unused switch-out copies {src['switch_out_copies_unused']}")
print("lost", s["lost"])
print("findings", s["findings"], "duration", s["duration_s"])
for p in (s.get("probe_cost") or {}).get("programs", []):
    print(f"  {p['program']:24} runs {p['runs']:>8}  {p['avg_ns']:>7.0f} ns/run")
