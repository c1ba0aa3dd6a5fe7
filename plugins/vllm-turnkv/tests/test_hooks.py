"""The patches, on a stand-in ``vllm`` package written to a temporary folder (vLLM itself is not installed here).

The stand-in's stream generators produce chunks the way vLLM 0.26's do (role chunk without
``token_ids``, token chunks with it, a finish chunk, a usage chunk, ``[DONE]``), so these tests check
the wrapping, the timing of the patches (now, or when a module is imported) and the version gates.
The real engine is exercised by gpu/record_fixtures.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_turnkv import hooks
from vllm_turnkv.middleware import HEADER, AdvertiseMiddleware

PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_num_tokens": 20}

PROTOCOL = """
class _Base:
    model_fields = {{"id": None, "choices": None{extra}}}

class ChatCompletionStreamResponse(_Base):
    pass

class CompletionStreamResponse(_Base):
    pass
"""

CHAT_SERVING = """
import json
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

EVENTS = []

class OpenAIServingChat:
    async def chat_completion_stream_generator(self, request, result_generator, request_id, model_name,
                                               conversation=None, tokenizer=None, request_metadata=None,
                                               chat_template_kwargs=None, mm_token_counts=None):
        first = True
        n = 0
        async for res in result_generator:
            if first:
                first = False
                role = {"id": request_id, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}
                yield "data: " + json.dumps(role, separators=(",", ":")) + "\\n\\n"
            n += len(res.token_ids)
            choice = {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": res.finish_reason}
            if res.finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            yield "data: " + json.dumps({"id": request_id, "choices": [choice]}, separators=(",", ":")) + "\\n\\n"
        usage = {"id": request_id, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
        yield "data: " + json.dumps(usage, separators=(",", ":")) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
"""

COMPLETION_SERVING = """
import json
from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

class OpenAIServingCompletion:
    async def completion_stream_generator(self, request, engine_inputs, result_generator, request_id,
                                          created_time, model_name, num_prompts, tokenizer, request_metadata):
        async for i, res in result_generator:
            choice = {"index": i, "text": "y", "logprobs": None, "finish_reason": res.finish_reason,
                      "stop_reason": None, "token_ids": None}
            yield "data: " + json.dumps({"id": request_id, "choices": [choice]}, separators=(",", ":")) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
"""

GENERATE_SERVING = """
import json
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateStreamResponse

class ServingTokens:
    async def serve_tokens_stream_generator(self, request, result_generator, request_id, model_name,
                                            request_metadata):
        n = 0
        async for res in result_generator:
            n += len(res.token_ids)
            choice = {"index": 0, "logprobs": None, "finish_reason": res.finish_reason,
                      "token_ids": res.token_ids, "routed_experts": None}
            yield "data: " + json.dumps({"request_id": request_id, "choices": [choice], "usage": None},
                                        separators=(",", ":")) + "\\n\\n"
        usage = {"request_id": request_id, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
        yield "data: " + json.dumps(usage, separators=(",", ":")) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
"""

API_SERVER = """
class App:
    def __init__(self):
        self.middleware = []

    def add_middleware(self, cls, **kw):
        self.middleware.append((cls, kw))

def build_app(args, supported_tasks=None, model_config=None):
    import vllm.entrypoints.openai.chat_completion.serving  # noqa: F401 - as vLLM's build_app imports routers
    import vllm.entrypoints.openai.completion.serving  # noqa: F401
    import vllm.entrypoints.scale_out.token_in_token_out.serving  # noqa: F401 - the scale-out routers
    return App()
"""


def write_fake_vllm(root: Path, version: str, native: bool, generate_native: bool = False) -> None:
    files = {
        "vllm/__init__.py": f"__version__ = {version!r}\n",
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/api_server.py": API_SERVER,
        "vllm/entrypoints/openai/chat_completion/__init__.py": "",
        "vllm/entrypoints/openai/chat_completion/protocol.py": PROTOCOL.format(
            extra=', "kv_transfer_params": None' if native else ""
        ),
        "vllm/entrypoints/openai/chat_completion/serving.py": CHAT_SERVING,
        "vllm/entrypoints/openai/completion/__init__.py": "",
        "vllm/entrypoints/openai/completion/protocol.py": PROTOCOL.format(
            extra=', "kv_transfer_params": None' if native else ""
        ),
        "vllm/entrypoints/openai/completion/serving.py": COMPLETION_SERVING,
        "vllm/entrypoints/scale_out/__init__.py": "",
        "vllm/entrypoints/scale_out/token_in_token_out/__init__.py": "",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py": PROTOCOL.format(
            extra=', "kv_transfer_params": None' if generate_native else ""
        ).replace("ChatCompletionStreamResponse", "GenerateStreamResponse"),
        "vllm/entrypoints/scale_out/token_in_token_out/serving.py": GENERATE_SERVING,
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A factory: fake_vllm(version, native=False) writes the stand-in and puts it on sys.path."""
    monkeypatch.delenv(hooks.DISABLE_ENV, raising=False)
    monkeypatch.delenv(hooks.VISIBLE_ENV, raising=False)  # no GPU named: the stand-in has no NVML either
    hooks.STATE.__init__()  # type: ignore[misc]
    before = list(sys.meta_path)

    def make(version: str = "0.26.0", native: bool = False, generate_native: bool = False) -> None:
        write_fake_vllm(tmp_path, version, native, generate_native)
        sys.path.insert(0, str(tmp_path))

    yield make
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    sys.meta_path[:] = before
    hooks.STATE.__init__()  # type: ignore[misc]


class Output:
    def __init__(self, finish_reason: str | None, params: dict[str, Any] | None) -> None:
        self.token_ids = [7]
        self.finish_reason = finish_reason
        self.kv_transfer_params = params


class Engine:
    """An engine-output generator that records whether it was closed before its end (vLLM aborts then)."""

    def __init__(self, n: int, pairs: bool = False) -> None:
        self.n, self.pairs = n, pairs
        self.closed_early = False

    async def gen(self) -> Any:
        done = False
        try:
            for i in range(self.n):
                last = i == self.n - 1
                out = Output("length" if last else None, PARAMS if last else None)
                yield (0, out) if self.pairs else out
                await asyncio.sleep(0)
            done = True
        finally:
            self.closed_early = not done


async def collect(agen: Any, limit: int | None = None) -> list[str]:
    events: list[str] = []
    try:
        async for e in agen:
            events.append(e)
            if limit is not None and len(events) >= limit:
                break
    finally:
        await agen.aclose()
    return events


def chunks(events: list[str]) -> list[Any]:
    return [e[6:-2] if e == "data: [DONE]\n\n" else json.loads(e[6:-2]) for e in events]


def chat_stream(engine: Engine) -> Any:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    return OpenAIServingChat().chat_completion_stream_generator(None, engine.gen(), "chatcmpl-1", "m")


def test_patches_modules_already_imported(fake_vllm: Any) -> None:
    fake_vllm()
    import vllm.entrypoints.openai.api_server
    import vllm.entrypoints.openai.chat_completion.serving
    import vllm.entrypoints.openai.completion.serving
    import vllm.entrypoints.scale_out.token_in_token_out.serving  # noqa: F401

    line = hooks.install()
    assert "patched OpenAIServingChat.chat_completion_stream_generator" in line and "will patch" not in line
    out = chunks(asyncio.run(collect(chat_stream(Engine(3)))))
    role, t1, t2, fin, usage, done = out
    assert "kv_transfer_params" not in role and "kv_transfer_params" not in usage
    assert t1["kv_transfer_params"] is None and t2["kv_transfer_params"] is None
    assert fin["kv_transfer_params"] == PARAMS and list(fin)[-1] == "kv_transfer_params"
    assert done == "[DONE]"


def test_patches_modules_when_imported_later(fake_vllm: Any) -> None:
    fake_vllm()
    line = hooks.install()
    assert "will patch" in line
    import vllm.entrypoints.openai.api_server as api

    app = api.build_app(None)  # imports the serving modules, as vLLM's build_app does
    assert hooks.STATE.patched == ["chat", "completions", "generate"]
    assert app.middleware == [(AdvertiseMiddleware, {"value": "0.1.0; streams=chat,completions,generate"})]
    assert not any(isinstance(f, hooks.PostImportFinder) for f in sys.meta_path)
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    engine = Engine(2, pairs=True)
    agen = OpenAIServingCompletion().completion_stream_generator(
        None, [], engine.gen(), "cmpl-1", 0, "m", 1, None, None
    )
    first, last, done = chunks(asyncio.run(collect(agen)))
    assert first["kv_transfer_params"] is None and last["kv_transfer_params"] == PARAMS and done == "[DONE]"


def generate_stream(engine: Engine) -> Any:
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    return ServingTokens().serve_tokens_stream_generator(None, engine.gen(), "generate-tokens-1", "m", None)


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_a_generate_stream_ends_with_the_handle(fake_vllm: Any, version: str) -> None:
    """No vLLM streams the handle on /inference/v1/generate: patched on every version, 0.33 included."""
    fake_vllm(version, native=version >= "0.33")
    import vllm.entrypoints.openai.chat_completion.serving as chat
    import vllm.entrypoints.scale_out.token_in_token_out.serving  # noqa: F401

    orig_chat = chat.OpenAIServingChat.chat_completion_stream_generator
    hooks.install()
    t1, t2, fin, usage, done = chunks(asyncio.run(collect(generate_stream(Engine(3)))))
    assert t1["kv_transfer_params"] is None and t2["kv_transfer_params"] is None
    assert fin["kv_transfer_params"] == PARAMS and list(fin) == ["request_id", "choices", "usage", "kv_transfer_params"]
    assert "kv_transfer_params" not in usage and done == "[DONE]"
    assert "generate" in hooks.STATE.patched
    if version == "0.33.0":  # chat streams the handle itself there
        assert chat.OpenAIServingChat.chat_completion_stream_generator is orig_chat
        assert hooks.STATE.patched == ["generate"]


def test_closing_a_generate_stream_closes_the_engine_generator(fake_vllm: Any) -> None:
    fake_vllm()
    import vllm.entrypoints.scale_out.token_in_token_out.serving  # noqa: F401

    hooks.install()
    engine = Engine(50)
    events = asyncio.run(collect(generate_stream(engine), limit=3))
    assert len(events) == 3 and engine.closed_early


def test_register_twice_patches_once(fake_vllm: Any) -> None:
    fake_vllm()
    import vllm.entrypoints.openai.chat_completion.serving as serving

    hooks.install()
    first = serving.OpenAIServingChat.chat_completion_stream_generator
    assert "already registered" in hooks.install()
    assert serving.OpenAIServingChat.chat_completion_stream_generator is first
    out = chunks(asyncio.run(collect(chat_stream(Engine(1)))))
    assert out[1]["kv_transfer_params"] == PARAMS  # one key, not two
    assert sum(1 for e in asyncio.run(collect(chat_stream(Engine(1)))) if "kv_transfer_params" in e) == 1


def test_closing_the_stream_closes_the_engine_generator(fake_vllm: Any) -> None:
    fake_vllm()
    import vllm.entrypoints.openai.chat_completion.serving  # noqa: F401

    hooks.install()
    engine = Engine(50)
    events = asyncio.run(collect(chat_stream(engine), limit=3))
    assert len(events) == 3 and engine.closed_early  # the client left: vLLM would abort the request now


@pytest.mark.parametrize(
    ("version", "native", "expect"),
    [
        ("0.33.0", False, "chat, completions (streamed natively from vLLM 0.33)"),
        ("0.25.1", False, "nothing patched"),
        ("0.29.0", True, "already has kv_transfer_params (native)"),
    ],
)
def test_no_op_where_not_needed(fake_vllm: Any, version: str, native: bool, expect: str) -> None:
    fake_vllm(version, native)
    import vllm.entrypoints.openai.chat_completion.serving as serving

    orig = serving.OpenAIServingChat.chat_completion_stream_generator
    line = hooks.install()
    assert expect in line
    assert serving.OpenAIServingChat.chat_completion_stream_generator is orig
    assert hooks.STATE.patched == []


def test_disabled_by_environment(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm()
    monkeypatch.setenv(hooks.DISABLE_ENV, "0")
    assert "disabled by VLLM_TURNKV_PLUGIN=0" in hooks.install()
    assert not any(isinstance(f, hooks.PostImportFinder) for f in sys.meta_path)


def test_no_header_when_nothing_was_patched(fake_vllm: Any) -> None:
    fake_vllm("0.29.0", native=True, generate_native=True)
    hooks.install()
    import vllm.entrypoints.openai.api_server as api

    assert api.build_app(None).middleware == []


def test_the_header_names_the_servers_gpus(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm()
    monkeypatch.setenv(hooks.VISIBLE_ENV, "GPU-aaaa,GPU-bbbb")
    hooks.install()
    import vllm.entrypoints.openai.api_server as api

    app = api.build_app(SimpleNamespace(tensor_parallel_size=2))
    assert app.middleware == [
        (AdvertiseMiddleware, {"value": "0.1.0; streams=chat,completions,generate; gpus=GPU-aaaa,GPU-bbbb"})
    ]
    one = api.build_app(args=SimpleNamespace(tensor_parallel_size=1))  # as a keyword too
    assert one.middleware[0][1]["value"].endswith("; gpus=GPU-aaaa")


def test_gpus_alone_are_advertised_where_no_stream_was_patched(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm("0.29.0", native=True, generate_native=True)
    monkeypatch.setenv(hooks.VISIBLE_ENV, "GPU-cccc")
    hooks.install()
    import vllm.entrypoints.openai.api_server as api

    assert api.build_app(None).middleware == [(AdvertiseMiddleware, {"value": "0.1.0; streams=; gpus=GPU-cccc"})]


def test_a_failing_rewrite_leaves_the_event_alone(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm()
    import vllm.entrypoints.openai.chat_completion.serving  # noqa: F401

    hooks.install()

    def boom(*a: Any) -> str:
        raise RuntimeError("bad chunk")

    monkeypatch.setattr(hooks, "rewrite_event", boom)
    events = asyncio.run(collect(chat_stream(Engine(2))))
    assert len(events) == 5 and not any("kv_transfer_params" in e for e in events)
    assert hooks.STATE.rewrite_failures == 5


def test_middleware_adds_the_header_to_http_only() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {}

    mw = AdvertiseMiddleware(app, value="0.1.0; streams=chat")
    asyncio.run(mw({"type": "http"}, receive, send))
    assert sent[0]["headers"] == [(b"content-type", b"text/plain"), (HEADER.encode(), b"0.1.0; streams=chat")]
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}
    sent.clear()
    asyncio.run(mw({"type": "lifespan"}, receive, send))
    assert "headers" in sent[0] and len(sent[0]["headers"]) == 1


def test_header_is_added_to_an_app_whose_middleware_stack_is_built() -> None:
    """vLLM 0.26's build_app returns such an app; Starlette's add_middleware refuses it."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    app = Starlette(routes=[Route("/version", lambda r: PlainTextResponse("0.26.0"))])
    app.middleware_stack = app.build_middleware_stack()
    with pytest.raises(RuntimeError):
        app.add_middleware(AdvertiseMiddleware, value="x")
    hooks.add_middleware(app, AdvertiseMiddleware, value="0.1.0; streams=chat")
    with TestClient(app) as client:
        assert client.get("/version").headers[HEADER] == "0.1.0; streams=chat"
