"""Tables for BENCHMARKS.md from gpu/ttft.py's render-ahead runs (R1, R2 and a third R2 call).

usage: python docs/gpu-h200-render-ahead/report.py   (reads the three ttft_ra_cache_off*.json beside it)
TTFT of turns 2..5 (pull turns): the client's TTFT; P's leg and the rest from the gateway's turn log.
"""

import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {"R1": "ttft_ra_cache_off.json", "R2": "ttft_ra_cache_off_2.json", "R3": "ttft_ra_cache_off_3.json"}
MODES = ("vllm-multiturn", "always-pull", "always-pull-beside")


def main() -> None:
    rows: dict[tuple[int, str], dict[str, list[float]]] = {}
    per_round: dict[tuple[int, str, str, int], float] = {}
    for label, name in RUNS.items():
        for r in json.loads((HERE / name).read_text())["runs"]:
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


if __name__ == "__main__":
    main()
