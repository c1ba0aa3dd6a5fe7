"""The bare relay: the least a Python proxy in front of an engine can cost, as the overhead suite's baseline.

An aiohttp.web server that forwards each request's method, path, body and content type to one upstream
engine and streams the answer back as it arrives, without parsing either side. The overhead suite runs it
pinned like the gateway and divides turnkv's gateway CPU per request by this relay's: the ratio is what
turnkv's own work costs on top of relaying. Run as ``python -m turnkv.bench.baseline_relay --upstream URL``;
it prints ``{"listening": URL}`` once it accepts connections, like ``turnkv serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from turnkv import launch

HOP_HEADERS = ("content-type", "accept")
UPSTREAM_TIMEOUT_S = 120.0


def make_app(upstream: str) -> web.Application:
    """One catch-all route; the upstream client session lives and closes with the app."""
    base = upstream.rstrip("/")
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0),
        )

    async def stop(app: web.Application) -> None:
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in HOP_HEADERS}
        async with request.app[session_key].request(
            request.method, base + request.rel_url.path_qs, data=body or None, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for data in up.content.iter_any():
                await resp.write(data)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def _serve(upstream: str, port: int) -> None:
    runner = web.AppRunner(make_app(upstream), access_log=None, handle_signals=False)
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
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    try:  # the same event loop uvicorn picks for the gateway, when installed
        import uvloop
    except ImportError:
        asyncio.run(_serve(a.upstream, a.port))
    else:
        uvloop.run(_serve(a.upstream, a.port))


if __name__ == "__main__":
    main()
