"""Memory handed back after a burst of connections: the cyclic GC's leftovers, and glibc's free lists.

Memory handed back after a burst of connections: what the cyclic GC has not collected yet, and what glibc's malloc
keeps once it is freed.

A flood of 4,000 stalled TLS handshakes (bench/memory_after_attacks.py) left the exporter 45 MiB above its baseline a
minute after it ended, for good: ~34 MiB of asyncio's and uvicorn's connection objects sat in reference cycles that
the GC had not reached (few allocations once the flood is over, so no full collection), and once collected, glibc
kept the freed heap (free chunks between live ones, which it returns only when asked: `malloc_trim`). So every
`SETTLE_EVERY_S` the supervisor thread runs a full collection (start-up's objects are frozen out of it:
service.settle_memory) and, where malloc then holds at least `TRIM_ABOVE_BYTES` free, `malloc_trim(0)`, which hands
the free pages of every arena back. Both cost a few milliseconds on this process's heap; the trim only runs after
memory was freed. Off glibc (musl, macOS) only the collection runs.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SETTLE_EVERY_S = 30.0  # half the time within which memory must be back after a burst (issue 48: a minute)
TRIM_ABOVE_BYTES = 4 * 1024 * 1024  # free bytes in malloc's arenas worth a trim


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): size_t fields, so no wrap at 4 GiB."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


class Glibc:
    """malloc's free bytes and its trim, through glibc; `available` is False elsewhere (then both do nothing)."""

    def __init__(self) -> None:
        try:
            libc = ctypes.CDLL(None)
            self._trim = libc.malloc_trim
            self._info = libc.mallinfo2
            self._info.restype = _MallInfo2
            self.available = True
        except (OSError, AttributeError):  # not glibc, or older than 2.33 (no mallinfo2)
            self.available = False

    def free_bytes(self) -> int:
        """Bytes malloc holds free in its arenas (all of them: mallinfo2 sums them)."""
        return int(self._info().fordblks) if self.available else 0

    def trim(self) -> None:
        if self.available:
            self._trim(0)


@dataclass(frozen=True)
class Settled:
    """What one settle found: objects the collection freed, and malloc's free bytes before the trim (if it ran)."""

    collected: int
    free_bytes: int
    trimmed: bool


class MemorySettler:
    """Runs `settle` at most every `every_s` seconds when ticked (the supervisor ticks it several times a second)."""

    def __init__(
        self,
        every_s: float = SETTLE_EVERY_S,
        trim_above: int = TRIM_ABOVE_BYTES,
        allocator: Glibc | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_s, self.trim_above = every_s, trim_above
        self.allocator = allocator if allocator is not None else Glibc()
        self.clock = clock
        self._last = clock()

    def tick(self) -> Settled | None:
        now = self.clock()
        if now - self._last < self.every_s:
            return None
        self._last = now
        return self.settle()

    def settle(self) -> Settled:
        collected = gc.collect()
        free = self.allocator.free_bytes()
        trimmed = free >= self.trim_above
        if trimmed:
            self.allocator.trim()
            log.debug("memory settled: %d objects collected, %.1f MiB free in malloc trimmed", collected, free / 2**20)
        return Settled(collected, free, trimmed)
