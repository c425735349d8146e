"""The fleet service end to end: simulated nodes under different scenarios, scraped by a real Prometheus, asked by
`gpuwarden fleet` over real HTTP. Each endpoint's answer is checked against what the scenarios imply.

Stood in for: the kubelet of one node (a fake pod-resources gRPC server, as in test_podresources) and, for the
failure cases, a Prometheus that is down, slow or refusing (small local servers).
"""

from __future__ import annotations

import contextlib
import math
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from alert_rules import generate
from gpuwarden.fleet.settings import FleetSettings, parse
from gpuwarden.health import rules
from tests.helpers.browser import CHROMIUM_FLAGS, chromium
from tests.helpers.common import free_port, wait_for, write_yaml
from tests.helpers.fleet import FleetServer, fleet_settings
from tests.helpers.kubelet import FakeKubelet
from tests.helpers.stack import PROMETHEUS, late_nvlink_down, stack

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # end-to-end, and measured under load or against real clocks

SHORT = {
    "utilization_for_s": 8,
    "memory_for_s": 3,
    "temperature_warning_for_s": 3,
    "temperature_critical_for_s": 3,
    "thermal_slowdown_for_s": 8,
    "power_cap_for_s": 8,
    "nvlink_down_for_s": 2,
    "persistence_off_for_s": 3,
    "bottleneck_window_s": 5,
    "fabric_setup_for_s": 3,
}
SCENARIOS = [
    "healthy",
    "training",
    "data-starvation",
    "ecc-uncorrectable",
    "nvlink-down",
    "gpu-lost",
    "row-remap",
    "xid-before-start",  # from the kernel log: logged before the exporter started
    "fabric-manager-down",
    "nvswitch-sxid",  # likewise: every GPU's fabric verdict a warning, never a cordon candidate
]
HARDWARE = {
    "ecc-uncorrectable": ("GpuwardenEccUncorrectable", "1"),
    "nvlink-down": ("GpuwardenNvlinkDown", "4"),
    "gpu-lost": ("GpuwardenGpuLost", "6"),
    "row-remap": ("GpuwardenRowRemapFailure", "5"),
    "xid-before-start": ("GpuwardenXidCritical", "2"),
    "fabric-manager-down": ("GpuwardenFabricNotReady", "0"),  # every GPU; the finding is the node's
}
NODE_LEVEL = {"GpuwardenFabricNotReady"}  # one page per node: no gpu label


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if PROMETHEUS is None:
        pytest.fail("prometheus missing: the README's test command installs Debian's prometheus package")
    tmp = tmp_path_factory.mktemp("fleet")
    thresholds = write_yaml(tmp / "thresholds.yaml", SHORT)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kubelet-") as short, stack(tmp) as parts:
        kubelet = FakeKubelet(Path(short) / "kubelet.sock").start()
        for scenario in SCENARIOS:
            flags = ["--health.thresholds-file", str(thresholds)]
            if scenario == "data-starvation":
                flags += ["--pods.resources-socket", str(kubelet.socket_path), "--pods.refresh-interval", "1"]
            if scenario == "nvlink-down":
                parts.exporter(late_nvlink_down(tmp), *flags, name=scenario)
            else:
                parts.exporter(scenario, *flags)
        parts.dead_targets.append(f"127.0.0.1:{free_port()}")
        # the shipped rules, `for:` shortened, so that cordon candidates can say which alerts fire
        parts.start_prometheus(generate.alert_rules_yaml(rules.build(), for_scale=1 / 240))
        starving = parts.instance_of("data-starvation")
        uuids = [g["uuid"] for g in httpx.get(f"http://{starving}/api/v1/gpus", timeout=5).json()["gpus"]]
        # team-a trains on GPUs 0-5; two notebooks of team-b time-share GPU 6; GPU 7 is held by no pod
        kubelet.pods = [
            ("team-a", "trainer", [("main", [("nvidia.com/gpu", uuids[:6])])]),
            ("team-b", "nb-1", [("jupyter", [("nvidia.com/gpu.shared", [f"{uuids[6]}::0"])])]),
            ("team-b", "nb-2", [("jupyter", [("nvidia.com/gpu.shared", [f"{uuids[6]}::1"])])]),
        ]
        # the shortened sustained checks judged, the pods attributed, the link and the GPU lost
        started = time.monotonic()
        # every hardware node's verdict critical on its GPU as well: the kernel log's and the sustained fabric check's
        # come a few polls after start, later under load (CI once listed every node but one)
        steady = (
            'gpuwarden_health{check="utilization"} > 0',
            "gpuwarden_gpu_allocation",
            'gpuwarden_health{check="nvlink"} > 0',
            "gpuwarden_gpu_up == 0",
            *(
                f'gpuwarden_health{{instance="{parts.instance_of(scenario)}",gpu="{gpu}"}} >= 2'
                for scenario, (_, gpu) in HARDWARE.items()
            ),
            f'gpuwarden_health{{instance="{parts.instance_of("nvswitch-sxid")}",check="fabric"}} > 0',
        )
        while missing := [expr for expr in steady if not parts.query(expr)]:
            assert time.monotonic() - started < 120, f"the fleet stack never showed {missing}"
            time.sleep(1)
        # test_recording_rules_give_the_raw_answers's, started once every node is in its steady state (the recorded
        # path averages what it recorded: a start-up in its window is not what the raw path sees), so that it has
        # recorded while the other tests ran
        recording = _recording_prometheus(parts)
        try:
            with FleetServer(fleet_settings(parts.prometheus)) as fleet:
                yield {"stack": parts, "fleet": fleet, "uuids": uuids, "recording": recording[0]}
        finally:
            recording[1].terminate()
            recording[1].wait(10)
            kubelet.stop()


