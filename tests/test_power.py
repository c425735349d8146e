"""Power from the energy counter, right at any scrape interval (issue 48 point 5, acceptance 5).

The exporter reads the energy counter every slow interval (15 s: 3 ms a call on H100). A scrape carries the last
read, 0-15 s old, so `rate(gpuwarden_energy_joules_total[1m])` over four 15 s scrapes counted 30-60 s of energy: the
dcgm compat series DCGM_FI_DEV_POWER_USAGE read 497-735 W while the GPU drew 585-635 W. The compat rule, the node
dashboard and docs/metrics.md's query now divide the counter's increase by the time between the reads it came from
(the slow tier's own timestamp, read in the same cycle).

A real-time run of 60 s scrapes is minutes long, so the scrapes are replayed: the real pipeline over the simulator
(the ecc-uncorrectable scenario: 610 W ± 25 W noise, every 0.2 s) on a manual clock, its slow cycle every 15 s with a
jitter of up to 0.3 s as the real loop has, scraped every 15 s and every 60 s just after the reads (where a scrape
sees one read or the next: the worst phase) and half an interval after them. The scrapes are backfilled into a
real Prometheus (promtool tsdb create-blocks-from openmetrics), the shipped compat rules evaluated over them by
promtool's rule backfill, and DCGM_FI_DEV_POWER_USAGE read back against the simulator's true mean power."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from alert_rules import dcgm_compat
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim.scenario import load_scenario
from tests.helpers.common import ManualClock, free_port, series_of, settings
from tests.helpers.stack import PROMETHEUS, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus and promtool")]

SCENARIO = "ecc-uncorrectable"  # 610 W ± 25 W, the 585-635 W
SLOW_S = 15.0  # the exporter's default slow interval
MINUTES = 30
TARGET = {"job": "gpuwarden", "instance": "gpu-node-1:10045", "node": "gpu-node-1"}  # what the scrape adds
KEPT = ("gpuwarden_energy_joules_total", "gpuwarden_last_collect_timestamp_seconds", "gpuwarden_gpu_info",
        "gpuwarden_driver_info")  # fmt: skip


def scrapes(sim: Any, start: float, interval: float, phase: float) -> list[tuple[float, dict]]:
    """The exporter's exposition at each scrape, its slow cycle every SLOW_S + up to 0.3 s of jitter from `start`,
    the scrapes every `interval` from `start + phase`."""
    clock = ManualClock(start)
    sim(SCENARIO, clock=clock)
    pipeline = Pipeline(settings(), wall_clock=clock)
    jitter = random.Random(48)
    end = start + MINUTES * 60
    reads = [start + k * SLOW_S + jitter.uniform(0, 0.3) for k in range(int(MINUTES * 60 / SLOW_S) + 1)]
    taken, out, k = start + phase, [], 0
    try:
        while taken < end:
            while k < len(reads) and reads[k] <= taken:
                clock.now = reads[k]
                pipeline.poll_once()  # a fast and a slow cycle, published: energy and its read time together
                k += 1
            clock.now = taken
            out.append((taken, series_of(pipeline.snapshot, lambda name: name.startswith(KEPT))))
            taken += interval
    finally:
        pipeline.stop(0.5)
    return out


def openmetrics(samples: list[tuple[float, dict]]) -> str:
    """The scrapes as OpenMetrics text for promtool's backfill: one family after another, each series in time order."""
    series: dict[tuple, list[tuple[float, float]]] = {}
    for taken, scraped in samples:
        for (name, labels), value in scraped.items():
            series.setdefault((name, labels), []).append((taken, value))
    lines = []
    for family in KEPT:
        base = family.removesuffix("_total")
        lines.append(f"# TYPE {base} {'counter' if family.endswith('_total') else 'gauge'}")
        for (name, labels), points in sorted(series.items(), key=lambda item: sorted(item[0][1])):
            if name != family:
                continue
            text = ",".join(f'{k}="{v}"' for k, v in sorted({**dict(labels), **TARGET}.items()))
            lines += [f"{name}{{{text}}} {value} {taken:.3f}" for taken, value in points]
    return "\n".join(lines) + "\n# EOF\n"


def true_mean_power(gpu: int, start: float, end: float, zero: float) -> float:
    """The simulator's mean power over [start, end] (scenario time from `zero`), integrated as the fake integrates
    its energy counter: 0.1 s steps at their midpoints."""
    scenario = load_scenario(SCENARIO)
    steps = int((end - start) / 0.1)
    return sum(scenario.value(gpu, "power_watts", start - zero + (i + 0.5) * 0.1) for i in range(steps)) / steps


