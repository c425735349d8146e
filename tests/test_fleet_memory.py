"""What the fleet service holds, bounded (issue 48): the budget of Prometheus' answers alive at once
(exporter/gpuwarden/fleet/memory.py), the bytes of answers on their way to clients (fleet/backpressure.py) and a
view's JSON rendered once for all its readers (fleet/refresh.py). In-process: a real PrometheusClient against a
fake Prometheus on loopback, the middleware under a hand-driven ASGI exchange. The whole service under hostile
clients and a backend at its caps, in a memory cgroup at the chart's limit: tests/test_fleet_hostile.py."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpuwarden.fleet.backpressure import PIECE_BYTES, ResponseBudget
from gpuwarden.fleet.memory import SMALL_SLACK, Answer, AnswerBudget, OverBudget, Reading, held_estimate
from gpuwarden.fleet.prometheus import AnswersOverBudget, PrometheusClient
from gpuwarden.fleet.refresh import AnswerCache
from tests.helpers.fake_prometheus import FakePrometheus, reply, vector


def test_an_answer_is_counted_until_nothing_refers_to_it() -> None:
    budget = AnswerBudget(limit=1000)
    budget.take(600)
    answer = Answer([1, 2, 3])
    budget.hold(answer, 600)
    with pytest.raises(OverBudget):
        budget.take(500)
    assert budget.used == 600 and budget.refused == 1
    del answer
    gc.collect()
    assert budget.used == 0
    budget.take(500)


def test_room_is_made_before_refusing_and_small_answers_pass_by_a_bounded_slack() -> None:
    dropped: list[int] = []
    budget = AnswerBudget(limit=1000)
    cached = [Answer([0])]
    budget.take(900)
    budget.hold(cached[0], 900)

    def make_room(wanted: int) -> None:
        dropped.append(wanted)
        cached.clear()  # the cache lets go of its answer: the finalizer gives its bytes back

    budget.make_room = make_room
    budget.take(800)
    assert dropped == [800] and budget.used == 800
    budget.take(SMALL_SLACK + 200, small=True)  # the readiness probe's answer, past a full budget
    with pytest.raises(OverBudget):
        budget.take(1, small=True)  # ... but not past the slack


def test_an_answer_being_read_is_reserved_piece_by_piece_and_given_back() -> None:
    budget = AnswerBudget(limit=100_000)
    with Reading(budget) as reading:
        reading.add(b"x" * 60_000)
        with pytest.raises(OverBudget):
            reading.add(b"x" * 60_000)  # past 64 KiB in all: no slack
        assert budget.used == 60_000
    assert budget.used == 0


def test_held_estimates_cover_what_parsed_answers_hold() -> None:
    """The estimate is what the budget trusts: measured with tracemalloc on three label shapes, it must not fall
    below what the parsed series really hold."""
    import tracemalloc

    from gpuwarden.fleet.prometheus import _parse, _series

    shapes = {
        "one label": lambda i: {"node": f"gpu-node-{i:05d}"},
        "a GPU's": lambda i: {"instance": f"10.0.{i // 250}.{i % 250}:10045", "node": f"gpu-node-{i:05d}",
                              "uuid": f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd", "gpu": str(i % 8), "check": "ecc"},
        "long values": lambda i: {"node": f"n{i}" + "x" * 300, "uuid": f"GPU-{i}" + "y" * 300},
    }  # fmt: skip
    for name, labels in shapes.items():
        raw = json.dumps(vector([{"metric": labels(i), "value": [1.0, "2"]} for i in range(5000)])).encode()
        gc.collect()
        tracemalloc.start()
        try:
            series = _series(_parse(raw))  # type: ignore[arg-type]
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert len(series) == 5000
        assert held <= held_estimate(5000, len(raw)), (name, held, held_estimate(5000, len(raw)))


def _answering_4000_series(labels: dict[str, str]) -> tuple[FakePrometheus, bytes]:
    """A fake Prometheus answering every query with 4,000 series (a node each, with `labels`), and that answer."""
    fake = FakePrometheus()
    items = [{"metric": {"node": f"gpu-node-{i:05d}", **labels}, "value": [1.0, "1"]} for i in range(4000)]
    body = json.dumps(vector(items)).encode()
    fake.answer = lambda query, handler: reply(handler, body)
    return fake, body


def _run_against(fake: FakePrometheus, scenario: Callable[[], Awaitable[None]]) -> None:
    try:
        asyncio.run(scenario())
    finally:
        fake.close()


def test_answers_past_the_budget_are_refused_and_given_back_when_done() -> None:
    """A real client against a fake Prometheus: each answer ~2 MB held, ~3.6 MB more while parsed; a budget of 7 MiB
    holds two at once. The third is refused (503, naming the setting) while two are held, and admitted once they
    are let go."""
    fake, body = _answering_4000_series({"check": "ecc"})

    async def scenario() -> None:
        client = PrometheusClient(fake.url, cache_ttl=0, max_answers_bytes=7 * 2**20)
        try:
            first, second = await client.query("a"), await client.query("b")
            with pytest.raises(AnswersOverBudget, match="max_answers_bytes"):
                await client.query("c")
            assert client.metrics.queries.labels("over_budget")._value.get() == 1
            assert client.budget.used >= 2 * held_estimate(4000, len(body))
            del first, second
            gc.collect()
            assert client.budget.used == 0
            assert len(await client.query("c")) == 4000
        finally:
            await client.close()

    _run_against(fake, scenario)


def test_cached_answers_make_room_for_a_new_one() -> None:
    fake, body = _answering_4000_series({})

    async def scenario() -> None:
        client = PrometheusClient(fake.url, cache_ttl=600, max_answers_bytes=7 * 2**20)
        try:
            for query in ("a", "b", "c", "d"):  # only kept by the cache: each new one drops the oldest
                await client.query(query)
            assert client.budget.refused == 0 and "|d" in " ".join(client._cache)
            assert client.budget.used <= client.budget.limit
        finally:
            await client.close()

    _run_against(fake, scenario)


class Exchange:
    """One ASGI request whose client reads only when the test says: each body message waits for `read`."""

    def __init__(self, path: str = "/api/v1/fleet") -> None:
        self.scope = {"type": "http", "path": path}
        self.messages: list[dict[str, Any]] = []
        self.read = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("more_body"):
            await self.read.wait()  # uvicorn waits here for a client that does not read

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def body(self) -> bytes:
        return b"".join(bytes(m["body"]) for m in self.messages[1:])


def app_sending(body: bytes):  # noqa: ANN201 - an ASGI app
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": memoryview(body)[:], "more_body": False})

    return app


def test_bodies_not_read_are_counted_once_each_and_new_requests_refused_past_the_limit() -> None:
    async def scenario() -> None:
        shared, own = b"s" * 300_000, b"o" * 300_000
        budget = ResponseBudget(app_sending(shared), limit_bytes=500_000)
        readers = [Exchange() for _ in range(50)]
        tasks = [asyncio.create_task(budget(r.scope, r.receive, r.send)) for r in readers]
        await asyncio.sleep(0)
        assert budget.used == len(shared)  # fifty readers of one body: counted once
        budget.app = app_sending(own)
        other = Exchange()
        task = asyncio.create_task(budget(other.scope, other.receive, other.send))
        await asyncio.sleep(0)
        assert budget.used == len(shared) + len(own)  # past the limit now
        refused, probe = Exchange(), Exchange("/healthz")
        await budget(refused.scope, refused.receive, refused.send)
        assert refused.status == 503 and json.loads(refused.body)["error"] == "busy"
        assert dict(refused.messages[0]["headers"])[b"retry-after"] == b"5"
        probe_task = asyncio.create_task(budget(probe.scope, probe.receive, probe.send))
        await asyncio.sleep(0)
        assert probe.status == 200  # the probes are never refused
        for exchange in (*readers, other, probe):
            exchange.read.set()
        await asyncio.gather(*tasks, task, probe_task)
        assert budget.used == 0 and budget.refused == 1
        assert readers[0].body == shared and other.body == own
        assert max(len(m["body"]) for m in other.messages[1:]) == PIECE_BYTES

    asyncio.run(scenario())


def test_a_views_json_is_rendered_once_for_all_its_readers() -> None:
    async def scenario() -> None:
        cache = AnswerCache(ttl=60, max_stale=60, refresh_interval=0)
        calls = []

        async def view() -> dict[str, Any]:
            calls.append(1)
            return {"nodes": [{"node": f"n{i}"} for i in range(1000)]}

        first, _ = await cache.get_rendered("inventory", view)
        second, freshness = await cache.get_rendered("inventory", view)
        assert first is second and len(calls) == 1  # the same bytes object, not a copy per reader
        assert json.loads(first)["nodes"][999] == {"node": "n999"} and freshness["stale"] is False

    asyncio.run(scenario())


def test_the_views_kept_are_bounded_in_bytes_keeping_the_newest() -> None:
    async def scenario() -> None:
        cache = AnswerCache(ttl=60, max_stale=60, refresh_interval=0, max_bytes=2 * 2**20)
        for n in range(6):  # each ~100 KB of JSON, ~600 KB kept: three fit
            await cache.get(f"utilization:{n}h", lambda: _answer_of(100_000))
        assert cache.kept_bytes <= 2 * 2**20 and len(cache._entries) == 3
        assert "utilization:5h" in cache._entries
        await cache.get("huge", lambda: _answer_of(1_000_000))  # alone over the bound: kept, the others go
        assert list(cache._entries) == ["huge"]

    asyncio.run(scenario())


async def _answer_of(size: int) -> dict[str, Any]:
    return {"rows": "x" * size}
