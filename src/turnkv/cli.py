"""The ``turnkv`` command: serve, sim, demo, bench and check-template."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _sim(args: argparse.Namespace) -> int:
    import uvicorn

    from turnkv.sim.app import create_sim_app
    from turnkv.sim.settings import settings_from_args

    settings = settings_from_args(args)
    uvicorn.run(create_sim_app(settings), host=settings.host, port=settings.port, log_level=args.log_level,
                access_log=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from turnkv.sim.settings import add_sim_arguments

    parser = argparse.ArgumentParser(prog="turnkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("sim", help="run a simulated vLLM engine (prefill, decode or colocated)")
    add_sim_arguments(sim)
    sim.add_argument("--log-level", default="warning")
    sim.set_defaults(func=_sim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
