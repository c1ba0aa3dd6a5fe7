"""The patches to vLLM's OpenAI server (0.26-0.32) and tokens-only generate route (0.26+), and when they are applied.

Four places are patched, each only in a process that has (or later imports) its module; vLLM loads
general plugins in every process (API server, engine core, workers), and the engine processes never
import the HTTP server, so nothing is imported here for them:

* ``OpenAIServingChat.chat_completion_stream_generator``,
  ``OpenAIServingCompletion.completion_stream_generator`` (vLLM 0.26-0.32) and
  ``ServingTokens.serve_tokens_stream_generator`` (``/inference/v1/generate``, every version from 0.26:
  none streams the handle there up to 0.34): wrapped. The wrapper hands the original a tap on its
  engine-output generator (``result_generator``), which remembers the ``kv_transfer_params`` of the
  latest ``RequestOutput``, and rewrites each SSE event the original yields
  (``rewrite.rewrite_event``). Closing the wrapper closes the original and the engine generator, so a
  client that goes away still aborts the request at once.
* ``vllm.entrypoints.openai.api_server.build_app`` (0.26-0.32): wrapped to add ``AdvertiseMiddleware``
  (the ``x-turnkv-plugin`` header) when at least one stream generator is patched or the server's GPUs
  are known (``gpus``: read from ``build_app``'s arguments and NVML). From 0.33 the header comes through
  vLLM's endpoint-plugin seam (``endpoint``).

A stream generator is not patched on a version whose stream class has the field natively (chat and
completions from 0.33), nothing before 0.26, and nothing with ``VLLM_TURNKV_PLUGIN=0``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_turnkv.gpus import engine_gpus, load_nvml
from vllm_turnkv.middleware import HEADER, AdvertiseMiddleware, header_value
from vllm_turnkv.rewrite import FIELD, Kind, rewrite_event

log = logging.getLogger("vllm.turnkv")  # under vLLM's logger, so its handler prints it
DISABLE_ENV = "VLLM_TURNKV_PLUGIN"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
CHAT_MODULE = "vllm.entrypoints.openai.chat_completion.serving"
COMPLETION_MODULE = "vllm.entrypoints.openai.completion.serving"
GENERATE_MODULE = "vllm.entrypoints.scale_out.token_in_token_out.serving"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
FIRST, NATIVE = (0, 26), (0, 33)


@dataclass(frozen=True)
class StreamTarget:
    module: str
    cls: str
    method: str
    stream_cls: tuple[str, ...]  # the chunk classes (by version), to tell whether the field is already native
    kind: Kind
    label: str  # as the header's ``streams`` lists it
    native_from: tuple[int, int] | None  # the first vLLM that streams the field itself (None: none yet)


TARGETS = (
    StreamTarget(
        CHAT_MODULE,
        "OpenAIServingChat",
        "chat_completion_stream_generator",
        ("ChatCompletionStreamResponse",),
        "chat",
        "chat",
        NATIVE,
    ),
    StreamTarget(
        COMPLETION_MODULE,
        "OpenAIServingCompletion",
        "completion_stream_generator",
        ("CompletionStreamResponse",),
        "completion",
        "completions",
        NATIVE,
    ),
    StreamTarget(
        GENERATE_MODULE,
        "ServingTokens",
        "serve_tokens_stream_generator",
        ("GenerateStreamResponse", "GenerateTokensStreamResponse"),  # 0.26-0.32, 0.33+
        "generate",
        "generate",
        None,
    ),
)


class _State:
    def __init__(self) -> None:
        self.version = ""
        self.registered = False
        self.patched: list[str] = []  # labels of patched streams, in TARGETS order
        self.rewrite_failures = 0


STATE = _State()


def parse_version(v: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", ""))


# -- the stream wrapper ---------------------------------------------------------------------


class _Last:
    """The ``kv_transfer_params`` of the engine output the stream generator is working on."""

    params: dict[str, Any] | None = None


async def _tap(gen: AsyncIterator[Any], last: _Last) -> AsyncIterator[Any]:
    """Pass the engine's outputs through, remembering each one's ``kv_transfer_params``.

    Chat streams get ``RequestOutput``s, completions streams ``(prompt_index, RequestOutput)``."""
    try:
        async for item in gen:
            res = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            params = getattr(res, FIELD, None)
            last.params = params if isinstance(params, dict) else None
            yield item
    finally:
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            await aclose()


def _rewrite(event: str, kind: Kind, params: dict[str, Any] | None) -> str:
    try:
        return rewrite_event(event, kind, params)
    except Exception:
        STATE.rewrite_failures += 1
        if STATE.rewrite_failures == 1:
            log.exception("turnkv plugin: could not add kv_transfer_params to a chunk; sending it unchanged")
        return event


def wrap_stream_generator(orig: Callable[..., AsyncIterator[Any]], kind: Kind) -> Callable[..., AsyncIterator[Any]]:
    """An async generator function that runs ``orig`` on a tapped ``result_generator`` and rewrites its events."""
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        bound = sig.bind(*args, **kwargs)
        source = bound.arguments["result_generator"]
        last = _Last()
        tap = _tap(source, last)
        bound.arguments["result_generator"] = tap
        inner = orig(*bound.args, **bound.kwargs)
        try:
            async for event in inner:
                yield _rewrite(event, kind, last.params) if isinstance(event, str) else event
        finally:
            await inner.aclose()  # type: ignore[attr-defined]
            await tap.aclose()  # type: ignore[attr-defined]
            aclose = getattr(source, "aclose", None)
            if aclose is not None:  # also when the original never started iterating it
                await aclose()

    wrapper.__turnkv_patched__ = True  # type: ignore[attr-defined]
    return wrapper


def patch_stream(module: ModuleType, target: StreamTarget) -> str | None:
    """Patch one stream generator in ``module``; None when done, else why not."""
    cls = getattr(module, target.cls, None)
    if cls is None:
        return f"{target.module} has no {target.cls}"
    orig = cls.__dict__.get(target.method)
    if orig is None or not inspect.isasyncgenfunction(orig):
        return f"{target.cls}.{target.method} is missing or not an async generator"
    if getattr(orig, "__turnkv_patched__", False):
        return None
    if "result_generator" not in inspect.signature(orig).parameters:
        return f"{target.cls}.{target.method} takes no result_generator"
    for name in target.stream_cls:
        stream_cls = getattr(module, name, None)
        if FIELD in (getattr(stream_cls, "model_fields", None) or {}):
            return f"{name} already has {FIELD} (native)"
    setattr(cls, target.method, wrap_stream_generator(orig, target.kind))
    STATE.patched.append(target.label)
    return None


# -- the header -----------------------------------------------------------------------------


def add_middleware(app: Any, cls: Any, **options: Any) -> None:
    """Add an ASGI middleware even after the app built its middleware stack.

    vLLM 0.26's ``build_app`` returns an app whose stack is already built, so Starlette's
    ``add_middleware`` raises "Cannot add middleware after an application has started" (seen on the
    H200 run). Starlette builds the stack lazily from ``user_middleware`` when ``middleware_stack`` is
    None, so the middleware is inserted there and the stack is dropped, to be rebuilt on the first request.
    """
    try:
        app.add_middleware(cls, **options)
        return
    except RuntimeError:
        pass
    from starlette.middleware import Middleware

    app.user_middleware.insert(0, Middleware(cls, **options))
    app.middleware_stack = None


def patch_build_app(module: ModuleType) -> str | None:
    orig = getattr(module, "build_app", None)
    if orig is None or not callable(orig):
        return f"{module.__name__} has no build_app"
    if getattr(orig, "__turnkv_patched__", False):
        return None

    @functools.wraps(orig)
    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = orig(*args, **kwargs)  # imports the routers, which applies the deferred stream patches
        gpus = server_gpus(args[0] if args else kwargs.get("args"))
        if not STATE.patched and not gpus:
            log.info("turnkv plugin: no stream generator was patched, no GPU known; not advertising %s", HEADER)
            return app
        value = header_value(STATE.version, STATE.patched, gpus)
        try:
            add_middleware(app, AdvertiseMiddleware, value=value)
            log.info("turnkv plugin: responses say %s: %s", HEADER, value)
        except Exception:
            log.exception("turnkv plugin: could not add the x-turnkv-plugin header")
        return app

    build_app.__turnkv_patched__ = True  # type: ignore[attr-defined]
    module.build_app = build_app  # type: ignore[attr-defined]
    return None


def server_gpus(args: Any) -> list[str]:
    """The UUIDs of the GPUs the server computes on (``gpus``), [] where unknown; never raises."""
    try:
        return engine_gpus(args, os.environ.get(VISIBLE_ENV), load_nvml())
    except Exception:
        log.exception("turnkv plugin: could not tell which GPUs this server computes on")
        return []


# -- applying patches now or when a module is imported -------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module as its own loader would, then patches it."""

    def __init__(self, inner: Any, patch: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_data, get_resource_reader, ... as the inner loader
        return getattr(self._inner, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Patches named modules right after they are first imported; otherwise finds nothing."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = dict(patches)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        del self.patches[fullname]
        if not self.patches and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def _stream_patcher(target: StreamTarget) -> Callable[[ModuleType], None]:
    def apply(module: ModuleType) -> None:
        why = patch_stream(module, target)
        if why is None:
            log.info("turnkv plugin: patched %s.%s (streams end with %s)", target.cls, target.method, FIELD)
        else:
            log.info("turnkv plugin: did not patch %s.%s: %s", target.cls, target.method, why)

    return apply


def _app_patcher(module: ModuleType) -> None:
    why = patch_build_app(module)
    if why is not None:
        log.info("turnkv plugin: did not patch build_app: %s", why)


def install() -> str:
    """Apply or defer every patch; returns (and logs) the one line that says what was done."""
    if STATE.registered:
        return "turnkv plugin: already registered in this process"
    STATE.registered = True
    from vllm_turnkv import __version__

    STATE.version = __version__
    switch = os.environ.get(DISABLE_ENV, "1").strip().lower()
    vv = vllm_version()
    head = f"turnkv plugin {__version__} on vLLM {vv or 'unknown'} (pid {os.getpid()})"
    if switch in ("0", "false", "off", "no"):
        return _say(f"{head}: disabled by {DISABLE_ENV}={switch}; nothing patched")
    vt = parse_version(vv)
    if vt is not None and vt < FIRST:
        return _say(f"{head}: vLLM < 0.26 has no bidirectional KV transfer; nothing patched")
    targets = [t for t in TARGETS if vt is None or t.native_from is None or vt < t.native_from]
    native = [t.label for t in TARGETS if t not in targets]
    done: list[str] = []
    skipped: list[str] = [f"{', '.join(native)} (streamed natively from vLLM 0.33)"] if native else []
    deferred: dict[str, Callable[[ModuleType], None]] = {}
    for t in targets:
        mod = sys.modules.get(t.module)
        if mod is None:
            deferred[t.module] = _stream_patcher(t)
            continue
        why = patch_stream(mod, t)
        (done if why is None else skipped).append(f"{t.cls}.{t.method}" + ("" if why is None else f" ({why})"))
    api = sys.modules.get(API_SERVER_MODULE)
    if vt is not None and vt >= NATIVE:
        pass  # no build_app there: the header comes through the endpoint plugin (``endpoint``)
    elif api is None:
        deferred[API_SERVER_MODULE] = _app_patcher
    else:
        why = patch_build_app(api)
        (done if why is None else skipped).append("build_app" + ("" if why is None else f" ({why})"))
    if deferred:
        sys.meta_path.insert(0, PostImportFinder(deferred))
    parts = [f"patched {', '.join(done)}" if done else "patched nothing yet"]
    if deferred:
        parts.append(f"will patch {', '.join(sorted(deferred))} when this process imports them")
    if skipped:
        parts.append(f"not patched: {'; '.join(skipped)}")
    return _say(f"{head}: " + "; ".join(parts))


def _say(line: str) -> str:
    log.info("%s", line)
    return line
