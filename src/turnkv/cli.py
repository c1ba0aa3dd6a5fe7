"""The ``turnkv`` command: serve, sim, demo, bench, doctor, check-template and settings."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _sim(args: argparse.Namespace) -> int:
    from turnkv.launch import serve

    if args.role == "render":
        from turnkv.sim.render import create_render_app, render_settings_from_args

        rs = render_settings_from_args(args)
        serve(create_render_app(rs), rs.host, rs.port, log_level=args.log_level)
        return 0
    from turnkv.sim.app import create_sim_app
    from turnkv.sim.settings import settings_from_args

    settings = settings_from_args(args)
    serve(create_sim_app(settings), settings.host, settings.port, log_level=args.log_level)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from turnkv.config import ConfigError, load_settings
    from turnkv.gateway.app import create_app
    from turnkv.logging import configure_stdlib

    try:
        settings = load_settings(
            args.config,
            prefill=args.prefill,
            decode=args.decode,
            render=args.render,
            redis_url=args.redis_url,
            host=args.host,
            port=args.port,
            policy={"name": args.policy} if args.policy else None,
            log_level=args.log_level,
            workers=args.workers,
            profile=args.profile,
        )
    except ConfigError as exc:
        print(f"turnkv serve: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        from turnkv.gateway.workers import serve_workers

        return serve_workers(settings)
    from turnkv.gateway.connections import edge_limits
    from turnkv.gateway.server import serve
    from turnkv.gateway.tally import Tally

    configure_stdlib(settings.log_level, json=settings.log_json)
    tally = Tally()  # what clients hold, for the connection limits and the app's edge alike
    serve(create_app(settings, tally=tally), settings.host, settings.port, edge=edge_limits(settings), tally=tally)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from turnkv import demo

    return demo.run(turns=args.turns, policy=args.policy, link=args.link, four_hop=args.four_hop)


def _check_template(args: argparse.Namespace) -> int:
    import asyncio

    from turnkv.gateway.template_check import check

    return asyncio.run(check(args.engine, args.model, args.config))


def _settings(args: argparse.Namespace) -> int:
    from turnkv.settings_doc import main

    return main()


def build_parser() -> argparse.ArgumentParser:
    from turnkv.sim.settings import add_sim_arguments

    parser = argparse.ArgumentParser(prog="turnkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("sim", help="run a simulated vLLM engine (prefill, decode or colocated) or render service")
    add_sim_arguments(sim)
    sim.add_argument("--log-level", default="warning")
    sim.set_defaults(func=_sim)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--prefill", nargs="+", default=None, metavar="URL", help="prefill engine URLs")
    serve.add_argument("--decode", nargs="+", default=None, metavar="URL", help="decode engine URLs")
    serve.add_argument("--render", default=None, metavar="URL", help="render service (default: a prefill engine)")
    serve.add_argument("--redis-url", default=None, help="redis://host:port/db (default: in-process store)")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument(
        "--workers", type=int, default=None, help="gateway processes on one port (default 1; more needs --redis-url)"
    )
    serve.add_argument("--policy", default=None, help="adaptive | always-pull | never-pull | decode-local")
    serve.add_argument("--config", default=None, help="YAML settings file")
    serve.add_argument(
        "--profile", default=None, metavar="FILE", help="turnkv doctor's profile: its measured figures as cost priors"
    )
    serve.add_argument("--log-level", default=None)
    serve.set_defaults(func=_serve)

    demo = sub.add_parser("demo", help="a five-turn agent conversation through simulated P/D, end to end")
    demo.add_argument("--turns", type=int, default=5)
    demo.add_argument("--policy", default="always-pull")
    demo.add_argument("--link", default="rdma400", choices=["host", "h200-ipc", "100gbe", "rdma400", "nvlink"])
    demo.add_argument(
        "--four-hop",
        action="store_true",
        help="tokens-only P and D behind a simulated render service (render, generate, generate, derender)",
    )
    demo.set_defaults(func=_demo)

    check = sub.add_parser("check-template", help="classify an engine's chat template for KV reuse")
    check.add_argument("--engine", required=True, metavar="URL", help="an engine (or render service) base URL")
    check.add_argument("--model", default=None, help="model name (default: the engine's first)")
    check.add_argument("--config", default=None, help="the gateway's YAML settings (engine family, key, timeouts)")
    check.set_defaults(func=_check_template)

    settings = sub.add_parser("settings", help="print the settings reference (docs/configuration.md) as Markdown")
    settings.set_defaults(func=_settings)

    from turnkv.bench.cli import add_bench_parser
    from turnkv.doctor.parser import add_parser as add_doctor_parser

    add_bench_parser(sub)
    add_doctor_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
