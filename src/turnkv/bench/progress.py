"""A plain-text progress line on stderr: redrawn in place on a terminal, printed now and then otherwise."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Progress:
    label: str
    total: int
    done: int = 0
    errors: int = 0
    active: int = 0
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        width = 24
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} requests, {self.errors} errors, "
            f"{self.active} active, {time.monotonic() - self.started:.0f} s"
        )

    async def run(self, enabled: bool = True) -> None:
        """Redraws until cancelled."""
        if not enabled:
            return
        tty = self.stream.isatty()
        period = 0.5 if tty else 10.0
        try:
            while True:
                await asyncio.sleep(period)
                self._draw(tty)
        finally:
            self._draw(tty)
            if tty:
                self.stream.write("\n")
            self.stream.flush()

    def _draw(self, tty: bool) -> None:
        self.stream.write(("\r" + self.line()) if tty else (self.line() + "\n"))
        self.stream.flush()