def _recording_prometheus(parts: Any) -> tuple[str, subprocess.Popen]:
    """A second real Prometheus over the same exporters, with the shipped recording rules evaluated every second, rates
    over 10 s instead of 5 m: it has a minute of history, and rate() over 5 m of it would divide by 300 s."""
    tmp = parts.tmp / "recording"
    tmp.mkdir()
    config = yaml.safe_load((parts.tmp / "prometheus.yml").read_text())
    config.pop("rule_files", None)
    config.pop("alerting", None)
    (tmp / "recording.yaml").write_text(generate.recording_rules_yaml(interval_s=1, rate_window="10s"))
    config["rule_files"] = [str(tmp / "recording.yaml")]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}", prometheus


def instance(world: dict[str, Any], scenario: str) -> str:
    return world["stack"].instance_of(scenario)


def answer_with_every_node_scraped(world: dict[str, Any], path: str) -> dict[str, Any]:
    """The fleet's answer at an instant when every live exporter's scrape succeeded. A failed scrape (an exporter
    starved past the 900 ms scrape timeout, as under CI's load: reproduced by stopping one with SIGSTOP) makes its
    node unknown at that instant, rightly without its verdicts; the tests here are about the steady fleet."""
    dead = "|".join(world["stack"].dead_targets)
    started = time.monotonic()
    while True:
        asked = time.time()
        body = world["fleet"].get(path).json()
        # the fleet evaluates at the second before it was asked, and no later than now: the span covers both
        span = math.ceil(time.time() - asked) + 2
        if not world["stack"].query(f'min_over_time(up{{instance!~"{dead}"}}[{span}s]) == 0'):
            return body
        assert time.monotonic() - started < 60, f"an exporter's scrapes kept failing while {path} was asked"


def test_inventory(world: dict[str, Any]) -> None:
    body = answer_with_every_node_scraped(world, "/api/v1/fleet")
    assert "nodes" in body, body
    nodes = {n["node"]: n for n in body["nodes"]}
    dead = world["stack"].dead_targets[0]
    assert set(nodes) == {instance(world, s) for s in SCENARIOS} | {dead}
    for scenario in SCENARIOS:
        node = nodes[instance(world, scenario)]
        assert node["gpus"] == 8 and node["exporter_up"] and node["nvml_up"]
        assert node["models"] == {"NVIDIA H100 80GB HBM3": 8}
        assert node["memory_bytes"]["NVIDIA H100 80GB HBM3"] == pytest.approx(85520809984, rel=0.01)
        assert node["driver_version"] and node["exporter_version"] == "0.1.0"
    assert nodes[instance(world, "gpu-lost")]["gpus_visible"] == 7
    assert body["totals"]["gpus"] == 8 * len(SCENARIOS)
    assert body["totals"]["models"]["NVIDIA H100 80GB HBM3"]["nodes"] == len(SCENARIOS)
    assert [s["node"] for s in body["stale_exporters"]] == [dead]
    assert "down" in body["stale_exporters"][0]["reason"]


