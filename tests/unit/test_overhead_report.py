"""The overhead report's ratio table: turnkv's gateway CPU per request over each bare relay's, at the same
load, from the CPU seconds and request counts the suite records."""

from __future__ import annotations

from turnkv.bench.records import ConfigResult, RequestRecord
from turnkv.bench.scenarios.overhead import _itl_table, _ratio_table


def _config(name: str, cpu_s: float | None, requests: int = 100) -> ConfigResult:
    meta = {} if cpu_s is None else {"gateway_cpu_s": cpu_s}
    recs = [RequestRecord(conversation=i, turn=1, start_s=0.0) for i in range(requests)]
    return ConfigResult(name, "", {}, {}, recs, 1.0, meta=meta)


def _rows(table: list[str]) -> dict[tuple[str, str], list[str]]:
    lines = "\n".join(table).splitlines()
    rows = [ln.strip("|").split("|") for ln in lines if ln.startswith("| c")]
    return {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows}


def test_turnkv_is_divided_by_each_relay_at_its_own_load() -> None:
    checks: list[tuple[str, str, float, float, str]] = []
    table = _ratio_table(
        [
            _config("bare-relay-c64", 0.2),  # 2 ms per request
            _config("bare-pd-relay-c64", 0.25),
            _config("bare-pd-relay-uvicorn-c64", 0.4, requests=200),  # 2 ms per request
            _config("turnkv-stateless-c64", 0.3),
            _config("turnkv-redis-c64", 0.5),
            _config("bare-relay-c1", 0.1),
            _config("turnkv-stateless-c1", None),  # not measured: no row
        ],
        checks,
    )
    rows = _rows(table)
    assert set(rows) == {("c64", "turnkv-stateless"), ("c64", "turnkv-redis")}
    # bare, P/D, uvicorn P/D, turnkv (CPU ms), then turnkv over each, then the target
    assert rows["c64", "turnkv-stateless"] == ["2.000", "2.500", "2.000", "3.000", "1.50x", "1.20x", "1.50x", "1.15x"]
    assert rows["c64", "turnkv-redis"][4:] == ["2.50x", "2.00x", "2.50x", "1.3x"]
    # the targets are checked at the last load against the one-call relay
    assert [(c[1], round(c[2], 2), c[3]) for c in checks] == [
        ("turnkv-stateless-c64", 1.5, 1.15),
        ("turnkv-redis-c64", 2.5, 1.3),
    ]


def test_a_missing_pd_relay_shows_a_dash_and_no_relay_no_table() -> None:
    checks: list[tuple[str, str, float, float, str]] = []
    rows = _rows(_ratio_table([_config("bare-relay-c64", 0.2), _config("turnkv-stateless-c64", 0.3)], checks))
    assert rows["c64", "turnkv-stateless"] == ["2.000", "-", "-", "3.000", "1.50x", "-", "-", "1.15x"]
    assert _ratio_table([_config("turnkv-stateless-c64", 0.3)], []) == []


def _itl(name: str, itl_ms: list[float]) -> ConfigResult:
    recs = [RequestRecord(conversation=i, turn=1, start_s=0.0, ttft_ms=5.0, itl_ms=itl_ms) for i in range(4)]
    return ConfigResult(name, "", {}, {}, recs, 1.0)


def test_the_itl_table_says_what_turnkv_adds_over_direct_and_over_the_relay() -> None:
    checks: list[tuple[str, str, float, float, str]] = []
    by = {c.name: c for c in (_itl("itl-pd-direct", [20.0] * 99), _itl("itl-turnkv", [23.0] * 99))}
    table = "\n".join(_itl_table(by, checks))
    assert "Added ITL p99: +3.00 ms." in table and "bare P/D relay" not in table
    assert [c[2] for c in checks] == [3.0]
    by["itl-bare-pd-relay"] = _itl("itl-bare-pd-relay", [22.5] * 99)
    table = "\n".join(_itl_table(by, []))
    assert "| itl-bare-pd-relay |" in table
    assert "ITL p99 through turnkv minus through the bare P/D relay: +0.50 ms." in table
    assert _itl_table({"itl-turnkv": by["itl-turnkv"]}, []) == []
