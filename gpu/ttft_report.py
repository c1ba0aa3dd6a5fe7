"""Tables for BENCHMARKS.md from gpu/ttft.py's runs: TTFT of later turns per history and mode against
vllm-multiturn's, pooled and per round, with where the gateway's turn log puts the time.

usage: python gpu/ttft_report.py [ttft_*.json ...]      (no files: results/gpu/ttft_*.json)

TTFT of turns 2..N (pull turns): the client's TTFT; P's leg and the rest from the gateway's turn log. Then,
per mode, the NIXL reads (P pulling D's blocks, D pulling P's): per later turn where the run read the
engines' /metrics between turns, else per transfer over whole conversations; and, where a mode ran both
before and after vllm-multiturn in its rounds (``--order abba``), the per-round ratio by its place.
"""

from __future__ import annotations

import json
import statistics as st
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results" / "gpu"
MODES = ("vllm-multiturn", "always-pull", "always-pull-beside")
BASE = "vllm-multiturn"


def main(paths: list[Path]) -> None:
    rows: dict[tuple[int, str], dict[str, list[float]]] = {}
    per_round: dict[tuple[int, str, str, int], float] = {}
    seq: dict[tuple[int, str, str, int], int] = {}
    nixl: dict[tuple[int, str], dict[str, list[float]]] = {}
    for path in paths:
        label = path.stem
        for r in json.loads(path.read_text())["runs"]:
            key = (r["history"], r["mode"])
            cell = rows.setdefault(key, {"ttft": [], "gw": [], "p": [], "rest": [], "check": []})
            later = [t for t in r["turns"][1:] if t.get("ttft_ms") is not None and t["status"] == 200]
            events = [e for e in r.get("gateway_turns", []) if e.get("turn", 1) >= 2 and e.get("ttft_ms")]
            cell["ttft"] += [t["ttft_ms"] for t in later]
            cell["gw"] += [e["ttft_ms"] for e in events]
            cell["p"] += [e["prefill_ms"] for e in events]
            cell["rest"] += [e["ttft_ms"] - e["prefill_ms"] for e in events]
            cell["check"] += [e["render_ms"] for e in events]
            if later:
                per_round[(r["history"], r["mode"], label, r["rep"])] = st.median(t["ttft_ms"] for t in later)
                seq[(r["history"], r["mode"], label, r["rep"])] = r["seq"]
            n = nixl.setdefault(key, {"nixl_p_reads": [], "nixl_d_reads": []})
            for side, per_turn in (("nixl_p_reads", "nixl_p"), ("nixl_d_reads", "nixl_d")):
                if any(per_turn in t for t in later):
                    n[side] += [1000 * t[per_turn]["xfer_s"] for t in later if per_turn in t]
                elif (r.get(side) or {}).get("transfers"):
                    n[side].append(1000 * r[side]["xfer_s"] / r[side]["transfers"])
    print(
        "| history | mode | turns | TTFT p50 (ms) | / vllm-multiturn | per-round ratio, median (range) "
        "| gateway's TTFT p50 | P's leg p50 | from P's answer to D's first token p50 | check ms p50 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for h in sorted({k[0] for k in rows}):
        base = st.median(rows[(h, "vllm-multiturn")]["ttft"])
        for m in MODES:
            c = rows.get((h, m))
            if not c:
                continue
            ratios = [
                v / per_round[(h, "vllm-multiturn", lab, rep)]
                for (hh, mm, lab, rep), v in per_round.items()
                if hh == h and mm == m and (h, "vllm-multiturn", lab, rep) in per_round
            ]
            p50 = st.median(c["ttft"])
            rr = f"{st.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)"
            print(
                f"| {h // 1024}k | {m} | {len(c['ttft'])} | {p50:.0f} | {p50 / base:.2f}x | {rr} | "
                f"{st.median(c['gw']):.0f} | {st.median(c['p']):.0f} | {st.median(c['rest']):.0f} | "
                f"{st.median(c['check']):.2f} |"
            )
    print("\n| history | mode | P's read of D's blocks, ms p50 | D's read of P's, ms p50 |")
    print("| --- | --- | --- | --- |")
    for (h, m), n in sorted(nixl.items()):
        p_ms, d_ms = (f"{st.median(v):.2f}" if v else "-" for v in (n["nixl_p_reads"], n["nixl_d_reads"]))
        print(f"| {h // 1024}k | {m} | {p_ms} | {d_ms} |")
    by_place: dict[tuple[int, str, str], list[float]] = {}
    for (h, m, lab, rep), v in per_round.items():
        base = (h, "vllm-multiturn", lab, rep)
        if m != "vllm-multiturn" and base in per_round:
            place = "before" if seq[(h, m, lab, rep)] < seq[base] else "after"
            by_place.setdefault((h, m, place), []).append(v / per_round[base])
    if {k[2] for k in by_place} == {"before", "after"}:
        print("\n| history | mode | ran | rounds | per-round ratio, median (range) |")
        print("| --- | --- | --- | --- | --- |")
        for (h, m, place), ratios in sorted(by_place.items()):
            print(
                f"| {h // 1024}k | {m} | {place} vllm-multiturn | {len(ratios)} | "
                f"{st.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
            )


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]] or sorted(RESULTS.glob("ttft_*.json")))
