"""Recorded request/response flows ("fixtures"), replaying them, and comparing responses by shape.

Shared by the recorder that runs against real vLLM on the GPU host (gpu/record_fixtures.py) and the
CI test that replays the same flows against the simulator (test_vllm_fixtures.py), so both capture
responses with the same code. Standard library only (the GPU host runs it before anything is installed).

A fixture file is one case: a few steps, each an HTTP request to an engine role, and the response
recorded for it. A step's body may take values from earlier steps' responses (``bind``), e.g. the
decode request takes P's ``kv_transfer_params``; replaying resolves them against the replay's own
responses. The format is described in tests/fixtures/vllm/README.md.

Comparison is by shape, never by value (ids, timestamps, engine ids, block ids and token ids differ from
run to run): the same JSON key sets in the same order, the same JSON types, the same SSE framing and
the same run-length-collapsed sequence of chunk shapes. A few enum-like keys (``object``,
``finish_reason``, error ``type`` ...) are compared by value.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

FORMAT = 1
# keys whose values are protocol constants, compared exactly (at any depth)
ENUM_KEYS = frozenset(
    {
        "object",
        "role",
        "finish_reason",
        "type",
        "param",
        "code",
        "owned_by",
        "do_remote_prefill",
        "do_remote_decode",
        "tp_size",
    }
)
# response headers that are compared (others, e.g. date, server, content-length, are not)
COMPARED_HEADERS = ("content-type",)
# metric names turnkv reads from engines (engine/vllm/info.py), which both sides must expose
SCRAPED_METRICS = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total")


# -- running steps --------------------------------------------------------------------------------


def dig(obj: Any, path: Iterable[Any]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _put(obj: Any, path: list[Any], value: Any) -> None:
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def apply_edit(value: Any, edit: Mapping[str, Any] | None) -> Any:
    """``set``: replace members; ``shift``: add to numeric members (e.g. forge an expired handle)."""
    if not edit:
        return value
    out = copy.deepcopy(value)
    for k, v in (edit.get("set") or {}).items():
        out[k] = v
    for k, v in (edit.get("shift") or {}).items():
        if isinstance(out.get(k), (int, float)):
            out[k] = out[k] + v
    return out


def resolve_body(step: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]]) -> Any:
    """The step's body with its bindings filled from earlier steps' responses (of this run)."""
    body = copy.deepcopy(step.get("body"))
    for b in step.get("bind") or []:
        value = dig(results[b["from"]], b["take"])
        _put(body, list(b["to"]), apply_edit(value, b.get("edit")))
    return body


def send(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """One request; the response as a fixture records it (status, headers, and JSON, SSE or text)."""
    hostport = base_url.removeprefix("http://").rstrip("/")
    if not hostport.startswith(("127.0.0.1:", "localhost:")):
        raise ValueError(f"only loopback engines: {base_url}")
    conn = http.client.HTTPConnection(hostport, timeout=timeout_s)
    data = None if body is None else json.dumps(body).encode()
    hdrs = dict(headers or {})
    if data is not None:
        hdrs.setdefault("content-type", "application/json")
    t0 = time.perf_counter()
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8", "replace")
        rh = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    return record_response(resp.status, rh, raw, time.perf_counter() - t0)


def record_response(status: int, headers: Mapping[str, str], raw: str, seconds: float = 0.0) -> dict[str, Any]:
    ctype = headers.get("content-type", "")
    rec: dict[str, Any] = {"status": status, "headers": dict(headers), "seconds": round(seconds, 4)}
    if "text/event-stream" in ctype:
        rec["kind"] = "sse"
        rec["raw"] = raw
        rec["events"] = [_maybe_json(p) for p in sse_payloads(raw)]
    elif "json" in ctype:
        rec["kind"] = "json"
        rec["raw"] = raw
        rec["json"] = _maybe_json(raw)
    else:
        rec["kind"] = "text" if raw else "empty"
        rec["raw"] = raw
    return rec


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def sse_payloads(raw: str) -> list[str]:
    """The ``data`` of each SSE event (multi-line data joined with newlines)."""
    out: list[str] = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [ln[5:].lstrip(" ") for ln in block.split("\n") if ln.startswith("data:")]
        if lines:
            out.append("\n".join(lines))
    return out


def run_steps(
    case: Mapping[str, Any], engines: Mapping[str, str], *, timeout_s: float = 300.0
) -> dict[str, dict[str, Any]]:
    """Replay (or record) a case's steps in order against ``engines`` (role -> base URL)."""
    results: dict[str, dict[str, Any]] = {}
    for step in case["steps"]:
        if step.get("sleep_before_s"):
            time.sleep(min(float(step["sleep_before_s"]), 60.0))
        body = resolve_body(step, results)
        results[step["name"]] = send(
            engines[step["engine"]], step.get("method", "POST"), step["path"], body, step.get("headers"), timeout_s
        )
    return results


