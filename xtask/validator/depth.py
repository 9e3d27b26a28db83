#!/usr/bin/env python3
"""Stack depth and thread-entry reach: slotprof folded files and perf script output.
usage: depth.py folded FILE | depth.py perf FILE"""
import sys, statistics
ROOTS = ("start_thread", "clone3", "clone", "_start", "__libc_start_main")
def user_frames(frames):
    return [f for f in frames if not f.endswith("_[k]") and not f.startswith("[futex wait")]
def report(name, stacks):  # stacks: list of (root-first user frames, weight)
    total = sum(w for _, w in stacks)
    reach = sum(w for fr, w in stacks if any(r in f for f in fr[:3] for r in ROOTS))
    depths = []
    for fr, w in stacks:
        depths += [len(fr)] * min(w, 1000) if isinstance(w, int) and w < 10**6 else [len(fr)]
    print(f"{name}: {total} weight, {100*reach/max(total,1):.1f}% reach the thread entry, median user depth {statistics.median(depths) if depths else 0}")
kind, path = sys.argv[1], sys.argv[2]
if kind == "folded":
    stacks = []
    for line in open(path):
        st, w = line.rstrip().rsplit(" ", 1)
        frames = st.split(";")[1:]  # drop the thread name
        stacks.append((user_frames(frames), int(w)))
    report(path, stacks)
else:
    stacks, cur = [], None
    for line in open(path, errors="replace"):
        if not line.strip():
            if cur is not None: stacks.append((list(reversed(cur)), 1)); cur = None
        elif not line[0].isspace():
            if cur is not None: stacks.append((list(reversed(cur)), 1))
            cur = []
        elif cur is not None:
            parts = line.split(None, 1)
            sym = parts[1].strip() if len(parts) > 1 else "?"
            if parts[0].startswith("ffff") or "([kernel.kallsyms])" in sym: continue
            cur.append(sym)
    if cur is not None: stacks.append((list(reversed(cur)), 1))
    report(path, stacks)
