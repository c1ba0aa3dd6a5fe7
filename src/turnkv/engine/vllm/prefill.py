"""What both vLLM engines (chat, and four hops over tokens-only engines) ask of P and read back, whichever
path and body each sends: the one-token prefill's answer, a release, and a write-back's stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import aiohttp

from turnkv.engine.base import PrefillCall, PrefillResult
from turnkv.engine.vllm.http import Upstream
from turnkv.engine.vllm.refusals import as_client_asked
from turnkv.errors import UpstreamStatus, UpstreamTimeout, aiohttp_errors

RELEASE_TIMEOUT_S = 10.0  # a release's request until P answers its headers
RELEASE_WAIT_S = 2.0  # then, until its first event: past it the release is aborted in P's queue (D is told)
RELEASE_MAX_TOKENS = 16  # P decodes until the gateway closes the stream, not to a finish that would pin
# a write-back too: a request that finishes with its params' do_remote_decode unset is a "D node" to vLLM's
# connector, which pins its blocks for decoder_kv_blocks_ttl (pull_scheduler.py request_finished, 0.26); one
# aborted after its first output frees them into P's prefix cache, where they were cached when the pull ended
WRITE_BACK_MAX_TOKENS = 256

T = TypeVar("T")


async def ask_prefill(
    upstream: Upstream, base: str, path: str, body: Any, headers: Mapping[str, str], call: PrefillCall
) -> dict[str, Any]:
    """P's answer to the one-token prefill; a refusal is restated in the numbers the client asked for."""
    try:
        return await upstream.post_json("prefill", base, path, body, headers, timeout_s=call.timeout_s)
    except UpstreamStatus as exc:
        raise as_client_asked(exc, call.body) from None  # the client's numbers, not the one-token prefill's


def prefill_result(data: Mapping[str, Any], prompt_ids: Sequence[int] | None) -> PrefillResult:
    """P's answer as the seam's ``PrefillResult``: its params for D, and its usage where it gave one."""
    params = data.get("kv_transfer_params")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached, prompt = details.get("cached_tokens"), usage.get("prompt_tokens")
    return PrefillResult(
        for_decode=params if isinstance(params, dict) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
    )


async def send_release(upstream: Upstream, base: str, path: str, body: Any, headers: Mapping[str, str]) -> None:
    """Open the release's stream on P and close it at its first event or after ``RELEASE_WAIT_S`` in P's
    queue: either way D is told (P notifies D when it allocates the request, and vLLM's abort path notifies D
    for a request aborted before that)."""
    try:
        async with asyncio.timeout(RELEASE_TIMEOUT_S):
            resp = await upstream.open_stream("prefill", base, path, body, headers)
    except TimeoutError:
        raise UpstreamTimeout("release: no answer from the prefill engine", leg="prefill", instance=base) from None
    try:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout(RELEASE_WAIT_S):
                await resp.content.readany()
    finally:
        resp.close()  # P aborts the request: D has been told, or is told by the abort


async def read_write_back(
    upstream: Upstream,
    base: str,
    path: str,
    body: Any,
    headers: Mapping[str, str],
    timeout_s: float,
    first_output: Callable[[aiohttp.ClientResponse, str], Awaitable[T]],
) -> T:
    """Open the write-back's stream on P, read it to its first output (``first_output``) and close it, all
    within ``timeout_s``: the close aborts the request, so its blocks go to P's prefix cache, unpinned."""
    try:
        async with asyncio.timeout(timeout_s):
            resp = await upstream.open_stream("prefill", base, path, body, headers)
            try:
                with aiohttp_errors("prefill", base):
                    return await first_output(resp, base)
            finally:
                resp.close()
    except TimeoutError:
        raise UpstreamTimeout(
            "write-back: the prefill engine did not pull in time", leg="prefill", instance=base
        ) from None