@contextmanager
def prometheus_over(blocks: Path, work: Path) -> Iterator[str]:
    (work / "prometheus.yml").write_text("global: {evaluation_interval: 15s}\n")
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS or "prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={blocks}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=30d"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}/-/ready")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def backfill_rules(blocks: Path, rule: dict, start: float, end: float, work: Path) -> None:
    """`rule` evaluated over [start, end] every 15 s by promtool's rule backfill against a Prometheus over `blocks`,
    its blocks then moved in beside them (the next Prometheus started over `blocks` reads both)."""
    name = rule["record"].replace(":", "_")
    path, out = work / f"{name}.yaml", work / f"{name}-blocks"
    path.write_text(yaml.safe_dump({"groups": [{"name": "compat", "interval": "15s", "rules": [rule]}]}))
    with prometheus_over(blocks, work) as url:
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "rules", f"--start={int(start)}", f"--end={int(end)}",
             f"--url={url}", f"--output-dir={out}", "--eval-interval=15s", "--quiet", str(path)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    for block in out.iterdir():
        block.rename(blocks / block.name)


def query_range(url: str, expr: str, start: float, end: float) -> dict[str, list[tuple[float, float]]]:
    answer = httpx.get(
        f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 15}, timeout=60
    ).json()
    assert answer["status"] == "success", answer
    return {r["metric"]["gpu"]: [(float(t), float(v)) for t, v in r["values"]] for r in answer["data"]["result"]}


@pytest.mark.parametrize(("interval", "phase"), [(15.0, 0.1), (15.0, 7.5), (60.0, 0.1), (60.0, 30.0)])
def test_compat_power_is_within_2_percent_of_the_true_power(sim, tmp_path, interval, phase) -> None:  # noqa: ANN001
    start = float(int(time.time()) - 3 * 3600)  # backfilled history, recent enough to be within retention
    samples = scrapes(sim, start, interval, phase)
    (tmp_path / "scrapes.om").write_text(openmetrics(samples))
    blocks = tmp_path / "tsdb"
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "scrapes.om"), str(blocks)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    end = start + MINUTES * 60
    rules = {r["record"]: r for r in dcgm_compat.rules()}
    # the compat power reads the labels record, and promtool's rule backfill sees no record it is writing: the labels
    # first, then the power over them (in the order Prometheus' rule group evaluates them)
    for record in (dcgm_compat.LABELS_RECORD, "DCGM_FI_DEV_POWER_USAGE"):
        backfill_rules(blocks, rules[record], start, end, tmp_path)
    with prometheus_over(blocks, tmp_path) as url:
        first = start + 5 * 60  # past the 4m window's first fill
        compat = query_range(url, "DCGM_FI_DEV_POWER_USAGE", first, end)
        naive = query_range(url, 'rate(gpuwarden_energy_joules_total{job="gpuwarden"}[1m])', first, end)
        dashboard = query_range(url, _dashboard_power(), first, end)
    gpus = load_scenario(SCENARIO).node.count
    assert len(compat) == gpus and all(len(points) >= (end - first) / 15 - 2 for points in compat.values()), compat
    window = 60.0 if interval <= 30 else 240.0  # the compat rule's mean: over 1m, or 4m at 60 s scrapes
    worst = 0.0
    for gpu, points in compat.items():
        for at, watts in points:
            truth = true_mean_power(int(gpu), at - window, at, start)
            worst = max(worst, abs(watts / truth - 1))
    assert worst <= 0.02, f"compat power off by {worst:.1%} at {interval:g} s scrapes"
    assert all(abs(w / 610 - 1) <= 0.02 for points in compat.values() for _, w in points)  # the 585-635 W
    assert all(abs(w / 610 - 1) <= 0.02 for points in dashboard.values() for _, w in points)
    if interval == 15.0 and phase < 1:  # the trap the rule left: at this phase a plain 1m rate misreads
        assert any(abs(w / 610 - 1) > 0.05 for points in naive.values() for _, w in points)


def _dashboard_power() -> str:
    """The node dashboard's average power, its template variables matching everything and $__rate_interval at 4
    scrapes of the slowest interval here."""
    from grafana_dashboards.build import AVERAGE_POWER

    return (
        AVERAGE_POWER.replace('=~"$job"', '=~"gpuwarden"')
        .replace('=~"$node"', '=~".*"')
        .replace('=~"$instance"', '=~".*"')
        .replace('=~"$gpu"', '=~".*"')
        .replace("$__rate_interval", "4m")
    )


def test_the_dashboard_and_the_compat_rule_divide_by_the_same_read_time() -> None:
    from grafana_dashboards.build import AVERAGE_POWER, GPU_SELECTOR, NODE_SELECTOR, RATE_INTERVAL

    energy = f"gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}"
    read = f'gpuwarden_last_collect_timestamp_seconds{{{NODE_SELECTOR},tier="slow"}}'
    assert dcgm_compat.average_power(energy, read, RATE_INTERVAL) == AVERAGE_POWER
