"""The template audit on the simulator's templates, and how a decode engine's capture path is learned."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from turnkv.engine.vllm.info import engine_info
from turnkv.gateway.audit import Render, classify
from turnkv.reuse.assess import TemplateClass
from turnkv.sim.chat import ChatTemplate
from turnkv.sim.tokenizer import Tokenizer

TOK = Tokenizer()
REWRITING = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '\\n' -}}"
    "{{- (messages | length | string) + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def renderer(template: ChatTemplate) -> Render:
    async def render(messages: list[dict[str, Any]], generation: bool) -> Sequence[int]:
        return TOK.encode(template.render(messages, add_generation_prompt=generation))

    return render


@pytest.mark.parametrize(
    ("template", "cls"),
    [
        (ChatTemplate.load("keep"), TemplateClass.PRESERVES),
        (ChatTemplate.load("strip"), TemplateClass.DROPS_REASONING),
        (ChatTemplate(REWRITING), TemplateClass.REWRITES_HISTORY),
    ],
)
@pytest.mark.parametrize("tools", [True, False])
async def test_classify(template: ChatTemplate, cls: TemplateClass, tools: bool) -> None:
    assert (await classify(renderer(template), tools=tools))[0] is cls


@pytest.mark.parametrize(
    ("version", "header", "handles"),
    [
        ("0.33.0", "", True),
        ("0.26.0", "0.1.0; streams=chat,completions", True),
        ("0.26.0", "0.1.0; streams=completions", None),
        ("0.26.0", "", None),
    ],
)
def test_capture_path(version: str, header: str, handles: bool | None) -> None:
    assert engine_info(version, header, base="http://d", decode=True).stream_handles is handles


@pytest.mark.parametrize(
    ("header", "gpus"),
    [
        ("0.1.0; streams=chat,completions; gpus=GPU-a,GPU-b", {"GPU-a", "GPU-b"}),
        ("0.1.0; streams=; gpus=GPU-c", {"GPU-c"}),  # the plugin on a P or a native-stream vLLM: GPUs alone
        ("0.1.0; streams=chat", set()),  # a plugin from before GPUs were said
        ("", set()),
    ],
)
def test_the_plugin_says_which_gpus_an_engine_computes_on(header: str, gpus: set[str]) -> None:
    info = engine_info("0.26.0", header, base="http://p", decode=False)
    assert info.gpus == gpus and info.stream_handles is (True if "chat" in header else None)
