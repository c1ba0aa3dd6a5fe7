"""A simple TCP load balancer on loopback, as an operator would put in front of several gateways: each new
connection goes to the next backend, round robin, among those whose ``/ready`` said 200 at the last check
(every CHECK_S); a backend that refuses the connection is skipped for the next one. It knows nothing of
turnkv beyond ``/ready``, as an nginx or HAProxy upstream would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

CHECK_S = 0.1
CHECK_TIMEOUT_S = 1.0
START_TIMEOUT_S = 10.0
PIPE_CHUNK = 65536


class Balancer:
    def __init__(self, backends: list[str]) -> None:
        """``backends``: base URLs (http://127.0.0.1:PORT)."""
        self.backends = backends
        self.ready = dict.fromkeys(backends, False)
        self.served: list[str] = []  # the backend of each connection, in order
        self.url = ""
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = threading.Event()

    def __enter__(self) -> Balancer:
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise RuntimeError("the balancer did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(START_TIMEOUT_S)

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        checks = asyncio.create_task(self._check_forever())
        await self._check_all()
        self._started.set()
        async with server:
            await self._stop.wait()
        checks.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checks

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            await self._check_all()

    async def _check_all(self) -> None:
        results = await asyncio.gather(*(asyncio.to_thread(_is_ready, b) for b in self.backends))
        self.ready = dict(zip(self.backends, results, strict=True))

    def _order(self) -> Iterator[str]:
        """The ready backends, starting at the next in turn."""
        n = len(self.backends)
        start, self._next = self._next, (self._next + 1) % n
        for i in range(n):
            b = self.backends[(start + i) % n]
            if self.ready.get(b):
                yield b

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for backend in self._order():
            host, port = backend.removeprefix("http://").rsplit(":", 1)
            try:
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
            except OSError:
                continue  # gone since the last check: the next one
            self.served.append(backend)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            return
        writer.close()  # no backend ready: the client sees the connection closed


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while chunk := await src.read(PIPE_CHUNK):
            dst.write(chunk)
            await dst.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.close()


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=CHECK_TIMEOUT_S) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False