def test_health_lists_exactly_the_unhealthy_gpus_with_since(world: dict[str, Any]) -> None:
    body = answer_with_every_node_scraped(world, "/api/v1/fleet/health")
    by_node: dict[str, dict[str, dict[str, Any]]] = {}
    for gpu in body["unhealthy_gpus"]:
        by_node.setdefault(gpu["node"], {})[gpu["gpu"]] = gpu
    for scenario, (_, gpu) in HARDWARE.items():
        entry = by_node[instance(world, scenario)][gpu]
        assert entry["severity"] == "critical"
        assert entry["since"] and entry["since"] <= time.time()
    assert {c["check"] for c in by_node[instance(world, "ecc-uncorrectable")]["1"]["checks"]} >= {"ecc"}
    assert "gpu_lost" in {c["check"] for c in by_node[instance(world, "gpu-lost")]["6"]["checks"]}
    sxid = by_node[instance(world, "nvswitch-sxid")]
    assert len(sxid) == 8 and all(g["severity"] == "warning" for g in sxid.values()), sxid
    assert all({c["check"] for c in g["checks"]} == {"fabric"} for g in sxid.values()), sxid
    starving = by_node[instance(world, "data-starvation")]
    assert len(starving) == 8 and all(any(c["check"] == "utilization" for c in g["checks"]) for g in starving.values())
    assert instance(world, "healthy") not in by_node and instance(world, "training") not in by_node
    assert body["unknown_nodes"] == world["stack"].dead_targets
    assert body["counts"]["critical"] >= 4


def test_cordon_candidates_are_the_hardware_nodes_with_evidence(world: dict[str, Any]) -> None:
    body = answer_with_every_node_scraped(world, "/api/v1/fleet/cordon-candidates")
    candidates = {c["node"]: c for c in body["candidates"]}
    assert set(candidates) == {instance(world, s) for s in HARDWARE}, body
    for scenario, (alert, gpu) in HARDWARE.items():
        entry = candidates[instance(world, scenario)]
        finding = next((f for f in entry["findings"] if f["alert"] == alert), None)
        assert finding is not None, entry
        assert ("gpu" not in finding["labels"]) if alert in NODE_LEVEL else (finding["labels"]["gpu"] == gpu), finding
        assert finding["runbook_url"].endswith("#" + alert.lower())
        node_name = instance(world, scenario).rsplit(":", 1)[0]
        assert entry["commands"][0] == f"kubectl cordon {node_name}"
        assert entry["commands"][1].startswith(f"kubectl drain {node_name} --ignore-daemonsets")
    remap = next(
        f for f in candidates[instance(world, "row-remap")]["findings"] if f["alert"] == "GpuwardenRowRemapFailure"
    )
    assert remap["alert_firing"] is True  # the rule is loaded in this Prometheus and has fired
    # the RMA case sorts first: a failed remap needs the board replaced
    assert body["candidates"][0]["node"] == instance(world, "row-remap"), body


