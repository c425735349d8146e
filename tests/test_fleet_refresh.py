"""The fleet's answer cache (exporter/gpuwarden/fleet/refresh.py): fresh within the TTL, stale-while-revalidate up to
max_stale, one recomputation shared by every caller, background refresh of the views read lately, failures that
keep the last answer. Pure asyncio: the computations are coroutines this test controls, and time is a clock it
moves (no sleeps, no wall-clock bounds)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpuwarden.fleet.refresh import AnswerCache


class View:
    """A view whose answers count up; `gate` holds a computation until the test lets it finish."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("prometheus said no")
        return {"answer": self.calls}


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


class Clock:
    """The cache's clocks, moved by the test: `monotonic` for ages, `wall` for when an answer was computed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_800_000_000.0 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def cache_with(clock: Clock, **settings: Any) -> AnswerCache:
    return AnswerCache(clock=clock.monotonic, wall=clock.wall, **settings)


async def answered(ttl: float, max_stale: float) -> tuple[Clock, AnswerCache, View]:
    """A cache, on a clock the test moves and with no background refresh, that has answered "health" once."""
    clock = Clock()
    cache, view = cache_with(clock, ttl=ttl, max_stale=max_stale, refresh_interval=0), View()
    await cache.get("health", view)
    return clock, cache, view


async def settle(cache: AnswerCache, key: str) -> None:
    """Let a background recomputation of `key` finish (or fail)."""
    running = cache._entries[key].running
    if running is not None:
        await asyncio.gather(running, return_exceptions=True)


def test_within_the_ttl_the_answer_is_served_from_memory() -> None:
    async def scenario() -> None:
        clock = Clock()
        cache, view = cache_with(clock, ttl=60, max_stale=120, refresh_interval=0), View()
        first = await cache.get("health", view)
        clock.advance(59)
        second = await cache.get("health", view)
        assert view.calls == 1
        assert first["answer"] == second["answer"] == 1
        assert second["freshness"]["stale"] is False
        assert second["freshness"]["computed_at"] == first["freshness"]["computed_at"]

    run(scenario())


def test_past_the_ttl_the_last_answer_is_served_stale_while_one_recomputation_runs() -> None:
    async def scenario() -> None:
        clock, cache, view = await answered(ttl=5, max_stale=60)
        clock.advance(8)
        view.gate = asyncio.Event()
        stale = await asyncio.wait_for(cache.get("health", view), 10)  # served at once, not after the gate
        again = await asyncio.wait_for(cache.get("health", view), 10)
        assert stale["answer"] == again["answer"] == 1
        assert stale["freshness"]["stale"] is True and stale["freshness"]["age_seconds"] == 8
        assert view.calls == 2  # one recomputation for both stale readers
        view.gate.set()
        await settle(cache, "health")
        fresh = await cache.get("health", view)
        assert fresh["answer"] == 2 and fresh["freshness"]["stale"] is False

    run(scenario())


def test_past_max_stale_the_reader_waits_for_a_fresh_answer_shared_with_concurrent_readers() -> None:
    async def scenario() -> None:
        clock, cache, view = await answered(ttl=2, max_stale=5)
        clock.advance(8)
        answers = await asyncio.gather(*(cache.get("health", view) for _ in range(5)))
        assert {a["answer"] for a in answers} == {2}
        assert view.calls == 2
        assert not any(a["freshness"]["stale"] for a in answers)

    run(scenario())


def test_a_failed_recomputation_keeps_the_last_answer_until_max_stale_then_the_reader_gets_the_error() -> None:
    async def scenario() -> None:
        clock, cache, view = await answered(ttl=2, max_stale=20)
        view.fail = True
        clock.advance(3)
        stale = await cache.get("health", view)
        await settle(cache, "health")  # the recomputation failed
        clock.advance(1)
        still = await cache.get("health", view)
        assert stale["answer"] == still["answer"] == 1 and still["freshness"]["stale"] is True
        await settle(cache, "health")
        clock.advance(20)
        with pytest.raises(RuntimeError, match="prometheus said no"):
            await cache.get("health", view)

    run(scenario())


def test_the_background_refresh_recomputes_views_read_lately_and_leaves_the_others() -> None:
    async def scenario() -> None:
        clock = Clock()
        cache = cache_with(clock, ttl=2, max_stale=60, refresh_interval=2, keep_warm=15)
        read, forgotten = View(), View()
        await cache.get("forgotten", forgotten)
        clock.advance(20)  # past keep_warm for "forgotten"
        await cache.get("read", read)
        clock.advance(3)
        assert await cache.refresh_once() == 1
        assert (read.calls, forgotten.calls) == (2, 1)
        answer = await cache.get("read", read)
        assert answer["answer"] == 2 and answer["freshness"]["stale"] is False
        assert await cache.refresh_once() == 0  # just recomputed: younger than the interval

    run(scenario())


def test_the_background_task_keeps_an_answer_fresh_without_a_reader_waiting() -> None:
    async def scenario() -> None:
        # the loop wakes every max(1 s, interval / 4) of real time; the answers age on the test's clock
        clock = Clock()
        cache, view = cache_with(clock, ttl=60, max_stale=600, refresh_interval=4), View()
        await cache.get("page", view)
        cache.start_refreshing()
        clock.advance(30)  # older than the refresh interval, still within the TTL: only the refresher recomputes
        for _ in range(1000):  # until the loop has woken (about 1 s), not a fixed sleep
            if view.calls == 2:
                break
            await asyncio.sleep(0.01)
        recomputed_by_itself = view.calls
        answer = await cache.get("page", view)
        await cache.stop()
        assert recomputed_by_itself == 2
        assert answer["answer"] == 2 and answer["freshness"]["stale"] is False

    run(scenario())


def test_the_views_kept_are_bounded() -> None:
    async def scenario() -> None:
        clock = Clock()
        cache = cache_with(clock, ttl=60, max_stale=60, refresh_interval=0, max_views=3)
        for window in range(10):
            clock.advance(1)
            await cache.get(f"utilization:{window}h", View())
        assert len(cache._entries) == 3
        assert set(cache._entries) == {"utilization:7h", "utilization:8h", "utilization:9h"}

    run(scenario())


def test_a_ttl_of_zero_turns_every_kind_of_reuse_off() -> None:
    async def scenario() -> None:
        cache, view = AnswerCache(ttl=0, max_stale=300, refresh_interval=30), View()
        await cache.get("health", view)
        await cache.get("health", view)
        assert view.calls == 2 and cache.max_stale == 0 and cache.refresh_interval == 0

    run(scenario())