# -- shapes ------------------------------------------------------------------------------------------


def jtype(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "dict"
    return type(v).__name__


def shape(v: Any) -> Any:
    """A value with every leaf replaced by its JSON type; lists become the sorted set of their
    elements' shapes (token and block ids vary in number); key order is kept."""
    if isinstance(v, dict):
        return {"{}": [[k, shape(x)] for k, x in v.items()]}
    if isinstance(v, list):
        return {"[]": sorted({json.dumps(shape(x), sort_keys=False) for x in v})}
    return jtype(v)


def diff(rec: Any, rep: Any, path: str = "$") -> list[str]:
    """Differences between a recorded value and a replayed one, by shape (and enum values)."""
    tr, tp = jtype(rec), jtype(rep)
    if tr != tp:
        return [f"{path}: type {tr} (recorded) != {tp} (replayed)"]
    if tr == "dict":
        out: list[str] = []
        kr, kp = list(rec), list(rep)
        if kr != kp:
            missing = [k for k in kr if k not in rep]
            extra = [k for k in kp if k not in rec]
            if missing or extra:
                out.append(f"{path}: keys missing {missing} extra {extra}")
            else:
                out.append(f"{path}: key order {kr} (recorded) != {kp} (replayed)")
        for k in kr:
            if k not in rep:
                continue
            if k in ENUM_KEYS and not isinstance(rec[k], (dict, list)) and rec[k] != rep[k]:
                out.append(f"{path}.{k}: {rec[k]!r} (recorded) != {rep[k]!r} (replayed)")
            out += diff(rec[k], rep[k], f"{path}.{k}")
        return out
    if tr == "list":
        if not rec or not rep:
            return []  # an empty list says nothing about its elements
        sr = {json.dumps(shape(x)) for x in rec}
        sp = {json.dumps(shape(x)) for x in rep}
        if sr == sp:
            return []
        if len(sr) == 1 and len(sp) == 1:  # one element shape each: say where they differ
            return diff(rec[0], rep[0], f"{path}[0]")
        return [f"{path}: element shapes differ: {sorted(sr - sp)} (recorded only) / {sorted(sp - sr)} (replayed only)"]
    return []


def compact(payload: str) -> bool:
    """Whether a JSON text is written compactly (``,`` and ``:`` with no spaces), as pydantic does."""
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) == payload


def sse_framing(raw: str) -> list[str]:
    """Departures from vLLM's framing: only ``data: <payload>\\n\\n`` events, ending with ``[DONE]``."""
    problems: list[str] = []
    if not raw.endswith("data: [DONE]\n\n"):
        problems.append("does not end with 'data: [DONE]\\n\\n'")
    blocks = raw.split("\n\n")
    if blocks and blocks[-1] == "":
        blocks = blocks[:-1]
    for b in blocks:
        if not b.startswith("data: ") or "\n" in b:
            problems.append(f"event is not one 'data: ' line: {b[:60]!r}")
            break
    if raw.count("data: [DONE]") != 1:
        problems.append("[DONE] is not sent exactly once")
    return problems


def chunk_kinds(events: list[Any]) -> list[str]:
    """Each event's shape (as JSON text), with runs of the same shape collapsed."""
    out: list[str] = []
    for e in events:
        item = json.dumps(e) if isinstance(e, str) else json.dumps(shape(e))
        if not out or out[-1] != item:
            out.append(item)
    return out


def event_compactness(rec: Mapping[str, Any]) -> list[bool]:
    return [compact(p) for p in sse_payloads(rec.get("raw", "")) if p != "[DONE]"]


