"""docs/configuration.md is generated from the settings model: it must say what the model says."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from turnkv.config import Settings
from turnkv.reuse.adaptive import AdaptiveParams
from turnkv.settings_doc import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_the_model() -> None:
    assert PAGE.read_text() == render(), (
        "docs/configuration.md differs from the settings model: run `turnkv settings > docs/configuration.md`"
    )


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None]]:
    out = []
    for name, field in model.model_fields.items():
        out.append((prefix + name, field.description))
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _fields(field.annotation, f"{prefix}{name}.")
    return out


def test_every_setting_is_described_and_listed() -> None:
    fields = _fields(Settings) + _fields(AdaptiveParams, "policy.params.")
    assert [name for name, description in fields if not description] == []
    page = render()
    assert [name for name, _ in fields if f"`{name}`" not in page] == []
