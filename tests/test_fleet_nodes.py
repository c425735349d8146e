"""The README's fleet command, as written, against a real Prometheus over simulated exporters (issue 48 point 8): one
node is one node in every view, named as Kubernetes knows it, so its kubectl commands work.

Before, `--node-label` defaulted to `instance`: with the `node` label the chart's ServiceMonitor (and
deploy/prometheus/prometheus.yml) add, the inventory listed `127.0.0.1:PORT` and the cordon finding, which names
nodes by `node` like the pages, `node-PORT`: one node in two, and `kubectl cordon 127.0.0.1`. A scrape config without
the label falls back to the instance, consistently."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers.common import free_port, wait_for
from tests.helpers.stack import PROMETHEUS, Stack, running_cli, stack, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus")]
ROOT = Path(__file__).resolve().parent.parent
NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # RFC 1123, as kubectl


def readme_fleet_command(prometheus: str) -> list[str]:
    """The README's fleet command, its Prometheus URL pointed at the test's."""
    (command,) = re.findall(r"`(gpuwarden fleet --prometheus-url [^`]+)`", (ROOT / "README.md").read_text())
    words = shlex.split(command)
    assert words[:2] == ["gpuwarden", "fleet"], command
    return [prometheus if word.startswith("http://prometheus:") else word for word in words[1:]]


def views(url: str) -> dict[str, Any]:
    with httpx.Client(timeout=30) as client:
        return {
            name: client.get(url + path).raise_for_status().json()
            for name, path in (
                ("inventory", "/api/v1/fleet"),
                ("health", "/api/v1/fleet/health"),
                ("cordon", "/api/v1/fleet/cordon-candidates"),
                ("utilization", "/api/v1/fleet/utilization"),
            )
        }


def nodes_named(answer: dict[str, Any]) -> dict[str, set[str]]:
    return {
        "inventory": {n["node"] for n in answer["inventory"]["nodes"]},
        "health": {g["node"] for g in answer["health"]["unhealthy_gpus"]},
        "cordon": {c["node"] for c in answer["cordon"]["candidates"]},
        "utilization": {n["node"] for n in answer["utilization"]["by_node"]},
    }


def unlabelled_prometheus(parts: Stack) -> tuple[str, subprocess.Popen]:
    """A second real Prometheus over the same exporters with a plain static scrape config: no `node` label."""
    tmp = parts.tmp / "plain"
    tmp.mkdir()
    config = yaml.safe_load((parts.tmp / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["labels"].pop("node", None)
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS or "prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/-/ready")
    return url, proc


def settled(url: str) -> dict[str, Any]:
    """The views once they show what the stack holds: the lost GPU judged and a cordon candidate, both nodes'
    utilization (the fleet evaluates up to its cache TTL in the past, so it is asked, not Prometheus)."""
    seen: list[dict[str, Any]] = []

    def ready() -> bool:
        answer = views(url)
        seen[:] = [answer]
        return (
            bool(answer["cordon"]["candidates"] and answer["health"]["unhealthy_gpus"])
            and len(answer["utilization"]["by_node"]) == 2
        )

    wait_for(ready, timeout=120, step=1)
    return seen[0]


def test_the_readmes_fleet_command_names_each_node_once_as_kubernetes_knows_it(tmp_path: Path) -> None:
    with stack(tmp_path) as parts:
        lost, healthy = parts.exporter("gpu-lost"), parts.exporter("healthy")
        parts.start_prometheus(node_labels=True)  # node-PORT, as the chart's relabeling names each pod's node
        plain, plain_proc = unlabelled_prometheus(parts)
        try:
            with running_cli(*readme_fleet_command(parts.prometheus)) as (url, _):
                labelled = settled(url)
            with running_cli(*readme_fleet_command(plain)) as (url, proc):
                unlabelled = settled(url)
                proc.terminate()
                log = proc.communicate(timeout=10)[1]
        finally:
            plain_proc.terminate()
            plain_proc.wait(10)

    names = {f"node-{lost}", f"node-{healthy}"}
    seen = nodes_named(labelled)
    assert seen["inventory"] == seen["utilization"] == names, seen  # one entry per node, by its name
    assert seen["health"] == seen["cordon"] == {f"node-{lost}"}, seen  # the same name in every view
    (candidate,) = labelled["cordon"]["candidates"]
    assert candidate["commands"][0] == f"kubectl cordon node-{lost}"
    assert NODE_NAME.fullmatch(shlex.split(candidate["commands"][0])[2])
    assert all(n["gpus"] > 0 for n in labelled["inventory"]["nodes"])

    # no `node` label anywhere: the instance names each node, still one entry per node in every view
    instances = {f"127.0.0.1:{lost}", f"127.0.0.1:{healthy}"}
    seen = nodes_named(unlabelled)
    assert seen["inventory"] == seen["utilization"] == instances, seen
    assert seen["health"] == seen["cordon"] == {f"127.0.0.1:{lost}"}, seen
    assert "no gpuwarden target carries a 'node' label" in log
