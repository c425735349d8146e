"""The fleet service at fleet scale, in what can be checked here without a 10,000-node backend: the page's size and
order with a 10,000-node fleet's answers, the bound on queries in flight whatever the page asks, the upstream's
reason kept whole (VictoriaMetrics says why at the end), and the cache's memory bound."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from gpuwarden.fleet.app import TEMPLATES, create_app
from gpuwarden.fleet.prometheus import PrometheusClient, Series
from gpuwarden.fleet.settings import parse
from gpuwarden.fleet.views.health import PAGE_ROWS, health_by_node
from tests.helpers.common import ServedApp, sweep

NODES = 10_000


def ten_thousand_nodes() -> dict[str, Any]:
    """The answers the page renders for the fleet that broke it (2026-11-26): 390 cordon candidates, 5,684
    unhealthy GPUs, 10,000 nodes of 8 GPUs."""
    finding = {"alert": "GpuwardenXidCritical", "summary": "a critical XID", "action": "reset_gpu",
               "labels": {"gpu": "3", "xid": "79"}, "alert_firing": True, "runbook_url": "#xid"}  # fmt: skip
    candidates = [{"node": f"gpu-node-{i:05d}", "findings": [finding], "commands": [f"kubectl cordon gpu-node-{i:05d}"],
                   "gpus": ["3"]} for i in range(390)]  # fmt: skip
    unhealthy = [
        {"node": f"gpu-node-{(i * 7) % NODES:05d}", "gpu": str(i % 8), "uuid": f"GPU-{i:08x}",
         "severity": "critical" if i % 9 == 0 else "warning",
         "checks": [{"check": ("xid", "temperature", "ecc", "nvlink")[i % 4], "level": 2 if i % 9 == 0 else 1,
                     "severity": "critical" if i % 9 == 0 else "warning", "since": 1.0, "for_seconds": 60.0}]}
        for i in range(5_684)
    ]  # fmt: skip
    nodes = [{"node": f"gpu-node-{i:05d}", "gpus": 8} for i in range(NODES)]
    return {
        "inventory": {
            "nodes": nodes,
            "totals": {"nodes": NODES, "gpus": 8 * NODES, "driver_versions": {"580.159.04": NODES},
                       "exporter_versions": {"0.1.0": NODES},
                       "models": {"H100": {"gpus": 8 * NODES, "nodes": NODES, "memory_bytes": 8.5e10}}},
            "stale_exporters": [{"node": f"gpu-node-{i:05d}", "reason": "exporter down"} for i in range(120)],
        },
        "health": {"unhealthy_gpus": unhealthy, "counts": {"critical": 632, "warning": 5052},
                   "unknown_nodes": [f"gpu-node-{i:05d}" for i in range(120)]},
        "cordon": {"candidates": candidates},
        "usage": {"by_node": [{"node": f"gpu-node-{i:05d}", "gpus": 8, "utilization": 0.1, "gpu_hours": 8,
                               "wasted_gpu_hours": 7.2, "wasted_cost": 18.0} for i in range(20)],
                  "totals": {"wasted_gpu_hours": 41_000.0, "wasted_cost": 102_500.0, "idle_gpus": 9_000,
                             "starved_gpus": 3_000}, "currency": "USD", "idle_ratio": 0.05},
        # 300 multi-node jobs of 32 GPUs, 120 of them with a straggler: the page lists PAGE_ROWS["stale"] of those
        "jobs": {"jobs": [{"job_id": f"10.0.{i // 250}.{i % 250}:29500/run-{i}",
                           "straggler": {"node": f"gpu-node-{4 * i:05d}", "gpu": "3", "rank": "3", "wait_share": 0.02,
                                         "cause": "cpu", "waiting_gpus": 31,
                                         "waiting_nodes": [f"gpu-node-{4 * i + k:05d}" for k in range(4)]}
                           if i < 120 else None} for i in range(300)]},
    }  # fmt: skip


def test_the_page_at_ten_thousand_nodes_is_small_and_reads_top_down() -> None:
    world = ten_thousand_nodes()
    page = TEMPLATES.get_template("overview.html").render(
        **world,
        health_nodes=health_by_node(world["health"]["unhealthy_gpus"]),
        rows=PAGE_ROWS,
        settings=parse(["--prometheus-url", "http://prometheus:9090"]),
        version="test",
        generated="now",
    )
    assert len(page.encode()) < 200_000, len(page.encode())
    sections = re.findall(r'<section id="(\w+)"', page)
    assert sections == ["cordon", "health", "jobs", "utilization", "inventory", "stale"]
    assert f"{PAGE_ROWS['stale']} of 120 shown" in page and "/api/v1/fleet/jobs" in page
    assert page.index('class="stats"') < page.index('<section id="cordon"')  # the cards first
    assert "20 of 390 nodes shown" in page and "/api/v1/fleet/cordon-candidates" in page
    assert page.count("<tr><td>gpu-node-") <= PAGE_ROWS["cordon"] + 10 + PAGE_ROWS["stale"]
    assert page.count("<tr><td>10.0.") == PAGE_ROWS["stale"]  # the stragglers' rows, bounded
    assert "50 of " in page and "(5684 GPUs)" in page  # health: nodes, grouped by check, with the count


def test_the_page_never_says_every_gpu_is_healthy_beside_findings_or_silent_exporters() -> None:
    """In a fault's first minutes the cordon rules have findings while the health verdicts still wait out their
    windows: the page said "Every GPU is healthy" beside the cordon candidates (issue 36)."""

    def page(candidates: list[dict], unknown: list[str]) -> str:
        world = ten_thousand_nodes()
        world["health"] = {"unhealthy_gpus": [], "counts": {}, "unknown_nodes": unknown}
        world["cordon"] = {"candidates": candidates}
        return TEMPLATES.get_template("overview.html").render(
            **world, health_nodes=[], rows=PAGE_ROWS, settings=parse(["--prometheus-url", "http://p:9090"]),
            version="test", generated="now",
        )  # fmt: skip

    findings = ten_thousand_nodes()["cordon"]["candidates"][:2]
    assert "Every GPU is healthy" not in page(findings, []) and "2 node(s) have hardware findings" in page(findings, [])
    assert "Every GPU is healthy" not in page([], ["gpu-node-00001"])
    assert "Every GPU is healthy" in page([], [])


def test_health_is_grouped_by_node_and_check_critical_first() -> None:
    gpus = [
        {"node": "b", "gpu": "1", "severity": "warning", "checks": [{"check": "temperature", "level": 1}]},
        {"node": "b", "gpu": "3", "severity": "warning", "checks": [{"check": "temperature", "level": 1}]},
        {"node": "c", "gpu": "0", "severity": "critical", "checks": [{"check": "xid", "level": 2},
                                                                     {"check": "ecc", "level": 1}]},
    ]  # fmt: skip
    grouped = health_by_node(gpus)
    assert [n["node"] for n in grouped] == ["c", "b"]
    assert grouped[1]["checks"] == {"temperature": {"level": 1, "gpus": ["1", "3"]}}
    assert list(grouped[0]["checks"]) == ["xid", "ecc"]


class _Counting(BaseHTTPRequestHandler):
    """A Prometheus that answers every query after 50 ms and counts how many it serves at once."""

    lock = threading.Lock()
    now = 0
    most = 0
    served = 0
    status = 200
    body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.lock:
            type(self).now += 1
            type(self).served += 1
            type(self).most = max(type(self).most, type(self).now)
        time.sleep(0.05)
        with self.lock:
            type(self).now -= 1
        self.send_response(self.status)
        self.send_header("content-type", "text/plain" if self.status >= 500 else "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def counting_upstream(**attrs: Any) -> tuple[ThreadingHTTPServer, type[_Counting]]:
    handler = type("Counting", (_Counting,), {"now": 0, "most": 0, "served": 0, **attrs})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


@pytest.mark.parametrize("limit", sweep([1, 4], lambda limit: limit == 1))
def test_queries_in_flight_are_bounded_for_the_page_and_all_requests_together(limit: int) -> None:
    server, handler = counting_upstream()
    settings = parse(["--prometheus-url", f"http://127.0.0.1:{server.server_port}", "--cache-ttl", "0",
                      "--max-concurrent-queries", str(limit)])  # fmt: skip
    served = ServedApp(create_app(settings))
    served.start()
    try:
        with httpx.Client(timeout=60) as client:
            threads = [threading.Thread(target=client.get, args=(served.url + "/",)) for _ in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert client.get(served.url + "/").status_code == 200
    finally:
        served.stop()
        server.shutdown()
    assert handler.most == limit, handler.most  # three pages of ~35 queries each, never more than the limit at once


def test_a_victoriametrics_refusal_keeps_its_reason() -> None:
    """VictoriaMetrics's plain-text errors echo the request first; the reason is at the end."""
    reason = (
        "cannot execute query: couldn't start executing the request in 10.000 seconds, since "
        "-search.maxConcurrentRequests=4 concurrent requests are executed"
    )
    echoed = "sum by (node) (rate(gpuwarden_busy_seconds_total[1h])) " * 20
    body = f"error when executing query={echoed}{reason}".encode()
    server, _ = counting_upstream(status=503, body=body)
    settings = parse(["--prometheus-url", f"http://127.0.0.1:{server.server_port}"])
    served = ServedApp(create_app(settings))
    served.start()
    try:
        answer = httpx.get(served.url + "/api/v1/fleet/health", timeout=30)
    finally:
        served.stop()
        server.shutdown()
    assert answer.status_code == 503
    assert "-search.maxConcurrentRequests=4 concurrent requests are executed" in json.loads(answer.text)["detail"]