def test_utilization_idle_starved_waste_and_namespaces(world: dict[str, Any]) -> None:
    body = world["fleet"].get("/api/v1/fleet/utilization", window="5m").json()
    idle_nodes = {g["node"] for g in body["idle_gpus"]}
    starved_nodes = {g["node"] for g in body["starved_gpus"]}
    assert instance(world, "healthy") in idle_nodes
    assert len([g for g in body["idle_gpus"] if g["node"] == instance(world, "healthy")]) == 8
    assert starved_nodes == {instance(world, "data-starvation")}
    classes = body["bottlenecks"]  # from GPM: what each GPU's time goes to
    by_node = {entry["node"]: entry["classes"] for entry in classes["by_node"]}
    assert by_node[instance(world, "data-starvation")] == {"waiting": 8}
    assert by_node[instance(world, "healthy")] == {"idle": 8}
    assert classes["gpus_by_class"]["waiting"] >= 8 and classes["wasted_gpu_hours_by_class"]["waiting"] > 0
    assert any("waiting" in entry["classes"] for entry in classes["by_namespace"])
    assert instance(world, "training") not in idle_nodes | starved_nodes
    nodes = {n["node"]: n for n in body["by_node"]}
    healthy, training = nodes[instance(world, "healthy")], nodes[instance(world, "training")]
    # hours are what the counters saw: ~8 GPUs x the seconds Prometheus has scraped, not 8 x the whole window
    assert 0 < healthy["gpu_hours"] < 8 * 5 / 60
    assert healthy["utilization"] < 0.05
    assert healthy["wasted_gpu_hours"] == pytest.approx(healthy["gpu_hours"], rel=0.05, abs=2e-4)  # idle: all wasted
    assert training["utilization"] > 0.8
    assert training["wasted_gpu_hours"] == pytest.approx(
        training["gpu_hours"] * (1 - training["utilization"]), rel=0.25, abs=0.002
    )
    assert healthy["wasted_cost"] == pytest.approx(healthy["wasted_gpu_hours"] * 2.5, abs=0.01)
    starving = nodes[instance(world, "data-starvation")]
    namespaces = {n["namespace"]: n for n in body["by_namespace"]}
    assert set(namespaces) == {"team-a", "team-b"}
    per_gpu_hours = starving["gpu_hours"] / 8
    # team-a holds 6 GPUs, team-b shares one (1/2 + 1/2); per-GPU counters differ by the rate() extrapolation of
    # series a minute old, hence the tolerance
    assert namespaces["team-a"]["allocated_gpu_hours"] == pytest.approx(6 * per_gpu_hours, rel=0.15, abs=2e-4)
    assert namespaces["team-b"]["allocated_gpu_hours"] == pytest.approx(1 * per_gpu_hours, rel=0.15, abs=2e-4)
    # the starved job wastes ~70 % of its GPUs' time (30 % duty)
    assert namespaces["team-a"]["wasted_gpu_hours"] == pytest.approx(
        namespaces["team-a"]["allocated_gpu_hours"] * 0.7, rel=0.2, abs=2e-4
    )
    assert body["totals"]["wasted_cost"] == pytest.approx(body["totals"]["wasted_gpu_hours"] * 2.5, abs=0.05)
    assert body["totals"]["gpu_hours"] == pytest.approx(sum(n["gpu_hours"] for n in body["by_node"]), abs=0.01)


def test_utilization_limit_caps_the_lists_not_the_counts(world: dict[str, Any]) -> None:
    body = world["fleet"].get("/api/v1/fleet/utilization", window="5m", limit=3).json()
    full = world["fleet"].get("/api/v1/fleet/utilization", window="5m", limit=1000).json()
    assert len(body["idle_gpus"]) == 3 and len(body["starved_gpus"]) == 3
    assert body["totals"]["idle_gpus"] == len(full["idle_gpus"]) >= 8  # the healthy node's 8 at least
    assert body["totals"]["starved_gpus"] == len(full["starved_gpus"]) == 8
    assert world["fleet"].get("/api/v1/fleet/utilization", limit=0).status_code == 422


def test_utilization_window_is_validated(world: dict[str, Any]) -> None:
    for bad in ("1y", "abc", "1m", "30d"):
        response = world["fleet"].get("/api/v1/fleet/utilization", window=bad)
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["loc"][-1] == "window"


def test_plan_against_worked_examples_and_the_fleet(world: dict[str, Any]) -> None:
    fleet = world["fleet"]
    unsharded = fleet.get("/api/v1/plan", parameters=7e9, precision="fp16", optimizer="adam").json()
    # ZeRO paper accounting: 16 bytes per parameter → 112 GB = 104.3 GiB of model states
    assert unsharded["per_gpu"]["total_gb"] == pytest.approx(112.0, abs=0.1)
    assert unsharded["per_gpu"]["total_gib"] == pytest.approx(104.31, abs=0.01)
    h100 = next(f for f in unsharded["fleet"] if f["model"] == "NVIDIA H100 80GB HBM3")
    assert h100["fits"] is False and h100["gpus_in_fleet"] == 8 * len(SCENARIOS)
    zero3 = fleet.get(
        "/api/v1/plan", parameters=7e9, precision="bf16", optimizer="adamw", sharding="zero3", gpus=8
    ).json()
    assert 11 <= zero3["per_gpu"]["total_gib"] <= 13.1
    assert zero3["model_states_unsharded_gib"] == pytest.approx(104.31, abs=0.01)
    assert next(f for f in zero3["fleet"] if f["model"] == "NVIDIA H100 80GB HBM3")["fits"] is True
    with_act = fleet.get(
        "/api/v1/plan",
        parameters=7e9,
        sharding="zero3",
        gpus=8,
        layers=32,
        hidden_size=4096,
        heads=32,
        sequence_length=4096,
        micro_batch_size=1,
        activation_checkpointing="true",
    ).json()
    assert with_act["per_gpu"]["activations"] == "estimated"
    assert with_act["per_gpu"]["activations_gib"] == pytest.approx(1.0, abs=0.01)  # 2·s·b·h·L bytes
    bad = fleet.get("/api/v1/plan", parameters=7e9, precision="int4")
    assert bad.status_code == 422 and "inference" in bad.json()["detail"][0]["msg"]
    assert fleet.get("/api/v1/plan", parameters=7e9, optimizer="adamx").status_code == 422
    assert fleet.get("/api/v1/plan", parameters=7e9, layers=32).status_code == 422
    assert fleet.get("/api/v1/plan").status_code == 422


