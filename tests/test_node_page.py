"""The node's own page (GET /) as an on-call reads it over `kubectl port-forward`: each GPU's state, the findings with
cause and action, the holders; plain HTML that asks for nothing outside the node, in headless Chromium (issue 36
point 12). `UPDATE_NODE_SCREENSHOTS=1` writes the three screenshots docs/README.md shows into docs/."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpuwarden.web import node_page
from tests.helpers.browser import CHROMIUM_FLAGS, chromium, dump_dom
from tests.helpers.common import wait_for
from tests.test_lost_at_start import LOST_FROM_START
from tests.test_processes import FULL_GPU, two_pods

DOCS = Path(__file__).resolve().parents[1] / "docs"


def screenshot(url: str, tmp_path: Path, name: str) -> None:
    """A 1400×1000 screenshot by headless Chromium; kept in docs/ when UPDATE_NODE_SCREENSHOTS is set."""
    shot = tmp_path / name
    profile = f"--user-data-dir={tmp_path / 'shot-profile'}"
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, profile, "--window-size=1400,1000", f"--screenshot={shot}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", result.stderr[-2000:]
    assert shot.stat().st_size > 30_000, "a page of tables renders to more than a blank image"
    if os.environ.get("UPDATE_NODE_SCREENSHOTS"):
        (DOCS / name).write_bytes(shot.read_bytes())


@pytest.mark.slow  # headless Chromium
def test_a_healthy_node_reads_healthy_with_every_gpu_and_asks_for_nothing_else(live_server, tmp_path: Path) -> None:
    server = live_server("training")
    wait_for(lambda: "8 of 8 GPU(s) answering" in server.get("/").text)
    dom, hosts = dump_dom(server.url + "/", tmp_path / "profile")
    assert hosts == [f"127.0.0.1:{server.url.rsplit(':', 1)[1]}"] * len(hosts) and hosts  # the page and nothing else
    assert "gpuwarden <span" in dom and ">healthy<" in dom
    assert dom.count("<code>GPU-") == 8  # a row per GPU, named by UUID
    assert "°C" in dom and "GiB of 80" in dom and "No findings" in dom
    # a node minutes old has no bottleneck class yet: its column says why, not nothing
    assert dom.count("measuring: ") == 8 and "s of the 300 s window" in dom, dom
    assert "<script" not in dom  # plain HTML: no framework, nothing to load
    screenshot(server.url + "/", tmp_path, "node-page-healthy.png")


@pytest.mark.slow  # headless Chromium
def test_a_gpu_lost_before_a_restart_is_a_critical_row_and_a_finding(live_server, tmp_path: Path) -> None:
    server = live_server(LOST_FROM_START)
    wait_for(lambda: "3 of 4 GPU(s) answering" in server.get("/").text)
    dom, _ = dump_dom(server.url + "/", tmp_path / "profile")
    assert ">critical<" in dom and "lost (gpu_is_lost)" in dom
    findings = dom[dom.index('id="findings"') : dom.index('id="holders"')]
    assert "gpu_lost" in findings and "drain" in findings.lower()
    screenshot(server.url + "/", tmp_path, "node-page-lost-gpu.png")


@pytest.mark.slow  # headless Chromium
def test_findings_show_cause_action_and_the_holders(live_server, tmp_path: Path) -> None:
    server = live_server(FULL_GPU, processes=two_pods(tmp_path, "nb-bob"))
    wait_for(lambda: "research/nb-bob/notebook" in server.get("/").text)  # pods: a cycle after the PIDs
    dom, _ = dump_dom(server.url + "/", tmp_path / "profile")
    findings = dom[dom.index('id="findings"') : dom.index('id="holders"')]
    assert "memory_pressure" in findings and "expandable_segments" in findings
    holders = dom[dom.index('id="holders"') :]
    assert "ml/trainer-0/worker" in holders and "4101" in holders and "60.0 GiB" in holders
    screenshot(server.url + "/", tmp_path, "node-page-findings.png")


def test_what_the_node_reports_is_escaped_not_interpreted() -> None:
    """A process name or a reason comes from the host (/proc, the driver): the template autoescapes it."""
    row = node_page.GpuRow(0, "GPU-<b>", "<script>alert(1)</script>", "", "", "", "", "", "", "ok")
    page = {
        "verdict": "ok", "verdict_text": "healthy", "answering": 1, "counted": 1, "nvml": "up", "driver": "x",
        "taken": "t", "version": "v", "gpus": [row], "skipped": [], "findings": [], "holders": [], "links": ("/",),
    }  # fmt: skip
    html = node_page._template().render(page=page)
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
