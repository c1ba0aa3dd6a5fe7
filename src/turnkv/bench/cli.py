"""``turnkv bench``: multi-turn load generation and the benchmark scenarios."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("bench", help="multi-turn benchmark (see BENCHMARKS.md)")
    p.set_defaults(func=lambda args: (print("turnkv bench: not implemented yet"), 1)[1])
