"""A TCP relay on loopback, on its own event loop in a thread: what benchmarks and tests put between a
client and a server to watch or shape the traffic (count Redis round trips, delay a path, hold commands
until a test lets them through).

It decides only the plumbing: one upstream connection per client connection, both directions pumped
until either side closes, every task cancelled and the loop closed on ``stop``, every wait bounded.
What a relay does to the bytes is a subclass's ``to_server`` / ``to_client`` hook, which sees each
chunk with its connection's own state before it is forwarded (and may wait, to delay or hold it).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Self

START_TIMEOUT_S = 10.0
CHUNK = 65536


class LoopbackRelay:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    async def to_server(self, data: bytes, conn: dict[str, Any]) -> None:
        """Called with each chunk a client sends, before it is forwarded."""

    async def to_client(self, data: bytes, conn: dict[str, Any]) -> None:
        """Called with each chunk the server answers, before it is forwarded."""

    def start(self) -> Self:
        ready = threading.Event()

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, name=type(self).__name__, daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"{type(self).__name__} did not start")
        return self

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the relay's loop (its events belong to that loop)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(close(), loop).result(START_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(START_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn: dict[str, Any] = {}
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            await asyncio.gather(
                self._pump(reader, up_writer, self.to_server, conn),
                self._pump(up_reader, writer, self.to_client, conn),
                return_exceptions=True,
            )
        except (OSError, asyncio.CancelledError):
            # cancelled by ``stop``: ending quietly (asyncio's stream server would log a cancelled
            # handler's exception as unhandled)
            writer.close()

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, hook: Any, conn: dict[str, Any]) -> None:
        try:
            while data := await src.read(CHUNK):
                await hook(data, conn)
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()
