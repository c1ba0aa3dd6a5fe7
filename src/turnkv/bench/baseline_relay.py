"""The bare relays: the least a Python proxy in front of an engine can cost, as the overhead suite's baselines.

An aiohttp.web server that forwards each request's method, path, body and content type to one upstream
engine and streams the answer back as it arrives, without parsing either side. The overhead suite runs it
pinned like the gateway and divides turnkv's gateway CPU per request by this relay's: the ratio is what
turnkv's own work costs on top of relaying. Run as ``python -m turnkv.bench.baseline_relay --upstream URL``;
it prints ``{"listening": URL}`` once it accepts connections, like ``turnkv serve``.

With ``--prefill URL`` it is the bare P/D relay: the least any P/D router has to do per chat request (the
handshake vLLM's P/D proxies make): parse the request, send it to P with one token to generate and
``do_remote_decode`` (no stream), read P's ``kv_transfer_params``, and send the request with them to the
upstream D, streaming D's answer back unparsed. JSON through orjson, as turnkv's hot path. No checks,
errors passed through as the engines give them: a floor to measure turnkv's stateless turns against, not a
router to deploy.

``--server uvicorn`` serves the same relay as a bare ASGI app on uvicorn (``baseline_asgi``), the server
stack turnkv runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence

import aiohttp
import orjson
from aiohttp import web

from turnkv import launch
from turnkv.bench.client import HOP_HEADERS, prefill_request, upstream_session

SERVERS = ("aiohttp", "uvicorn")


def make_app(upstream: str, prefill: str | None = None) -> web.Application:
    """One catch-all route (and with ``prefill``, the P/D handshake for chat requests); the upstream client
    session lives and closes with the app."""
    base = upstream.rstrip("/")
    p_base = prefill.rstrip("/") if prefill else None
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = upstream_session()

    async def stop(app: web.Application) -> None:
        await app[session_key].close()

    async def relay(request: web.Request, url: str, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        async with request.app[session_key].request(request.method, url, data=body or None, headers=headers) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in HOP_HEADERS}
        if p_base is not None and request.method == "POST" and request.path == "/v1/chat/completions":
            req = orjson.loads(body)
            async with request.app[session_key].post(
                p_base + "/v1/chat/completions", data=orjson.dumps(prefill_request(req)), headers=headers
            ) as p:
                answer = await p.read()
                if p.status != 200:
                    return web.Response(status=p.status, body=answer, content_type=p.content_type)
            req["kv_transfer_params"] = orjson.loads(answer).get("kv_transfer_params")
            body = orjson.dumps(req)
        return await relay(request, base + request.rel_url.path_qs, body, headers)

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def _serve(upstream: str, port: int, prefill: str | None) -> None:
    runner = web.AppRunner(make_app(upstream, prefill), access_log=None, handle_signals=False)
    await runner.setup()
    sock = launch.bind("127.0.0.1", port)
    site = web.SockSite(runner, sock, backlog=launch.LISTEN_BACKLOG)
    await site.start()
    launch.announce(sock)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await stopped.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m turnkv.bench.baseline_relay", description=__doc__)
    p.add_argument("--upstream", required=True, help="engine base URL (http://127.0.0.1:PORT)")
    p.add_argument("--prefill", default=None, help="a prefill engine: relay chat requests as P/D (upstream: D)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--server",
        choices=SERVERS,
        default="aiohttp",
        help="aiohttp.web (default), or uvicorn with a bare ASGI app (baseline_asgi): turnkv's server stack",
    )
    a = p.parse_args(argv)
    if a.server == "uvicorn":
        from turnkv.bench import baseline_asgi  # it builds on this module

        baseline_asgi.serve(a.upstream, a.port, a.prefill)
        return
    try:  # the same event loop uvicorn picks for the gateway, when installed
        import uvloop
    except ImportError:
        asyncio.run(_serve(a.upstream, a.port, a.prefill))
    else:
        uvloop.run(_serve(a.upstream, a.port, a.prefill))


if __name__ == "__main__":
    main()