def test_the_cache_is_bounded_in_bytes_keeping_the_newest() -> None:
    client = PrometheusClient("http://127.0.0.1:1", cache_ttl=600, cache_max_bytes=1024 * 1024)
    answer = [
        Series({"instance": f"10.0.{i // 250}.{i % 250}:10045", "uuid": f"GPU-{i:032x}"}, 1.0) for i in range(500)
    ]
    for n in range(40):  # ~40 distinct answers of ~170 KB each: seven times the bound
        client._remember(f"query {n}", answer)
        assert client.cache_bytes <= 1024 * 1024
    assert "query 39" in client._cache and "query 0" not in client._cache
    asyncio.run(client.close())


def test_an_answer_is_reused_for_the_caches_ttl_and_asked_again_after_it() -> None:
    """The cache's ages are read on an injected clock: the TTL is tested without waiting for it."""
    server, handler = counting_upstream()
    now = [1000.0]
    client = PrometheusClient(f"http://127.0.0.1:{server.server_port}", cache_ttl=15, clock=lambda: now[0])

    async def ask_three_times() -> list[int]:
        served = []
        try:
            for step in (0.0, 14.9, 0.2):  # at the start, within the TTL, past it
                now[0] += step
                await client.query("up", at=1.0)
                served.append(handler.served)
        finally:
            await client.close()
        return served

    try:
        assert asyncio.run(ask_three_times()) == [1, 1, 2]
    finally:
        server.shutdown()
