"""The shipped Alertmanager config (deploy/alertmanager/alertmanager.yml) in real Alertmanager: its inhibit rules
act on gpuwarden's alerts only. Its third rule (critical mutes warning and info, equal instance and uuid) was not
scoped: another team's critical alert muted unrelated warnings on the same instance (issue 36)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers.common import wait_for
from tests.helpers.stack import ALERTMANAGER, Stack

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def alertmanager(tmp_path: Path):
    if ALERTMANAGER is None:
        pytest.fail("alertmanager missing: the README's test command installs Debian's prometheus-alertmanager")
    config = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    (tmp_path / "routing-key").write_text("0" * 32)
    for receiver in config["receivers"]:  # nothing leaves the machine: every receiver points at a closed port
        for pd in receiver.get("pagerduty_configs", []):
            pd.update(url="http://127.0.0.1:9/v2/enqueue", routing_key_file=str(tmp_path / "routing-key"))
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = "http://127.0.0.1:9/hook"
    stack = Stack(tmp_path)
    try:
        yield f"http://127.0.0.1:{stack.alertmanager(config)}"
    finally:
        stack.stop()


def post(url: str, *alerts: dict[str, str]) -> None:
    body = [{"labels": labels, "annotations": {"summary": labels["alertname"]}} for labels in alerts]
    assert httpx.post(url + "/api/v2/alerts", json=body, timeout=10).status_code == 200


def muted(url: str) -> dict[str, bool]:
    """alertname → whether Alertmanager holds it inhibited now."""
    answer: list[dict[str, Any]] = httpx.get(url + "/api/v2/alerts", timeout=10).json()
    return {a["labels"]["alertname"]: bool(a["status"]["inhibitedBy"]) for a in answer}


def test_the_inhibit_rules_touch_only_gpuwardens_alerts(alertmanager: str) -> None:
    gpu = {"instance": "gpu-7:10045", "uuid": "GPU-1", "gpu": "1", "node": "gpu-7"}
    post(
        alertmanager,
        # gpuwarden: a critical on GPU 1 explains that GPU's warning (kept as shipped)
        {"alertname": "GpuwardenTemperatureCritical", "severity": "critical", **gpu},
        {"alertname": "GpuwardenTemperatureHigh", "severity": "warning", **gpu},
        # another team's critical and warning on one instance, with no uuid on either: equal labels, but not ours
        {"alertname": "NodeFilesystemAlmostOutOfSpace", "severity": "critical", "instance": "gpu-7:9100"},
        {"alertname": "NodeMemoryHighUtilization", "severity": "warning", "instance": "gpu-7:9100"},
        # and theirs never mutes ours: a warning of ours beside their critical on the same instance and uuid
        {"alertname": "DcgmXidCritical", "severity": "critical", "instance": "gpu-7:10045", "uuid": "GPU-2"},
        {"alertname": "GpuwardenPowerCapped", "severity": "warning", "instance": "gpu-7:10045", "uuid": "GPU-2"},
        # a page for a lasting fault carries no instance (it outlives an exporter restart): it still mutes the
        # same GPU's warning, which has one
        {"alertname": "GpuwardenRowRemapFailure", "severity": "critical", "node": "gpu-7", "uuid": "GPU-3"},
        {"alertname": "GpuwardenRowRemapPending", "severity": "warning", "instance": "gpu-7:10045", "uuid": "GPU-3"},
    )
    wait_for(lambda: len(muted(alertmanager)) == 8 and muted(alertmanager)["GpuwardenRowRemapPending"], timeout=30)
    assert muted(alertmanager) == {
        "GpuwardenRowRemapFailure": False,
        "GpuwardenRowRemapPending": True,
        "GpuwardenTemperatureCritical": False,
        "GpuwardenTemperatureHigh": True,
        "NodeFilesystemAlmostOutOfSpace": False,
        "NodeMemoryHighUtilization": False,  # was muted by the unscoped rule
        "DcgmXidCritical": False,
        "GpuwardenPowerCapped": False,
    }
