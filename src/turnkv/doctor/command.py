"""``turnkv doctor``: the command line, from the same settings as ``turnkv serve`` (flags, ``--config``,
``TURNKV_*``), to the report on stdout, the JSON report and the profile as files, and the exit status
(0: nothing blocks; 1: a blocking problem; 2: the settings themselves are wrong)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from turnkv.config import ConfigError, Settings, Timeouts, load_settings
from turnkv.doctor import report
from turnkv.doctor.run import Options, Report, diagnose
from turnkv.engine.base import Engine
from turnkv.engine.diagnostics import EngineDiagnostics
from turnkv.engine.vllm.diagnostics import vllm_diagnostics
from turnkv.profile import write_profile

Opener = Callable[[Settings], AbstractAsyncContextManager[tuple[Engine, EngineDiagnostics]]]
ENGINES: dict[str, Opener] = {"vllm": vllm_diagnostics}
# a metadata read of a busy engine (its /metrics, a render) may take longer than the gateway's health probe
PROBE_TIMEOUT_S = 10.0


def main(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(
            args.config,
            prefill=args.prefill,
            decode=args.decode,
            render=args.render,
            policy={"name": args.policy} if args.policy else None,
        )
        options = _options(args)
    except (ConfigError, ValueError) as exc:
        print(f"turnkv doctor: {exc}", file=sys.stderr)
        return 2
    timeouts = settings.timeouts.model_copy(update={"health_s": max(settings.timeouts.health_s, PROBE_TIMEOUT_S)})
    settings = settings.model_copy(update={"timeouts": Timeouts.model_validate(timeouts.model_dump())})
    try:
        opener = ENGINES[settings.engine]
    except KeyError:
        print(f"turnkv doctor: no doctor for engine {settings.engine!r}", file=sys.stderr)
        return 2
    r = asyncio.run(_run(settings, options, opener))
    print(report.text(r))
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(r), indent=1) + "\n")
    if args.profile:
        write_profile(args.profile, r.profile)
        measured = r.profile.pull or r.profile.push or r.profile.compute
        what = "" if measured else ", with nothing measured: the gateway keeps its settings' priors"
        print(f"profile written to {args.profile}{what} (turnkv serve --profile {args.profile})")
    return r.exit_status


async def _run(settings: Settings, options: Options, opener: Opener) -> Report:
    async with opener(settings) as (engine, probes):
        return await diagnose(settings, options, engine, probes)


def _options(args: argparse.Namespace) -> Options:
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--sizes takes token counts separated by commas, not {args.sizes!r}") from None
    if not sizes or min(sizes) < 16:
        raise ValueError("--sizes: each probe needs at least 16 tokens")
    logs: dict[str, str] = {}
    for item in args.log:
        role, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--log takes ROLE=FILE, not {item!r}")
        logs[role.rstrip("/")] = path
    return Options(
        sizes=sizes,
        budget_s=args.budget_s,
        turn_tokens=args.turn_tokens,
        history_tokens=args.history_tokens,
        logs=logs,
        measure=not args.no_transfer,
    )