def test_overview_page_renders_the_fleet(world: dict[str, Any]) -> None:
    response = world["fleet"].get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    for scenario in HARDWARE:
        assert instance(world, scenario) in page
    assert "GpuwardenRowRemapFailure" in page and "kubectl cordon" in page
    assert "<script" not in page  # server-rendered, no front-end build


# -- Prometheus down, slow, refusing ------------------------------------------------------------------------------


class _Upstream(BaseHTTPRequestHandler):
    delay = 0.0
    status = 200
    body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        time.sleep(self.delay)
        try:
            self.send_response(self.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: Any) -> None:
        pass


def upstream(**attrs: Any) -> ThreadingHTTPServer:
    handler = type("Upstream", (_Upstream,), attrs)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/fleet",
        "/api/v1/fleet/health",
        "/api/v1/fleet/cordon-candidates",
        "/api/v1/fleet/utilization",
        "/readyz",
    ],
)
def test_prometheus_down_slow_or_refusing_is_a_clear_json_error(path: str) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    down_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    slow = upstream(delay=2.0)
    refusing = upstream(status=400, body=b'{"status":"error","errorType":"bad_data","error":"parse error"}')
    timing_out = upstream(status=503, body=b'{"status":"error","errorType":"timeout","error":"query timed out"}')
    try:
        cases = [
            (down_url, 503, "unreachable"),
            (f"http://127.0.0.1:{slow.server_port}", 504, "did not answer"),
            (f"http://127.0.0.1:{refusing.server_port}", 502, "refused"),
            (f"http://127.0.0.1:{timing_out.server_port}", 504, "timed out"),
        ]
        for url, status, words in cases:
            with FleetServer(fleet_settings(url, query_timeout=0.5)) as fleet:
                response = fleet.get(path)  # the slow one answers after 2 s: its 504 is the 0.5 s deadline
                assert response.status_code == status, (url, response.text)
                body = response.json()
                assert body["error"] == "prometheus" and words in body["detail"], body
    finally:
        for server in (slow, refusing, timing_out):
            server.shutdown()


def test_fleet_service_metrics_count_queries_by_outcome(world: dict[str, Any]) -> None:
    from tests.helpers.common import parse_exposition, values

    world["fleet"].get("/api/v1/fleet")
    series = parse_exposition(world["fleet"].get("/metrics").text)
    assert values(series, "gpuwarden_fleet_prometheus_queries_total", outcome="ok")[0] >= 8
    assert values(series, "gpuwarden_fleet_prometheus_query_duration_seconds_count")[0] >= 8
    assert values(series, "gpuwarden_fleet_build_info")[0] == 1
    with FleetServer(fleet_settings("http://127.0.0.1:9", query_timeout=0.5, cache_ttl=60)) as fleet:
        assert fleet.get("/api/v1/fleet/health").status_code == 503
        down = parse_exposition(fleet.get("/metrics").text)
    assert values(down, "gpuwarden_fleet_prometheus_queries_total", outcome="unavailable")[0] >= 1
    assert values(down, "gpuwarden_fleet_prometheus_queries_total", outcome="ok") == [0]


def test_cache_answers_repeats_without_asking_prometheus(world: dict[str, Any]) -> None:
    from tests.helpers.common import parse_exposition, values

    with FleetServer(fleet_settings(world["stack"].prometheus, cache_ttl=60)) as fleet:
        first = fleet.get("/api/v1/fleet/health").json()
        asked = values(
            parse_exposition(fleet.get("/metrics").text), "gpuwarden_fleet_prometheus_queries_total", outcome="ok"
        )[0]
        second = fleet.get("/api/v1/fleet/health").json()
        series = parse_exposition(fleet.get("/metrics").text)
    assert values(series, "gpuwarden_fleet_prometheus_queries_total", outcome="ok")[0] == asked
    assert values(series, "gpuwarden_fleet_answers_total", served="computed") == [1]
    assert values(series, "gpuwarden_fleet_answers_total", served="fresh") == [1]
    assert second["unhealthy_gpus"] == first["unhealthy_gpus"]
    assert first["freshness"]["stale"] is second["freshness"]["stale"] is False
    assert second["freshness"]["computed_at"] == first["freshness"]["computed_at"]
    assert second["freshness"]["age_seconds"] >= first["freshness"]["age_seconds"]


