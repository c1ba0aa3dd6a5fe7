"""A TCP relay on loopback that delays what a client sends: a slow network path to one server."""

from __future__ import annotations

import asyncio
import threading

STOP_TIMEOUT_S = 10.0


class LatencyProxy:
    """Forwards 127.0.0.1:<port> to an upstream port; each chunk the client sends reaches the upstream
    `delay_s` later (answers are not delayed). Runs its own event loop in a thread."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def _run(self) -> None:
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(
            self._pump(reader, up_writer, self.delay_s), self._pump(up_reader, writer, 0.0), return_exceptions=True
        )

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay_s: float) -> None:
        try:
            while data := await src.read(65536):
                if delay_s:
                    await asyncio.sleep(delay_s)  # the injected latency, not a synchronisation
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        if not self._ready.wait(STOP_TIMEOUT_S):
            raise RuntimeError("latency proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(STOP_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        self._loop.close()
