"""Chat templates rendered the way vLLM renders them, and the reasoning/tool-call output parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnkv.sim.chat import ChatTemplate, OutputParser, RenderError, count_reasoning_tokens
from turnkv.sim.tokenizer import Tokenizer

TOK = Tokenizer()
KEEP = ChatTemplate.load("keep")
STRIP = ChatTemplate.load("strip")

SYSTEM = {"role": "system", "content": "Be brief."}
USER1: dict[str, Any] = {"role": "user", "content": "Plan a trip"}
ASSISTANT1: dict[str, Any] = {"role": "assistant", "content": "\n\nGo north.", "reasoning": "\nThink about it.\n"}
USER2: dict[str, Any] = {"role": "user", "content": "And then?"}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_keep_renders_earlier_reasoning_and_strip_drops_it() -> None:
    msgs = [SYSTEM, USER1, ASSISTANT1, USER2]
    keep, strip = KEEP.render(msgs), STRIP.render(msgs)
    turn = "<|im_start|>assistant\n<think>\nThink about it.\n</think>\n\nGo north.<|im_end|>\n"
    assert turn in keep
    assert turn not in strip
    assert "<|im_start|>assistant\nGo north.<|im_end|>\n" in strip
    assert keep.endswith("<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    assert strip.endswith("<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")


def test_strip_keeps_reasoning_of_turns_after_the_last_user_message() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    msgs = [
        USER1,
        {**ASSISTANT1, "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    assert "<think>\nThink about it.\n</think>" in STRIP.render(msgs, tools=[WEATHER])


@pytest.mark.parametrize("template", [KEEP, STRIP], ids=["keep", "strip"])
@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_and_reasoning_content_render_the_same(template: ChatTemplate, key: str) -> None:
    a = {"role": "assistant", "content": "Done.", key: "\nWhy.\n"}
    msgs = [USER1, a] if template is STRIP else [USER1, a, USER2]
    expected = [USER1, {"role": "assistant", "content": "Done.", "reasoning": "\nWhy.\n"}, *msgs[2:]]
    assert template.render(msgs) == template.render(expected)
    assert "<think>\nWhy.\n</think>\n\nDone." in template.render(msgs)


def test_reasoning_wins_over_reasoning_content_when_both_are_sent() -> None:
    both = {"role": "assistant", "content": "Done.", "reasoning": "A", "reasoning_content": "B"}
    assert "<think>\nA\n</think>" in KEEP.render([USER1, both, USER2])


@pytest.mark.parametrize(
    ("arguments", "rendered"),
    [
        ('{"city":"Paris","n":1}', '{"city": "Paris", "n": 1}'),  # re-serialised with ", " and ": "
        ('{"city": "Paris", "n": 1}', '{"city": "Paris", "n": 1}'),
        ({"city": "Paris", "n": 1}, '{"city": "Paris", "n": 1}'),
        ('{"b": 2, "a": "é"}', '{"b": 2, "a": "é"}'),  # insertion order, non-ASCII raw
        ("", "{}"),
        ("null", "{}"),
        (None, "{}"),
    ],
)
def test_tool_call_arguments_are_parsed_and_re_rendered(arguments: Any, rendered: str) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    text = KEEP.render([USER1, {"role": "assistant", "content": None, "tool_calls": [call]}, USER2], tools=[WEATHER])
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {rendered}}}\n</tool_call><|im_end|>' in text


@pytest.mark.parametrize("bad", ['{"city": ', [1, 2], "not json"])
def test_invalid_tool_call_arguments_are_a_render_error(bad: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": bad}}
    msgs = [USER1, {"role": "assistant", "content": "", "tool_calls": [call]}, USER2]
    if isinstance(bad, list):
        assert "[1, 2]" in KEEP.render(msgs)  # a list is kept as it is
        return
    with pytest.raises(RenderError):
        KEEP.render(msgs)


def test_tool_without_description_renders_description_null() -> None:
    text = KEEP.render([USER1], tools=[WEATHER])
    assert (
        '{"type": "function", "function": {"name": "get_weather", "description": null, "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}}'
    ) in text


def test_enable_thinking_false_closes_thinking_in_the_prompt() -> None:
    text = KEEP.render([USER1], kwargs={"enable_thinking": False})
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert KEEP.render([USER1]).endswith("<|im_start|>assistant\n")


def test_content_parts_are_joined_with_newlines() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert "<|im_start|>user\na\nb<|im_end|>" in KEEP.render([parts])
    with pytest.raises(RenderError):
        KEEP.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_templates_get_transformers_environment() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ {'b': 1, 'a': [1, 2]} | tojson }}"
    )
    assert ChatTemplate(source).render([USER1, USER2]) == 'Plan a trip4{"b": 1, "a": [1, 2]}'
    with pytest.raises(RenderError):
        ChatTemplate("{{ raise_exception('no') }}").render([USER1])
    with pytest.raises(RenderError):
        KEEP.render([USER1], add_generation_prompt=True, continue_final_message=True)


# -- the output parser -------------------------------------------------------------------------


def ids(text: str) -> list[int]:
    return TOK.encode(text)


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARSE_CASES = [
    # (output text, thinking, parse tools) -> (reasoning, content, [(name, arguments)])
    ("<think>\nBada kesi.\n</think>\n\nLomu tavi.<|im_end|>", True, False, ("\nBada kesi.\n", "\n\nLomu tavi.", [])),
    ("<think>\nBada kesi", True, False, ("\nBada kesi", None, [])),  # unclosed: all reasoning
    ("Bada\n</think>\n\nHi", True, False, ("Bada\n", "\n\nHi", [])),  # no start tag
    ("Lomu tavi.<|im_end|>", False, False, ("", "Lomu tavi.", [])),
    ("<think>\nA\n</think>\n\nB<think>C", True, False, ("\nA\n", "\n\nB<think>C", [])),
    ("<think>\nA\n</think>\n\nB<|im_start|>C", True, False, ("\nA\n", "\n\nBC", [])),
    ("<think>\nA\n</think>\n\n</think>B", True, False, ("\nA\n", "\n\nB", [])),
    (
        f"<think>\nA\n</think>\n\n<tool_call>\n{CALL}\n</tool_call><|im_end|>",
        True,
        True,
        ("\nA\n", None, [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        f"<think>\nA\n</think>\n\nSee:<tool_call>\n{CALL}\n</tool_call>after",
        True,
        True,
        ("\nA\n", "\n\nSee:", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        f"<think>\nA\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
        True,
        True,
        ("\nA\n", None, [("get_weather", '{"city": "Paris"}')] * 2),
    ),
    (
        f"<think>\nA\n</think>\n\n<tool_call>\n{CALL}",
        True,
        True,  # unclosed but complete JSON
        ("\nA\n", None, [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        '<think>\nA\n</think>\n\n<tool_call>\n{"name": "get_weather", "argu',
        True,
        True,  # cut by max_tokens
        ("\nA\n", '\n\n<tool_call>\n{"name": "get_weather", "argu', []),
    ),
    (
        f"<think>\nA<tool_call>\n{CALL}\n</tool_call>",
        True,
        True,  # <tool_call> ends reasoning
        ("\nA", None, [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        '<think>\nA\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": "日本"}}\n</tool_call>',
        True,
        True,
        ("\nA\n", None, [("f", '{"x": "日本"}')]),
    ),
]


@pytest.mark.parametrize(("text", "thinking", "tools", "expected"), PARSE_CASES)
def test_output_parser_splits_as_vllm_qwen3_and_hermes(
    text: str,
    thinking: bool,
    tools: bool,
    expected: tuple[str, str | None, list[tuple[str, str]]],
) -> None:
    parser = OutputParser(TOK, parse_tools=tools, thinking=thinking)
    streamed_reasoning = streamed_content = ""
    streamed_calls = []
    for i in ids(text):
        d = parser.feed(i)
        streamed_reasoning, streamed_content = streamed_reasoning + d.reasoning, streamed_content + d.content
        streamed_calls += d.tool_calls
    d = parser.finish()
    streamed_reasoning, streamed_content = streamed_reasoning + d.reasoning, streamed_content + d.content
    streamed_calls += d.tool_calls
    reasoning, content, calls = expected
    assert parser.reasoning == reasoning
    assert parser.final_content() == content
    assert [(c.name, c.arguments) for c in parser.final_tool_calls()] == calls
    assert all(
        c.id.startswith("chatcmpl-tool-") and len(c.id) == len("chatcmpl-tool-") + 16 for c in parser.final_tool_calls()
    )
    # the stream carries the same reasoning; content may differ only around tool calls
    assert streamed_reasoning == reasoning
    if not tools:
        assert streamed_content == (content or "")


def test_required_tool_choice_reports_empty_string_content() -> None:
    parser = OutputParser(TOK, parse_tools=True, thinking=True)
    for i in ids(f"<think>\nA\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"):
        parser.feed(i)
    parser.finish()
    assert parser.final_content() is None
    assert parser.final_content(required=True) == ""


def test_tool_call_arguments_stay_exact_json() -> None:
    parser = OutputParser(TOK, parse_tools=True, thinking=False)
    for i in ids('<tool_call>\n{"name": "f", "arguments": {"b": [1, 2], "a": null}}\n</tool_call>'):
        parser.feed(i)
    parser.finish()
    (call,) = parser.final_tool_calls()
    assert json.loads(call.arguments) == {"b": [1, 2], "a": None}
    assert call.arguments == '{"b": [1, 2], "a": null}'


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("<think>\nBada kesi\n</think>\n\nLomu", 4),
        ("<think>\nBada kesi", 3),
        ("Lomu tavi", 0),
    ],
)
def test_reasoning_tokens_are_counted_between_the_tags(text: str, n: int) -> None:
    assert count_reasoning_tokens(TOK, ids(text)) == n


def test_a_chat_template_file_replaces_the_builtin(tmp_path: Path) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    template = ChatTemplate.load("keep", str(path))
    assert template.name == "mine"
    assert template.render([USER1]) == "[user] Plan a trip\n[assistant]"
    with pytest.raises(ValueError):
        ChatTemplate.load("nonexistent")