def test_plan_still_answers_when_prometheus_is_down() -> None:
    with FleetServer(fleet_settings("http://127.0.0.1:9", query_timeout=0.5)) as fleet:
        body = fleet.get("/api/v1/plan", parameters=7e9).json()
    assert body["per_gpu"]["total_gib"] > 100 and body["fleet"] is None and "unreachable" in body["fleet_error"]


def test_overview_page_says_prometheus_is_down() -> None:
    with FleetServer(fleet_settings("http://127.0.0.1:9", query_timeout=0.5)) as fleet:
        response = fleet.get("/")
    assert response.status_code == 503 and "Prometheus cannot be asked" in response.text


def test_settings_from_flags_and_environment() -> None:
    settings = parse(
        ["--prometheus-url", "http://prom:9090/", "--price-per-gpu-hour", "3.1"],
        environ={"GPUWARDEN_FLEET_NODE_LABEL": "node"},
    )
    assert settings.prometheus_url == "http://prom:9090" and settings.price_per_gpu_hour == 3.1
    assert settings.node_label == "node"


# -- the page in a real browser ---------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    import struct

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_overview_page_in_headless_chromium(world: dict[str, Any], tmp_path: Path) -> None:
    import os
    import subprocess

    url = world["fleet"].url + "/"
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, *profile, "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    for scenario in HARDWARE:
        assert instance(world, scenario) in dom.stdout
    assert 'id="cordon"' in dom.stdout and "kubectl drain" in dom.stdout
    shot = tmp_path / "fleet-overview.png"
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, *profile, "--window-size=1400,1900", f"--screenshot={shot}", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    assert png_size(shot) == (1400, 1900)
    assert shot.stat().st_size > 50_000, "a page of tables renders to more than a blank image"
    if os.environ.get("UPDATE_FLEET_SCREENSHOT"):
        (Path(__file__).resolve().parents[1] / "docs" / "fleet-overview.png").write_bytes(shot.read_bytes())


def test_docs_list_every_fleet_setting_with_its_flag_env_and_default() -> None:
    import re
    from dataclasses import MISSING, fields

    from gpuwarden.fleet.settings import env_name, flag

    text = (Path(__file__).resolve().parents[1] / "docs" / "fleet.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(--[\w.-]+)` \|.*$", text, re.M)}
    settings = fields(FleetSettings)
    assert set(rows) == {flag(field.name) for field in settings}, "docs/fleet.md's settings table drifted"
    for field in settings:
        row = rows[flag(field.name)]
        assert f"`{env_name(field.name)}`" in row, row
        if field.default is not None and field.default is not MISSING:
            shown = f"{field.default:g}" if isinstance(field.default, float) else str(field.default)
            assert shown in row, (field.name, shown, row)


# -- recording rules (alert_rules/gpuwarden.recording.yaml) -------------------------------------------------------


