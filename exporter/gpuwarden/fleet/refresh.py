"""Answers kept warm: the fleet's heavy views are served from memory and recomputed behind the reader's back.

A view's answer younger than the cache TTL is served as it is. An older one, up to `max_stale`, is served at once,
marked stale with its age, while one recomputation starts in the background (stale-while-revalidate); past
`max_stale`, or when there is none, the caller waits for a fresh one, shared with any concurrent caller. Views
asked for within `keep_warm` are recomputed every `refresh_interval` by a background task, so a reader seldom
meets a cold answer; a view nobody reads stops costing Prometheus anything. Every answer says how old it is.

Each answer is rendered as JSON once, when it is computed, and every reader of it is sent those same bytes (and its
own `freshness`): 1,100 clients that never read a 730 KB answer held 1,100 copies of it (an OOM kill at 384 MiB,
issue 48), and rendering it per request cost a core for seconds. The answers kept are bounded in number and in
estimated bytes (the JSON and the objects it was rendered from); the least recently read go first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("gpuwarden.fleet")

Compute = Callable[[], Awaitable[dict[str, Any]]]
OBJECTS_PER_JSON_BYTE = 5  # an answer's dicts and lists hold ~3-5x its JSON (measured on the inventory at 10,000 nodes)


def render(answer: dict[str, Any]) -> bytes:
    """The answer as FastAPI's JSONResponse renders it (UTF-8, compact, no NaN)."""
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@dataclass
class _Entry:
    compute: Compute
    answer: dict[str, Any] | None = None
    computed_at: float = 0.0  # monotonic
    evaluated_at: float = 0.0  # wall clock, when the computation began
    asked_at: float = 0.0  # monotonic, the last reader
    body: bytes = b""  # the answer rendered once (render()), shared by every reader
    running: asyncio.Task[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """Estimated memory of the answer kept: its JSON and the objects it was rendered from."""
        return len(self.body) * (1 + OBJECTS_PER_JSON_BYTE)


class AnswerCache:
    def __init__(
        self,
        ttl: float,
        max_stale: float,
        refresh_interval: float,
        keep_warm: float = 600.0,
        max_views: int = 64,
        max_bytes: int = 48 * 1024 * 1024,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.clock, self.wall = clock, wall  # ages on `clock`; `computed_at` on the wall clock (tests inject both)
        self.ttl = ttl
        self.max_stale = max_stale if ttl > 0 else 0.0
        self.refresh_interval = refresh_interval if ttl > 0 else 0.0
        self.keep_warm = keep_warm
        self.max_views = max_views  # distinct (view, parameters) kept: utilization windows are caller-chosen
        self.max_bytes = max_bytes  # ... and their estimated memory (Entry.size)
        self._entries: dict[str, _Entry] = {}
        self._refresher: asyncio.Task[None] | None = None
        self.served = Counter(
            "gpuwarden_fleet_answers",
            "Answers of the fleet's views, by how they were served: fresh (from memory, within the TTL), stale "
            "(from memory past the TTL while recomputed), computed (the reader waited for Prometheus).",
            ["served"],
            registry=registry if registry is not None else CollectorRegistry(),
        )
        for served in ("fresh", "stale", "computed"):
            self.served.labels(served)

    async def get(self, key: str, compute: Compute) -> dict[str, Any]:
        """The view's answer with a `freshness` object: its evaluation time, age and whether it is stale."""
        entry, stale = await self._serve(key, compute)
        assert entry.answer is not None
        return {**entry.answer, "freshness": self._freshness(entry, stale)}

    async def get_rendered(self, key: str, compute: Compute) -> tuple[bytes, dict[str, Any]]:
        """The view's answer as its JSON rendered once (without `freshness`), and this reader's `freshness`."""
        entry, stale = await self._serve(key, compute)
        return entry.body, self._freshness(entry, stale)

    async def _serve(self, key: str, compute: Compute) -> tuple[_Entry, bool]:
        """The entry holding the view's answer, and whether that answer is stale."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(compute, asked_at=self.clock())
            self._forget_oldest()
        entry.asked_at = self.clock()
        age = self.clock() - entry.computed_at
        if entry.answer is not None and age < self.ttl:
            self.served.labels("fresh").inc()
            return entry, False
        if entry.answer is not None and age < self.max_stale:
            self._start(entry)
            self.served.labels("stale").inc()
            return entry, True
        await asyncio.shield(self._start(entry))
        self.served.labels("computed").inc()
        return entry, False

    def _start(self, entry: _Entry) -> asyncio.Task[dict[str, Any]]:
        """One recomputation of a view at a time; callers and the refresher share it."""
        if entry.running is None or entry.running.done():
            entry.running = asyncio.get_running_loop().create_task(self._compute(entry))
            entry.running.add_done_callback(_retrieve)
        return entry.running

    async def _compute(self, entry: _Entry) -> dict[str, Any]:
        began = self.wall()
        try:
            answer = await entry.compute()
        except Exception as exc:
            # kept on the task until the next computation: without its traceback and chained exceptions, whose
            # frames hold the answers the view had read (a failed view of 50,000-series answers kept them all)
            exc.__context__ = exc.__cause__ = None
            raise exc.with_traceback(None) from None
        body = render(answer)
        entry.answer, entry.body, entry.computed_at, entry.evaluated_at = answer, body, self.clock(), began
        self._forget_oldest(keep=entry)
        return answer

    def _freshness(self, entry: _Entry, stale: bool) -> dict[str, Any]:
        age = self.clock() - entry.computed_at
        return {
            "computed_at": round(entry.evaluated_at, 3),
            "age_seconds": round(age, 1),
            "stale": stale,
            "note": "stale: served while a fresh answer is computed (at most max_stale old)" if stale else None,
        }

    @property
    def kept_bytes(self) -> int:
        return sum(entry.size for entry in self._entries.values())

    def _forget_oldest(self, keep: _Entry | None = None) -> None:
        """Drop the least recently read views while more than max_views or max_bytes are kept (never `keep`, the
        answer just computed: it is served, and goes at the next computation if it alone is over)."""
        while len(self._entries) > self.max_views or (len(self._entries) > 1 and self.kept_bytes > self.max_bytes):
            others = [k for k, e in self._entries.items() if e is not keep]
            if not others:
                return
            oldest = min(others, key=lambda k: self._entries[k].asked_at)
            del self._entries[oldest]

    # -- background refresh -------------------------------------------------------------------------------------

    def start_refreshing(self) -> None:
        if self.refresh_interval > 0 and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        for entry in self._entries.values():
            if entry.running is not None and not entry.running.done():
                entry.running.cancel()

    async def refresh_once(self) -> int:
        """Recompute, one after another, the views read within keep_warm whose answer is older than the refresh
        interval; how many were recomputed. A failure keeps the last answer (it ages, and says so)."""
        done = 0
        now = self.clock()
        for entry in list(self._entries.values()):
            if now - entry.asked_at > self.keep_warm or now - entry.computed_at < self.refresh_interval:
                continue
            with contextlib.suppress(Exception):  # logged by _retrieve; the last answer stays and ages
                await self._start(entry)
                done += 1
        return done

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.refresh_interval / 4))
            await self.refresh_once()


def _retrieve(task: asyncio.Task[dict[str, Any]]) -> None:
    """A background recomputation's failure is logged (a reader waiting on it gets it raised as well)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("fleet view recomputation failed: %s", task.exception())
