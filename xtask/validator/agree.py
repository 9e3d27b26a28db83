#!/usr/bin/env python3
"""Per-thread agreement of user call chains: each perf sample's chain (leaf
to root, as deep as perf went, kernel frames dropped) must appear in order
(inlined frames in between allowed) in some slotprof stack of the same
thread name. usage: agree.py perf.txt oncpu.folded"""
import sys, re, collections
def strip_params(n):
    # C++: "f(int, char*) const [clone .constprop.0]" -> "f" (perf's form)
    n = re.sub(r" \[clone [^\]]*\]", "", n)
    n = re.sub(r" const$", "", n)
    if n.endswith(")") and "::" in n:
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                if i > 0 and n[:i].strip() and not n[:i].endswith("operator"):
                    n = n[:i]
                break
    return n
def norm(n):
    n = strip_params(n.strip())
    n = re.sub(r"::h[0-9a-f]{16}$", "", n)
    n = re.sub(r"\+0x[0-9a-f]+$", "", n)
    n = re.sub(r"^__vdso_", "", n)
    return n
perf = []
cur = None
for line in open(sys.argv[1], errors="replace"):
    if not line.strip():
        if cur: perf.append(cur); cur = None
    elif not line[0].isspace():
        if cur: perf.append(cur)
        cur = (line.split()[0], [])
    elif cur is not None:
        parts = line.split(None, 1)
        sym = parts[1].strip() if len(parts) > 1 else "?"
        if parts[0].startswith("ffff") or "[kernel.kallsyms]" in sym or sym.endswith("(inlined)"): continue
        sym = re.sub(r"\s+\(.*\)$", "", sym)
        cur[1].append(norm(sym))
if cur: perf.append(cur)
slot = collections.defaultdict(list)
for line in open(sys.argv[2]):
    st, w = line.rstrip().rsplit(" ", 1)
    fr = st.split(";")
    user = [norm(f) for f in fr[1:] if not f.endswith("_[k]") and not f.startswith("[futex wait")]
    slot[fr[0][:15]].append(list(reversed(user)))  # leaf first
def subseq(p, s):
    it = iter(s)
    return all(any(x == y for y in it) for x in p)
ok = unknown = 0
bad = collections.Counter()
for comm, chain in perf:
    chain = [c for c in chain if c != "[unknown]" and not c.startswith("[unknown]")]
    if not chain: unknown += 1; continue
    if any(subseq(chain, s) for s in slot.get(comm[:15], [])): ok += 1
    else: bad[comm] += 1
n = len(perf) - unknown
print(f"{ok} of {n} perf samples ({100*ok/max(n,1):.1f}%) have their whole user chain in a slotprof stack of the same thread; {unknown} perf samples had no named frame")
print("disagreeing by thread:", bad.most_common(6))
