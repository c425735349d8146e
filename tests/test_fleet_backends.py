"""The fleet service on Prometheus and on VictoriaMetrics (Debian's packages, on loopback), over the same synthetic
fleet: the same answers on both, equal to the generator's ground truth, through the shipped recording rules
(evaluated by promtool's rule backfill and by vmalert's replay) and through the raw series. VictoriaMetrics runs
with its series limit scaled to this fleet as its default (300,000) is to a 10,000-node one, so a query that would
select more than a fleet's worth of series per GPU fails here as it would there."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpuwarden.fleet.prometheus import PrometheusClient
from tests.helpers.fleet import FleetServer, fleet_settings
from tests.helpers.synthetic_fleet import CLASS, Fleet
from tests.helpers.tsdb_backends import Prometheus, VictoriaMetrics, instant

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fleet_backends")]

NODES = 12
# VictoriaMetrics' default -search.maxUniqueTimeseries (300,000) over a 10,000-node fleet's 80,000 GPUs
SERIES_PER_GPU_ALLOWED = 300_000 / 80_000
ENDPOINTS = {
    "inventory": ("/api/v1/fleet", {}),
    "health": ("/api/v1/fleet/health", {}),
    "cordon": ("/api/v1/fleet/cordon-candidates", {}),
    "utilization": ("/api/v1/fleet/utilization", {"window": "1h", "limit": 1000}),
}


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    for tool in ("prometheus", "promtool", "victoria-metrics", "vmalert"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} missing: the README's test command installs Debian's prometheus and victoria-metrics")
    work = tmp_path_factory.mktemp("backends")
    now = int(time.time())
    # samples and recorded evaluations reach an hour past `now`: the fleet asks at the wall clock's instant when a
    # test runs, and under a loaded full run that came more than ten minutes after `now`, past the recorded range
    # this once ended at, so Prometheus' last minute had no evaluation while VictoriaMetrics (asked 31 s earlier,
    # its latency offset) still had one: 94.4 against 96.0 GPU-hours
    fleet = Fleet(nodes=NODES, now=now, hours=2, instant_minutes=30, ahead_minutes=60, seed=11)
    recorded_until = now + 55 * 60
    limit = math.ceil(SERIES_PER_GPU_ALLOWED * NODES * 8)
    prometheus = Prometheus(work)
    victoria = VictoriaMetrics(work, f"-search.maxUniqueTimeseries={limit}")
    try:
        for backend in (prometheus, victoria):
            backend.load(fleet, recorded=False)
            backend.start()
            # the shipped rules, by each backend's own tool (promtool's rule backfill, vmalert's replay)
            backend.record(now - 80 * 60, recorded_until)
        # promtool writes a block per rule, which Prometheus merges into the raw block a minute after it starts
        # (vertical compaction): the answers are compared once that is done, never while blocks are being swapped
        prometheus.wait_compacted(timeout=600)
        yield {
            "fleet": fleet,
            "prometheus": prometheus.url,
            "victoriametrics": victoria.url,
            "limit": limit,
            "recorded_until": recorded_until,
        }
    finally:
        prometheus.stop()
        victoria.stop()


def answers(url: str, **settings: Any) -> dict[str, Any]:
    # agreement, not speed, is tested here: a loaded machine must not turn a slow answer into a 504
    with FleetServer(fleet_settings(url, node_label="node", query_timeout=30, **settings)) as fleet:
        out = {}
        for name, (path, params) in ENDPOINTS.items():
            response = fleet.get(path, **params)
            assert response.status_code == 200, (url, path, response.text[:500])
            out[name] = response.json()
        page = fleet.get("/")
        assert page.status_code == 200, page.text[:500]
    return out


def reduced(answer: dict[str, Any]) -> dict[str, Any]:
    """What the answers say, without instants and ages."""
    usage = answer["utilization"]
    return {
        "nodes": answer["inventory"]["totals"]["nodes"],
        "gpus": answer["inventory"]["totals"]["gpus"],
        "stale": answer["inventory"]["stale_exporters"],
        "health": sorted(
            (g["node"], g["gpu"], c["check"], c["level"])
            for g in answer["health"]["unhealthy_gpus"]
            for c in g["checks"]
        ),
        "cordon": sorted(
            (n["node"], f["alert"], f["labels"].get("gpu"))
            for n in answer["cordon"]["candidates"]
            for f in n["findings"]
        ),
        "totals": usage["totals"],
        "idle": sorted((g["node"], g["gpu"]) for g in usage["idle_gpus"]),
        "starved": sorted((g["node"], g["gpu"]) for g in usage["starved_gpus"]),
        "namespaces": sorted(
            (n["namespace"], n.get("allocated_gpu_hours"), n.get("wasted_gpu_hours")) for n in usage["by_namespace"]
        ),
        "gpus_by_class": usage["bottlenecks"]["gpus_by_class"],
        "wasted_by_class": usage["bottlenecks"]["wasted_gpu_hours_by_class"],
    }


def ground_truth(fleet: Fleet) -> dict[str, Any]:
    kinds = fleet.kind
    return {
        "nodes": fleet.nodes,
        "gpus": fleet.nodes * 8,
        "idle": sorted((fleet.node_name(n), str(g)) for (n, g), k in kinds.items() if k == "idle"),
        "starved": sorted((fleet.node_name(n), str(g)) for (n, g), k in kinds.items() if k in ("starved", "hardware")),
        "health": sorted(
            (fleet.node_name(n), str(g), c, fleet.health(n, g, c)) for (n, g) in kinds for c in fleet_checks()
            if fleet.health(n, g, c)
        ),
        "hardware": sorted((fleet.node_name(n), str(g)) for (n, g) in fleet.hardware),
    }  # fmt: skip


def fleet_checks() -> tuple[str, ...]:
    from gpuwarden.health.checks import CHECKS

    return CHECKS


@pytest.mark.parametrize("recording_rules", ["auto", "off"])
def test_both_backends_give_the_same_answers_and_the_truth(backends: dict[str, Any], recording_rules: str) -> None:
    # the answers are for the wall clock's hour: it must lie inside what was recorded, or one backend comes up short
    assert time.time() < backends["recorded_until"] - 120, "the fixture's recorded range has passed: record further"
    on_prometheus = answers(backends["prometheus"], recording_rules=recording_rules)
    on_victoria = answers(backends["victoriametrics"], recording_rules=recording_rules)
    want = "recording rules" if recording_rules == "auto" else "raw series"
    for answer in (on_prometheus, on_victoria):
        assert answer["utilization"]["source"].startswith(want), answer["utilization"]["source"]
    prometheus, victoria = reduced(on_prometheus), reduced(on_victoria)
    # hours and costs are sums of floats, rounded to 0.01 for the answer: equal to within that rounding
    numbers = ("totals", "namespaces", "wasted_by_class")
    assert {k: v for k, v in prometheus.items() if k not in numbers} == {
        k: v for k, v in victoria.items() if k not in numbers
    }
    # The recorded path sums the same recorded rates on both. On the raw path Prometheus extrapolates increase()
    # towards the window's edges and VictoriaMetrics does not (it starts from the sample before the window): they
    # differ by at most one sample interval's share of the window (here 120 s of 1 h; 15 s at the chart's scrapes).
    rel = 0 if recording_rules == "auto" else 1.05 * backends["fleet"].range_step / 3600
    assert victoria["totals"] == pytest.approx(prometheus["totals"], rel=rel, abs=0.011)
    assert [n for n, *_ in victoria["namespaces"]] == [n for n, *_ in prometheus["namespaces"]]
    for ours, theirs in zip(prometheus["namespaces"], victoria["namespaces"], strict=True):
        assert theirs[1:] == pytest.approx(ours[1:], rel=rel, abs=0.011)
    assert victoria["wasted_by_class"] == pytest.approx(prometheus["wasted_by_class"], rel=rel, abs=0.011)
    truth = ground_truth(backends["fleet"])
    assert prometheus["nodes"] == truth["nodes"] and prometheus["gpus"] == truth["gpus"]
    assert prometheus["idle"] == truth["idle"] and prometheus["starved"] == truth["starved"]
    assert prometheus["health"] == truth["health"]
    assert prometheus["gpus_by_class"] == {k: v for k, v in backends["fleet"].truth()["gpus_by_class"].items() if v}
    fleet = backends["fleet"]
    idle_hours: dict[str, float] = {}
    for key, kind in fleet.kind.items():
        idle_hours[CLASS[kind]] = idle_hours.get(CLASS[kind], 0.0) + 1.0 - fleet.duty(key)
    assert prometheus["wasted_by_class"] == pytest.approx(idle_hours, rel=rel, abs=0.011)
    assert sorted({(node, gpu) for node, _, gpu in prometheus["cordon"]}) == truth["hardware"]
    assert truth["hardware"] and truth["idle"] and truth["starved"]  # the fleet has something of each to find
    for answer in (prometheus, victoria):  # every GPU sampled for the whole hour
        assert answer["totals"]["gpu_hours"] == pytest.approx(truth["gpus"], rel=rel, abs=0.011)


def test_a_query_over_every_health_check_is_refused_where_the_fleet_asks_one_check_at_a_time(
    backends: dict[str, Any],
) -> None:
    refused = instant(backends["victoriametrics"], 'gpuwarden_health{job="gpuwarden"} > 0')
    assert refused["status"] == "error" and f"exceeds {backends['limit']}" in refused["error"], refused["error"]
    assert answers(backends["victoriametrics"])["health"]["unhealthy_gpus"]


def test_the_backends_latency_offset_is_learnt_so_both_answer_for_the_same_instant(backends: dict[str, Any]) -> None:
    async def offset(url: str) -> float:
        client = PrometheusClient(url)
        try:
            return await client.calibrate()
        finally:
            await client.close()

    assert asyncio.run(offset(backends["prometheus"])) == 0
    learnt = asyncio.run(offset(backends["victoriametrics"]))
    assert 30 < learnt <= 32, learnt  # -search.latencyOffset, 30 s by default
    client = PrometheusClient(backends["victoriametrics"], cache_ttl=15)
    client.latency_offset = learnt
    assert time.time() - client.evaluation_time() >= learnt