def test_recording_rules_give_the_raw_answers(world: dict[str, Any]) -> None:
    """The recording Prometheus (started once the stack was steady: same exporters, the shipped recording rules every
    second, rates over 10 s): the utilization answer from the recorded series equals the raw one, which the first
    Prometheus (no recording rules) gives with a note saying so. Hours agree within the recorded path's start-up: its
    first rate needs 10 s of data that the raw increase() already counts (a minute of history here; a negligible share
    of an hour's window)."""
    from gpuwarden.fleet import recording

    raw_only = world["fleet"].get("/api/v1/fleet/utilization", window="5m").json()
    assert "source" in raw_only, raw_only
    assert raw_only["source"].startswith("raw series: the recording rules")
    url = world["recording"]
    # 40 evaluations at least, so that the recorded path's first 10 s are a small share
    wait_for(lambda: _count(url, f"count_over_time({recording.GPU_STARVED}[5m]) >= 40") >= 8
             and _count(url, recording.NS_IDLE) >= 2, timeout=90, step=1)  # fmt: skip
    window = "5m"
    got: dict[str, Any] = {}
    want: dict[str, Any] = {}

    def gpus(answer: dict[str, Any], listed: str) -> set[tuple[str, str]]:
        return {(g["node"], g["gpu"]) for g in answer.get(listed, ())}

    with (
        # a --recording-interval that disagrees with the rules' 1 s: the fleet takes the interval Prometheus lists
        FleetServer(fleet_settings(url, recording_interval=97)) as recorded,
        FleetServer(fleet_settings(url, recording_rules="off")) as raw,
    ):

        def agree() -> bool:
            """A GPU is idle in the recorded path once its record was idle at every evaluation of the window: a
            scrape missed on a loaded machine keeps it out until that evaluation leaves the window, while the raw
            increase() counts it. Asked again until both paths list the same GPUs (or the wait fails below)."""
            nonlocal got, want
            got = recorded.get("/api/v1/fleet/utilization", window=window, limit=1000).json()
            want = raw.get("/api/v1/fleet/utilization", window=window, limit=1000).json()
            return all(gpus(got, listed) == gpus(want, listed) for listed in ("starved_gpus", "idle_gpus"))

        with contextlib.suppress(AssertionError):  # not within the window's length: the asserts say how they differ
            wait_for(agree, timeout=330, step=5)
    assert "source" in got, got
    assert got["source"].startswith("recording rules") and want["source"].startswith("raw series")
    assert gpus(got, "starved_gpus") == gpus(want, "starved_gpus") and gpus(got, "idle_gpus") == gpus(want, "idle_gpus")
    assert got["totals"]["starved_gpus"] == want["totals"]["starved_gpus"] == 8
    nodes = {n["node"]: n for n in want["by_node"]}
    for node in got["by_node"]:
        expected = nodes[node["node"]]
        assert node["gpus"] == expected["gpus"]
        assert node["utilization"] == pytest.approx(expected["utilization"], abs=0.08)
        assert node["gpu_hours"] == pytest.approx(expected["gpu_hours"], rel=0.3), node
        assert node["gpu_hours"] <= expected["gpu_hours"] * 1.05  # never more than the counters saw
        assert node["wasted_gpu_hours"] == pytest.approx(expected["wasted_gpu_hours"], rel=0.3, abs=2e-3), node
    namespaces = {n["namespace"]: n for n in want["by_namespace"]}
    assert {n["namespace"] for n in got["by_namespace"]} == set(namespaces) == {"team-a", "team-b"}
    for entry in got["by_namespace"]:
        expected = namespaces[entry["namespace"]]
        assert entry["allocated_gpu_hours"] == pytest.approx(expected["allocated_gpu_hours"], rel=0.3)


def _count(prometheus: str, expr: str) -> int:
    try:
        answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": f"count({expr})"}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return 0
    result = answer.get("data", {}).get("result") or []
    return int(float(result[0]["value"][1])) if result else 0


def test_records_compared_evaluation_by_evaluation_are_written_by_one_group() -> None:
    """The idle and starved lists keep a GPU whose record was written at every evaluation of its node's GPU count: in
    two groups (evaluated at their own offsets) one group's extra evaluation in the window dropped a whole node from
    the recorded list (seen in a fresh-clone run once the rules were split into groups)."""
    from gpuwarden.fleet import recording

    groups = yaml.safe_load((ROOT / "alert_rules" / "gpuwarden.recording.yaml").read_text())["groups"]
    group_of = {rule["record"]: group["name"] for group in groups for rule in group["rules"]}
    for together in recording.EVALUATED_TOGETHER:
        assert len({group_of[record] for record in together}) == 1, {record: group_of[record] for record in together}
    assert len(groups) > 1  # the check means something: the records are spread over several groups


def test_the_recording_rules_file_is_generated_and_promtool_accepts_it() -> None:
    from gpuwarden.fleet import recording

    shipped = ROOT / "alert_rules" / "gpuwarden.recording.yaml"
    assert shipped.read_text() == generate.recording_rules_yaml(), "run `python alert_rules/generate.py`"
    result = subprocess.run(["promtool", "check", "rules", str(shipped)], capture_output=True, text=True)
    assert result.returncode == 0 and f"SUCCESS: {len(recording.rules())} rules found" in result.stdout, (
        result.stdout + result.stderr
    )
