"""The NIXL stand-in between simulated engines: handshake, block reads and "done" notifications.

It listens on the side-channel host and port that the engine advertises as ``remote_host`` and
``remote_port`` in its ``kv_transfer_params``, as vLLM's ZMQ listener does, and speaks one JSON
object per line. A read returns whatever the named blocks hold now; nothing checks that they
still belong to the request that was pinned.

Messages are encoded with orjson: a pull of a few hundred blocks is ~190 KB of values, which the
stdlib's json took ~1.9 ms to write on the serving engine's event loop, the loop that also runs its
steps: every pull stretched one of the engine's steps by that much, which NIXL's reads (done by the
NIC or the copy engine, not the engine's step loop) do not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
_LIMIT = 64 * 1024 * 1024


class TransferError(RuntimeError):
    """A handshake, read or notification failed; the reading engine applies its failure policy."""


class SideChannelServer:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, limit=_LIMIT)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    reply = await self._handler(orjson.loads(line))
                except (ValueError, KeyError, TypeError) as exc:  # orjson.JSONDecodeError is a ValueError
                    reply = {"ok": False, "error": f"bad message: {exc}"}
                writer.write(orjson.dumps(reply) + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@dataclass
class Peer:
    engine_id: str
    clock: float


class SideChannelClient:
    """One connection to a remote engine's side channel, used for one transfer."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self._addr = (host, port)
        self._timeout = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> SideChannelClient:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(*self._addr, limit=_LIMIT), self._timeout
            )
        except (OSError, TimeoutError) as exc:
            raise TransferError(f"handshake with {self._addr[0]}:{self._addr[1]} failed: {exc}") from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()

    async def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._reader is not None and self._writer is not None
        try:
            self._writer.write(orjson.dumps(message) + b"\n")
            await self._writer.drain()
            line = await asyncio.wait_for(self._reader.readline(), self._timeout)
        except (OSError, TimeoutError) as exc:
            raise TransferError(f"side channel {message['op']} failed: {exc}") from exc
        if not line:
            raise TransferError("side channel closed")
        reply: dict[str, Any] = orjson.loads(line)
        if not reply.get("ok"):
            raise TransferError(str(reply.get("error", "remote error")))
        return reply

    async def handshake(self, expected_engine_id: str) -> Peer:
        reply = await self._call({"op": "handshake"})
        if reply["engine_id"] != expected_engine_id:
            raise TransferError(
                f"Remote NIXL agent engine ID mismatch. Expected {expected_engine_id}, received {reply['engine_id']}."
            )
        return Peer(reply["engine_id"], float(reply["clock"]))

    async def read(self, engine_id: str, block_ids: Sequence[int]) -> list[list[int]]:
        reply = await self._call({"op": "read", "engine_id": engine_id, "block_ids": list(block_ids)})
        blocks: list[list[int]] = reply["blocks"]
        return blocks

    async def notify(self, request_id: str) -> None:
        await self._call({"op": "notify", "request_id": request_id})
