"""``turnkv check-template``: the audit against one engine, opened through the engine factory as the gateway
opens it, printed for an operator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from turnkv import launch

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("template", "cls"), [("keep", "preserves"), ("strip", "drops_reasoning")])
def test_check_template_classifies_an_engines_template(
    procs: list[launch.Running], tmp_path: Path, template: str, cls: str
) -> None:
    engine = launch.sim("engine", "colocated", "--time-scale", "0", "--template", template, log_dir=tmp_path)
    procs.append(engine)
    out = subprocess.run(
        [sys.executable, "-m", "turnkv", "check-template", "--engine", engine.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert f": {cls}: " in out.stdout


def test_check_template_refuses_an_unknown_engine_family(tmp_path: Path) -> None:
    config = tmp_path / "turnkv.yaml"
    config.write_text("engine: nope\n")
    out = subprocess.run(
        [sys.executable, "-m", "turnkv", "check-template", "--engine", "http://127.0.0.1:9", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "unknown engine 'nope'" in out.stdout
