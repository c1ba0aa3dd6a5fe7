import json, sys, statistics, glob, os, re
cells = {}
for d in sorted(glob.glob(sys.argv[1] + "/logs/*")):
    name = os.path.basename(d)
    m = re.match(r"(\d+k)-(.+)-(vllm-multiturn|beside|ahead)$", name)
    if not m: continue
    rows = []
    for line in open(os.path.join(d, "gateway.log")):
        if '"event":"turn"' not in line: continue
        r = json.loads(line)
        if r.get("turn", 1) < 2 or r.get("ttft_ms") is None: continue
        rows.append(r)
    if not rows: continue
    med = lambda k: statistics.median(k(r) for r in rows)
    pl = med(lambda r: r["planned_ms"]); pf = med(lambda r: r["prefill_ms"])
    rest = med(lambda r: r["ttft_ms"] - r["planned_ms"] - r["prefill_ms"])
    chk = med(lambda r: r["render_ms"])
    cells.setdefault((m[1], m[2]), {})[m[3]] = (pl, pf, rest, chk)
links = ["host", "h200-ipc", "100gbe", "rdma400", "nvlink"]
print("| history | link | vllm-multiturn | beside (before) | ahead (after) | check ms, beside / ahead |")
print("| --- | --- | --- | --- | --- | --- |")
for (h, l), by in sorted(cells.items(), key=lambda kv: (int(kv[0][0][:-1]), links.index(kv[0][1]))):
    f = lambda x: "-" if x is None else f"{x[0]:.1f} + {x[1]:.1f} + {x[2]:.1f}"
    b, a = by.get("beside"), by.get("ahead")
    print(f"| {h} | {l} | {f(by.get('vllm-multiturn'))} | {f(b)} | {f(a)} | {b[3] if b else '-':.1f} / {a[3] if a else '-':.1f} |")
