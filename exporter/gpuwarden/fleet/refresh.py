"""Answers kept warm: the fleet's heavy views are served from memory and recomputed behind the reader's back.

A view's answer younger than the cache TTL is served as it is. An older one, up to `max_stale`, is served at once,
marked stale with its age, while one recomputation starts in the background (stale-while-revalidate); past
`max_stale`, or when there is none, the caller waits for a fresh one, shared with any concurrent caller. Views
asked for within `keep_warm` are recomputed every `refresh_interval` by a background task, so a reader seldom
meets a cold answer; a view nobody reads stops costing Prometheus anything. Every answer says how old it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("gpuwarden.fleet")

Compute = Callable[[], Awaitable[dict[str, Any]]]


@dataclass
class _Entry:
    compute: Compute
    answer: dict[str, Any] | None = None
    computed_at: float = 0.0  # monotonic
    evaluated_at: float = 0.0  # wall clock, when the computation began
    asked_at: float = 0.0  # monotonic, the last reader
    running: asyncio.Task[dict[str, Any]] | None = field(default=None, repr=False)


class AnswerCache:
    def __init__(
        self,
        ttl: float,
        max_stale: float,
        refresh_interval: float,
        keep_warm: float = 600.0,
        max_views: int = 64,
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
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(compute, asked_at=self.clock())
            self._forget_oldest()
        entry.asked_at = self.clock()
        age = self.clock() - entry.computed_at
        if entry.answer is not None and age < self.ttl:
            self.served.labels("fresh").inc()
            return self._dated(entry, stale=False)
        if entry.answer is not None and age < self.max_stale:
            self._start(entry)
            self.served.labels("stale").inc()
            return self._dated(entry, stale=True)
        await asyncio.shield(self._start(entry))
        self.served.labels("computed").inc()
        return self._dated(entry, stale=False)

    def _start(self, entry: _Entry) -> asyncio.Task[dict[str, Any]]:
        """One recomputation of a view at a time; callers and the refresher share it."""
        if entry.running is None or entry.running.done():
            entry.running = asyncio.get_running_loop().create_task(self._compute(entry))
            entry.running.add_done_callback(_retrieve)
        return entry.running

    async def _compute(self, entry: _Entry) -> dict[str, Any]:
        began = self.wall()
        answer = await entry.compute()
        entry.answer, entry.computed_at, entry.evaluated_at = answer, self.clock(), began
        return answer

    def _dated(self, entry: _Entry, stale: bool) -> dict[str, Any]:
        assert entry.answer is not None
        age = self.clock() - entry.computed_at
        freshness = {
            "computed_at": round(entry.evaluated_at, 3),
            "age_seconds": round(age, 1),
            "stale": stale,
            "note": "stale: served while a fresh answer is computed (at most max_stale old)" if stale else None,
        }
        return {**entry.answer, "freshness": freshness}

    def _forget_oldest(self) -> None:
        while len(self._entries) > self.max_views:
            oldest = min(self._entries, key=lambda k: self._entries[k].asked_at)
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