def compare_response(
    rec: Mapping[str, Any], rep: Mapping[str, Any], *, drop_stream_keys: tuple[str, ...] = ()
) -> list[str]:
    """Differences between a recorded response and a replayed one. ``drop_stream_keys`` are removed
    from recorded stream chunks first (e.g. what a plugin adds that the replayed engine lacks)."""
    out: list[str] = []
    if rec["status"] != rep["status"]:
        out.append(f"status {rec['status']} (recorded) != {rep['status']} (replayed)")
    for h in COMPARED_HEADERS:
        hr, hp = rec["headers"].get(h), rep["headers"].get(h)
        if _media(hr) != _media(hp):
            out.append(f"header {h}: {hr!r} (recorded) != {hp!r} (replayed)")
    if rec["kind"] != rep["kind"]:
        return [*out, f"body kind {rec['kind']} (recorded) != {rep['kind']} (replayed)"]
    if rec["kind"] == "json":
        out += diff(rec["json"], rep["json"])
        if compact(rec["raw"]) != compact(rep["raw"]):
            out.append(f"compact JSON: {compact(rec['raw'])} (recorded) != {compact(rep['raw'])} (replayed)")
    elif rec["kind"] == "sse":
        fr, fp = sse_framing(rec["raw"]), sse_framing(rep["raw"])
        if fr != fp:
            out.append(f"SSE framing: {fr} (recorded) != {fp} (replayed)")
        ev_rec = [_drop(e, drop_stream_keys) for e in rec["events"]]
        out += diff_streams(ev_rec, rep["events"])
        if set(event_compactness(rec)) != set(event_compactness(rep)):
            out.append("SSE payload compactness differs")
    elif rec["kind"] == "text" and rec["headers"].get("content-type", "").startswith("text/plain"):
        out += diff_metrics(rec["raw"], rep["raw"])
    return out


def _media(ctype: str | None) -> str:
    """A content type as compared: all of it, but only the media type of ``text/plain`` (the Prometheus
    exposition version in it is the installed prometheus_client's, not vLLM's)."""
    v = (ctype or "").replace(" ", "").lower()
    return "text/plain" if v.startswith("text/plain") else v


def _drop(e: Any, keys: tuple[str, ...]) -> Any:
    if keys and isinstance(e, dict):
        return {k: v for k, v in e.items() if k not in keys}
    return e


def diff_streams(rec: list[Any], rep: list[Any]) -> list[str]:
    """Streams compared as the collapsed sequences of their chunk shapes; the first difference is
    explained key by key."""
    kr, kp = chunk_kinds(rec), chunk_kinds(rep)
    if kr == kp:
        return []
    first = {json.dumps(shape(e)): e for e in reversed(rec) if not isinstance(e, str)}
    firsp = {json.dumps(shape(e)): e for e in reversed(rep) if not isinstance(e, str)}
    for i, (a, b) in enumerate(zip(kr, kp, strict=False)):
        if a != b:
            detail = diff(first.get(a), firsp.get(b), f"chunk kind {i}") if a in first and b in firsp else []
            return [f"stream chunk kinds differ at kind {i} of {len(kr)} (recorded) / {len(kp)} (replayed)", *detail]
    return [f"stream has {len(kr)} chunk kinds (recorded) != {len(kp)} (replayed)"]


def metric_names(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


def diff_metrics(rec: str, rep: str) -> list[str]:
    """Prometheus text: every ``vllm:`` sample name the replayed side exposes exists in the
    recording, and both expose the names turnkv reads."""
    nr, np_ = metric_names(rec), metric_names(rep)
    out = [f"metric {n} is replayed but not in the recording" for n in sorted(np_ - nr) if n.startswith("vllm:")]
    out += [
        f"metric {n} missing on the {side} side"
        for n in SCRAPED_METRICS
        for side, names in (("recorded", nr), ("replayed", np_))
        if n not in names
    ]
    return out


# -- fixture files ------------------------------------------------------------------------------------


def load_cases(folder: Path) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    if not folder.is_dir():
        return cases
    for f in sorted(folder.glob("*.json")):
        with contextlib.suppress(ValueError):
            obj = json.loads(f.read_text())
            if isinstance(obj, dict) and obj.get("format") == FORMAT and obj.get("steps"):
                obj["_file"] = str(f)
                cases.append(obj)
    return cases


def write_case(folder: Path, case: Mapping[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{case['case']}.json"
    path.write_text(
        json.dumps({k: v for k, v in case.items() if not k.startswith("_")}, indent=1, ensure_ascii=False) + "\n"
    )
    return path
