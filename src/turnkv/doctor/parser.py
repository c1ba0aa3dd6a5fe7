"""``turnkv doctor``'s flags, apart from the command itself (``turnkv.doctor.command``): building
``turnkv``'s parser imports this module only, so the other commands (a simulated engine, the gateway)
start without importing the doctor, the engines' diagnostics and the gateway's app."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """check a P/D deployment before it takes traffic, from the same settings as ``turnkv serve``
(flags, ``--config``, ``TURNKV_*``): the report on stdout, the JSON report and the profile as files, and the
exit status (0: nothing blocks; 1: a blocking problem; 2: the settings themselves are wrong)"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check a P/D deployment before it takes traffic: roles, template, the KV transfer both ways "
        "(measured), decode memory; writes the profile turnkv serve loads",
        description=DESCRIPTION,
    )
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL")
    p.add_argument("--render", default=None, metavar="URL", help="the render service the gateway uses")
    p.add_argument("--config", default=None, help="the gateway's YAML settings file")
    p.add_argument("--policy", default=None, help="the policy the gateway will run (default: the settings')")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole report as JSON")
    p.add_argument(
        "--profile", default=None, metavar="FILE", help="write the measured figures for turnkv serve --profile"
    )
    p.add_argument(
        "--sizes",
        default="2048,8192,32768",
        help="probe prompt lengths in tokens, comma-separated (those that do not fit are skipped)",
    )
    p.add_argument("--budget-s", type=float, default=90.0, help="time the transfer probe may take, all sizes")
    p.add_argument("--turn-tokens", type=int, default=150, help="new tokens per turn, for the break-even")
    p.add_argument("--history-tokens", type=int, default=16384, help="a conversation's length, for decode memory")
    p.add_argument(
        "--log",
        action="append",
        default=[],
        metavar="ROLE=FILE",
        help="an engine's log (ROLE: prefill, decode, or the engine's URL): the transports its KV moves over "
        "and the settings it logged (repeat per engine)",
    )
    p.add_argument("--no-transfer", action="store_true", help="describe and audit only: send no probe turns")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from turnkv.doctor.command import main

    return main(args)
