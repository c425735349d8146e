"""The fleet reads recorded series only where their rules are healthy: a backend can fail some recording rules and
not others (VictoriaMetrics' series limit fails the health or cordon rules of a large fleet), and a failing health
rule's absent series would read as "every GPU healthy". Two exporters (one with an uncorrectable ECC fault) scraped
by a real Prometheus and a real VictoriaMetrics; on each, the shipped recording rules with the health records made
to fail at evaluation (a many-to-one match on duplicate series, a runtime error): Prometheus evaluates them itself,
VictoriaMetrics through a live vmalert it proxies `/api/v1/rules` to. On both, the health view falls back to the raw
series and says why, its answer equals the raw path's, and the inventory keeps reading its healthy records."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from alert_rules import generate
from gpuwarden.fleet import recording
from tests.helpers.common import free_port, wait_for
from tests.helpers.fleet import FleetServer, fleet_settings
from tests.helpers.stack import PROMETHEUS, stack, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # real Prometheus and vmalert on their own clocks: the serial phase


def broken_health_rules(tmp: Path) -> Path:
    """The shipped recording rules, every second, with each health record's expression failing at evaluation."""
    document = yaml.safe_load(generate.recording_rules_yaml(interval_s=1, rate_window="10s"))
    for group in document["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == recording.HEALTH:
                rule["expr"] = f"({rule['expr']}) + on () group_left () gpuwarden_gpu_up"  # duplicates on the right
    path = tmp / "recording-broken-health.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def answers(url: str, **settings: Any) -> tuple[dict, dict]:
    with FleetServer(fleet_settings(url, recording_interval=1, **settings)) as fleet:
        return fleet.get("/api/v1/fleet/health").json(), fleet.get("/api/v1/fleet").json()


def unhealthy(health: dict) -> set[tuple[str, str, str]]:
    return {(g["node"], g["gpu"], c["check"]) for g in health["unhealthy_gpus"] for c in g["checks"]}


def check_fallback(url: str) -> None:
    health, inventory = answers(url)
    raw_health, _ = answers(url, recording_rules="off")
    assert "source" in health, health
    assert health["source"].startswith("raw series") and "failing" in health["source"], health["source"]
    assert recording.HEALTH in health["source"]
    assert unhealthy(health) == unhealthy(raw_health) and unhealthy(health), (health, raw_health)
    assert inventory.get("source", "").startswith("recording rules"), inventory


@pytest.fixture(scope="module")
def exporters(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    if PROMETHEUS is None:
        pytest.fail("prometheus missing: the README's test command installs Debian's prometheus package")
    tmp = tmp_path_factory.mktemp("rule-health")
    with stack(tmp) as parts:
        parts.exporter("ecc-uncorrectable")
        parts.exporter("healthy")
        rules = broken_health_rules(tmp)
        parts.start_prometheus(rules.read_text())
        yield parts, rules


def settled(url: str, *exprs: str) -> bool:
    """Each expression has an answer already 3 s ago: the fleet evaluates at a whole second at least the backend's
    latency offset back, so a record that appeared a moment ago is still absent at its instant (a CI run caught the
    fleet there, reading "no recording rules loaded" where the test meant "a rule failing")."""
    import httpx

    at = time.time() - 3
    for expr in exprs:
        body = httpx.get(f"{url}/api/v1/query", params={"query": expr, "time": at}, timeout=5).json()
        if not body.get("data", {}).get("result"):
            return False
    return True


def _failing_rules(url: str) -> bool:
    import httpx

    try:
        groups = httpx.get(f"{url}/api/v1/rules", timeout=5).json()["data"]["groups"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    rules = [r for g in groups for r in g["rules"]]
    return any(r.get("health") == "err" for r in rules) and any(
        r.get("name") == recording.NODE_MODELS and r.get("health") == "ok" for r in rules
    )


def test_prometheus_failing_health_rules_send_only_the_health_view_to_raw_series(exporters) -> None:  # noqa: ANN001
    parts, _ = exporters
    wait_for(lambda: _failing_rules(parts.prometheus)
             and settled(parts.prometheus, 'gpuwarden_health{check="ecc"} == 2', recording.NODE_MODELS),
             timeout=90, step=1)  # fmt: skip
    check_fallback(parts.prometheus)


@pytest.mark.skipif(not shutil.which("vmalert"), reason="vmalert not installed (the test command installs it)")
def test_victoriametrics_with_vmalert_failing_health_rules_falls_back_the_same(exporters, tmp_path: Path) -> None:  # noqa: ANN001
    parts, rules = exporters
    scrape = yaml.safe_load((parts.tmp / "prometheus.yml").read_text())
    scrape.pop("rule_files", None)
    scrape["global"].pop("evaluation_interval", None)  # VictoriaMetrics' scraper refuses what it does not use
    (tmp_path / "scrape.yml").write_text(yaml.safe_dump(scrape))
    vm_port, vmalert_port = free_port(), free_port()
    vm_url, vmalert_url = f"http://127.0.0.1:{vm_port}", f"http://127.0.0.1:{vmalert_port}"
    logs = (tmp_path / "vm.log").open("w")
    processes = [
        subprocess.Popen(
            [
                "victoria-metrics",
                f"-storageDataPath={tmp_path / 'vm'}",
                f"-httpListenAddr=127.0.0.1:{vm_port}",
                f"-promscrape.config={tmp_path / 'scrape.yml'}",
                f"-vmalert.proxyURL={vmalert_url}",
                "-search.latencyOffset=1s",
                "-search.disableCache",
            ],
            stdout=logs,
            stderr=logs,
        ),  # fmt: skip
        subprocess.Popen(
            [
                "vmalert",
                f"-rule={rules}",
                f"-datasource.url={vm_url}",
                f"-remoteWrite.url={vm_url}",
                f"-httpListenAddr=127.0.0.1:{vmalert_port}",
                "-evaluationInterval=1s",
            ],
            stdout=logs,
            stderr=logs,
        ),  # fmt: skip
    ]
    try:
        wait_ready(vm_url + "/health")
        wait_for(lambda: _failing_rules(vm_url), timeout=120, step=1)  # through VictoriaMetrics' proxy to vmalert
        wait_for(
            lambda: settled(vm_url, recording.NODE_MODELS, 'gpuwarden_health{check="ecc"} == 2'), timeout=120, step=1
        )
        check_fallback(vm_url)
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
