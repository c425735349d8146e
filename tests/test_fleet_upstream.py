"""The fleet service against a Prometheus that misbehaves: answers of the wrong shape, a body trickled a byte at a
time, a 50 MB answer, and label values crafted to change a query. A fake Prometheus (a real HTTP server on
loopback, standing in for a broken or hostile upstream that a real Prometheus cannot be made to be) answers; the
fleet service is the real CLI process."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from gpuwarden.fleet.settings import parse_duration
from gpuwarden.fleet.views.cordon import node_name
from tests.helpers.common import rss_mib
from tests.helpers.daemon import running_cli
from tests.helpers.fake_prometheus import Answer, FakePrometheus, reply, vector

pytestmark = pytest.mark.slow
QUERY_TIMEOUT = 2.0
ENDPOINTS = [
    "/api/v1/fleet",
    "/api/v1/fleet/health",
    "/api/v1/fleet/cordon-candidates",
    "/api/v1/fleet/utilization",
    "/readyz",
]


def fleet(prometheus: FakePrometheus) -> AbstractContextManager[tuple[str, subprocess.Popen]]:
    return running_cli(
        "fleet", "--prometheus-url", prometheus.url, "--query-timeout", str(QUERY_TIMEOUT), "--cache-ttl", "0"
    )


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    yield fake
    fake.close()


MALFORMED = {
    "no data": {"status": "success"},
    "data null": {"status": "success", "data": None},
    "non-numeric value": vector([{"metric": {"instance": "a"}, "value": [1.0, "lots"]}]),
    "short pair": vector([{"metric": {"instance": "a"}, "value": [1.0]}]),
    "no metric": vector([{"value": [1.0, "1"]}]),
    "result not a list": {"status": "success", "data": {"resultType": "vector", "result": {"a": 1}}},
    "not JSON": b"<html>proxy error</html>",
    "JSON list": [1, 2, 3],
}


def test_malformed_answers_are_502_json_on_every_endpoint(prometheus):
    with fleet(prometheus) as (url, proc):
        for name, body in MALFORMED.items():
            prometheus.answer = lambda query, handler, body=body: reply(handler, body)
            for path in ENDPOINTS:
                answer = httpx.get(url + path, timeout=10)
                assert answer.status_code == 502, (name, path, answer.status_code, answer.text[:200])
                assert answer.json()["error"] == "prometheus", (name, path)
        plan = httpx.get(url + "/api/v1/plan", params={"parameters": 7e9}, timeout=10)
        proc.terminate()
        logs = proc.communicate(timeout=10)[1]
    assert plan.status_code == 200 and plan.json()["fleet"] is None and "malformed" in plan.json()["fleet_error"]
    assert "Traceback" not in logs


def test_the_api_documents_the_5xx_that_prometheus_causes_and_their_bodies_match(prometheus):
    """/openapi.json (and so /docs) lists 502, 503 and 504 on every route that asks Prometheus, with the body they
    carry; it listed none (issue 36). A real 502 matches the documented schema."""
    with fleet(prometheus) as (url, _):
        document = httpx.get(url + "/openapi.json", timeout=10).json()
        prometheus.answer = lambda query, handler: reply(handler, MALFORMED["not JSON"])
        failed = httpx.get(url + ENDPOINTS[0], timeout=10)
    schema = document["components"]["schemas"]["Problem"]
    for path in [*(p for p in ENDPOINTS if p.startswith("/api/")), "/api/v1/plan"]:
        responses = document["paths"][path]["get"]["responses"]
        for status in ("502", "503", "504"):
            body = responses[status]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/Problem"}, (path, status, body)
    assert failed.status_code == 502 and set(failed.json()) == set(schema["properties"]) == {"error", "detail"}


def test_a_trickling_answer_is_cut_off_at_the_query_timeout(prometheus):
    def trickle(query: str, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "1000000")
        handler.end_headers()
        for _ in range(60):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.5)

    prometheus.answer = trickle
    with fleet(prometheus) as (url, _):
        # the trickle lasts a minute and this client waits 30 s: a 504 is the fleet's own deadline cutting it off
        answer = httpx.get(url + "/api/v1/fleet/health", timeout=30)
        healthz = httpx.get(url + "/healthz", timeout=2)
    assert answer.status_code == 504 and answer.json()["error"] == "prometheus", answer.text[:200]
    assert "did not answer within" in answer.json()["detail"], answer.text[:200]
    assert healthz.status_code == 200


def test_a_50_mb_answer_is_refused_without_the_memory(prometheus):
    item = {"metric": {"instance": "node-0000", "uuid": "GPU-" + "0" * 36, "check": "ecc"}, "value": [1.0, "2"]}
    huge = json.dumps(vector([item] * 500_000)).encode()  # ~50 MB
    assert len(huge) > 45_000_000
    prometheus.answer = lambda query, handler: reply(handler, huge)
    with fleet(prometheus) as (url, proc):
        httpx.get(url + "/healthz")
        before = rss_mib(proc.pid)
        answer = httpx.get(url + "/api/v1/fleet/health", timeout=30)
        growth = rss_mib(proc.pid) - before
    assert answer.status_code == 502 and "max_answer_bytes" in answer.json()["detail"], answer.text[:300]
    assert growth < 64, growth


def test_label_values_from_prometheus_cannot_change_a_query_or_a_command(prometheus):
    evil = 'x",job!="; rm -rf /'
    row = {"metric": {"instance": evil, "uuid": "GPU-1", "gpu": "0"}, "value": [1, "17"]}

    def answer(query: str, handler: BaseHTTPRequestHandler) -> None:
        # the narrowing query, then the narrowed NvlinkDown expression: one node with a link down
        wanted = query.startswith("gpuwarden_nvlink_active_links{") or "instance=~" in query
        reply(handler, vector([row] if wanted else []))

    prometheus.answer = answer
    with fleet(prometheus) as (url, _):
        body = httpx.get(url + "/api/v1/fleet/cordon-candidates", timeout=10).json()
    narrowed = [q for q in prometheus.queries if "instance=~" in q]
    assert narrowed, prometheus.queries
    for query in narrowed:
        start = query.index("instance=~") + len("instance=~")
        regex, end = json.JSONDecoder().raw_decode(query[start:])
        assert re.fullmatch(regex, evil)  # the whole value stayed inside one string literal
        assert query[start + end] in ",}"  # and the selector goes on right after it
    commands = body["candidates"][0]["commands"]
    assert [shlex.split(command)[:3] for command in commands] == [
        ["kubectl", "cordon", node_name(evil)],
        ["kubectl", "drain", node_name(evil)],
    ]


@pytest.mark.parametrize("window", ["1h ", "\u20031h", "1h\u00a0", "\u0661h", "1H", "1h30m", ""])
def test_windows_are_ascii_and_exact(window):
    with pytest.raises(ValueError):
        parse_duration(window)


FLEET_MEMORY_LIMIT_MIB = 384  # the Helm chart's limit for the fleet service


def _gzip_bomb(expanded_mib: int) -> bytes:
    import zlib

    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * 2**20
    return b"".join(compressor.compress(zeros) for _ in range(expanded_mib)) + compressor.flush()


def _deflate_bomb(expanded_mib: int) -> bytes:
    import zlib

    compressor = zlib.compressobj(9)
    zeros = b" " * 2**20
    return b"".join(compressor.compress(zeros) for _ in range(expanded_mib)) + compressor.flush()


def _encoded(body: bytes, encoding: str) -> Answer:
    def answer(query: str, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Encoding", encoding)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def _many_series(count: int) -> bytes:
    items = [{"metric": {"instance": f"n{i:05d}", "check": "ecc"}, "value": [1.0, "2"]} for i in range(count)]
    return json.dumps(vector(items)).encode()


HOSTILE_BACKENDS: dict[str, Callable[[], Answer]] = {
    "a gzip bomb (512 MiB expanded)": lambda: _encoded(_gzip_bomb(512), "gzip"),
    "a deflate bomb (512 MiB expanded)": lambda: _encoded(_deflate_bomb(512), "deflate"),
    "an encoding not asked for": lambda: _encoded(b"\x00" * 100, "br"),
    "95,000 series in 8.3 MB": lambda: (lambda body: lambda q, h: reply(h, body))(_many_series(95_000)),
    "900 KB label values": lambda: (lambda body: lambda q, h: reply(h, body))(
        json.dumps(
            vector([{"metric": {"instance": "x" * 900_000, "check": f"c{i}"}, "value": [1.0, "1"]} for i in range(8)])
        ).encode()
    ),  # fmt: skip
    "deeply nested JSON": lambda: lambda q, h: reply(h, b"[" * 100_000 + b"]" * 100_000),
    "non-finite values": lambda: (
        lambda q, h: reply(
            h,
            vector([{"metric": {"instance": "a", "check": "ecc"}, "value": [1.0, v]} for v in ("NaN", "+Inf", "-Inf")]),
        )
    ),
}


@pytest.mark.parametrize("shape", sorted(HOSTILE_BACKENDS))
def test_a_hostile_backend_never_kills_the_fleet_at_the_charts_memory_limit(prometheus, shape: str) -> None:  # noqa: ANN001
    """Each answer, on every endpoint, in a memory cgroup at the chart's limit: a clear JSON answer (502 naming the
    limit or the fault; 200 where non-finite values are dropped), never an OOM kill, never a traceback."""
    from tests.helpers.cgroup import memory_cgroup

    prometheus.answer = HOSTILE_BACKENDS[shape]()
    with memory_cgroup(FLEET_MEMORY_LIMIT_MIB) as cgroup:
        with fleet(prometheus) as (url, proc):
            for path in ENDPOINTS[:4]:
                answer = httpx.get(url + path, timeout=30)
                assert answer.status_code in (200, 502), (path, answer.status_code, answer.text[:300])
                assert answer.headers["content-type"].startswith("application/json")
                if shape != "non-finite values":
                    assert answer.status_code == 502 and answer.json()["error"] == "prometheus", answer.text[:300]
            assert httpx.get(url + "/healthz", timeout=5).status_code == 200
            assert proc.poll() is None and cgroup.oom_kills() == 0, f"peak {cgroup.peak_mib():.0f} MiB"
        log = proc.stderr.read()
    assert "Traceback" not in log, log[-2000:]


def test_rule_health_reads_the_rules_answer_as_boundedly_as_a_query(prometheus) -> None:  # noqa: ANN001
    """/api/v1/rules is read through the same bounded decoder as every query: a gzip bomb there is refused as it
    inflates (rule health then unknown), not inflated whole by the HTTP library."""
    import asyncio
    import tracemalloc

    from gpuwarden.fleet.prometheus import PrometheusClient

    bomb = _encoded(_gzip_bomb(512), "gzip")
    prometheus.rules = lambda handler: bomb("", handler)

    async def ask() -> object:
        client = PrometheusClient(prometheus.url, timeout=10)
        try:
            return await client.rule_health()
        finally:
            await client.close()

    tracemalloc.start()
    try:
        health = asyncio.run(ask())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert health is None
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB held while reading the answer"


def test_the_recording_interval_comes_from_the_rules_answer_and_odd_groups_are_ignored(prometheus) -> None:  # noqa: ANN001
    """The interval a recorded sum is multiplied by is the one the backend lists for the record's group; a group
    with no usable interval (missing, a string, zero, a boolean, absurd) gives none, and the flag is used."""
    import asyncio

    from gpuwarden.fleet import recording
    from gpuwarden.fleet.prometheus import PrometheusClient

    def group(interval: object, name: str) -> dict[str, object]:
        return {"name": "g", "interval": interval, "rules": [{"type": "recording", "name": name, "health": "ok"}]}

    groups = [group(120, recording.SAMPLED), group("60s", "a"), group(0, "b"), group(True, "c"), group(1e9, "d"),
              {"name": "no-interval", "rules": [{"type": "recording", "name": "e"}]}, "not a group"]  # fmt: skip
    prometheus.rules = lambda handler: reply(handler, {"status": "success", "data": {"groups": groups}})

    async def ask() -> list[float | None]:
        client = PrometheusClient(prometheus.url, timeout=10)
        try:
            return [await client.record_interval(name) for name in (recording.SAMPLED, "a", "b", "c", "d", "e")]
        finally:
            await client.close()

    assert asyncio.run(ask()) == [120.0, None, None, None, None, None]
