"""Every endpoint through the real HTTP server on a loopback port, with the pipeline running over the simulator."""

from __future__ import annotations

import gzip
import signal
import threading
import time

import httpx
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from tests.helpers.common import parse_exposition, values, wait_for
from tests.helpers.daemon import start_daemon


def test_metrics_text_openmetrics_and_gzip(live_server):
    server = live_server("healthy")
    plain = server.get("/metrics")
    assert plain.status_code == 200
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    series = parse_exposition(plain.text)
    assert values(series, "gpuwarden_nvml_up") == [1]
    assert len(values(series, "gpuwarden_gpu_up")) == 8
    om = server.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    assert any(f.name == "gpuwarden_busy_seconds" for f in parse_openmetrics(om.text))
    raw = httpx.get(server.url + "/metrics", headers={"Accept-Encoding": "gzip"}).read()
    zipped = httpx.Client().send(
        httpx.Request("GET", server.url + "/metrics", headers={"Accept-Encoding": "gzip"}), stream=True
    )
    body = b"".join(zipped.iter_raw())
    assert zipped.headers["content-encoding"] == "gzip"
    assert gzip.decompress(body).startswith(b"# HELP")
    assert raw.startswith(b"# HELP")


def test_concurrent_scrapers_of_one_snapshot_cost_one_render(live_server):
    server = live_server("healthy", poll={"fast_interval": 5.0, "slow_interval": 10.0, "call_deadline": 1.0})
    time.sleep(0.3)
    before = server.renderer.renders
    snapshot_id = server.pipeline.snapshot.id
    bodies: list[bytes] = []

    def scrape() -> None:
        bodies.append(httpx.get(server.url + "/metrics", timeout=10).content)

    threads = [threading.Thread(target=scrape) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(bodies) == 16 and len(set(bodies)) == 1
    if server.pipeline.snapshot.id == snapshot_id:
        assert server.renderer.renders - before == 1


def test_healthz_and_readyz(live_server):
    server = live_server("healthy")
    assert server.get("/healthz").json() == {"status": "ok"}
    ready = server.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_readyz_fails_with_the_reason_when_the_driver_is_not_loaded(live_server):
    server = live_server("driver-not-loaded")
    ready = server.get("/readyz")
    assert ready.status_code == 503
    assert "driver_not_loaded" in ready.json()["error"]
    assert server.get("/healthz").status_code == 200  # alive: do not restart it
    assert values(parse_exposition(server.get("/metrics").text), "gpuwarden_nvml_up") == [0]


def test_gpu_api_lists_every_gpu_with_units_and_ages(live_server):
    server = live_server("healthy")
    body = server.get("/api/v1/gpus").json()
    assert body["nvml_up"] is True and body["driver"]["driver_version"] == "580.159.04"
    assert [gpu["index"] for gpu in body["gpus"]] == list(range(8))
    gpu = body["gpus"][0]
    assert gpu["info"]["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["metrics"]["temperature_celsius"]["unit"] == "celsius"
    assert gpu["metrics"]["memory_total_bytes"]["values"][0]["value"] == 85_520_809_984
    assert gpu["sample_age_seconds"]["fast"] < 5
    by_uuid = server.get(f"/api/v1/gpus/{gpu['uuid']}").json()
    by_index = server.get("/api/v1/gpus/0").json()
    assert by_uuid["uuid"] == by_index["uuid"] == gpu["uuid"]


def test_unknown_gpu_is_404_json_and_bad_parameter_is_422_json(live_server):
    server = live_server("healthy")
    missing = server.get("/api/v1/gpus/9")
    assert missing.status_code == 404 and "no GPU '9'" in missing.json()["error"]
    missing_uuid = server.get("/api/v1/gpus/GPU-00000000-0000-0000-0000-000000000000")
    assert missing_uuid.status_code == 404
    bad = server.get("/api/v1/gpus/..%2Fetc")
    assert bad.status_code in (404, 422)
    bad = server.get("/api/v1/gpus/not-a-gpu")
    assert bad.status_code == 422 and "invalid path.gpu" in bad.json()["error"]
    nowhere = server.get("/api/v1/nothing")
    assert nowhere.status_code == 404 and nowhere.json() == {"error": "Not Found"}


def test_topology_matrix_reads_like_nvidia_smi(live_server):
    server = live_server({"name": "link-7-down", "faults": [{"kind": "nvlink_down", "gpu": 4, "link": 7}]})
    time.sleep(1.5)  # one slow poll for the link states
    body = server.get("/api/v1/topology").json()
    assert body["gpus"] == list(range(8))
    assert body["matrix"]["0"]["0"] == "X"
    assert body["matrix"]["0"]["1"] == "NV18"
    assert body["matrix"]["4"]["0"] == "NV17" and body["matrix"]["0"]["4"] == "NV17"
    second = live_server("legacy-pcie")
    # the topology is probed after discovery: a loaded machine may publish a first snapshot without it
    wait_for(lambda: second.get("/api/v1/topology").json()["matrix"], timeout=10, step=0.2)
    legacy = second.get("/api/v1/topology").json()
    assert legacy["matrix"] == {"0": {"0": "X", "1": "PHB"}, "1": {"1": "X", "0": "PHB"}}


def test_landing_page_and_openapi(live_server):
    server = live_server("healthy")
    page = server.get("/")
    assert page.status_code == 200 and "gpuwarden" in page.text and "8 of 8 GPU(s)" in page.text
    schema = server.get("/openapi.json").json()
    assert {"/api/v1/gpus", "/api/v1/gpus/{gpu}", "/api/v1/topology", "/readyz"} <= set(schema["paths"])
    assert server.get("/docs").status_code == 200


def test_custom_telemetry_path(live_server):
    server = live_server("healthy", web={"telemetry_path": "/gpu-metrics"})
    assert server.get("/gpu-metrics").status_code == 200
    assert server.get("/metrics").status_code == 404


def test_daemon_starts_serves_and_stops_gracefully_on_sigterm():
    exporter = start_daemon(
        "--sim", "--nvml.scenario", "healthy", "--log.format", "json",
        env={"GPUWARDEN_POLL_FAST_INTERVAL": "0.2"}, ready="/readyz",
    )  # fmt: skip
    try:
        exporter.proc.send_signal(signal.SIGTERM)
        assert exporter.proc.wait(timeout=10) == 0
    finally:
        exporter.stop()
    logs = exporter.output()
    assert "Traceback" not in logs
    assert '"level": "info"' in logs and "listening on" in logs
    assert "backend sim, scenario healthy" in logs  # the simulator's start says which node it simulates


def test_oversized_headers_are_refused_and_the_server_stays_up(live_server):
    server = live_server("healthy")
    big = server.get("/metrics", headers={"X-Big": "a" * 100_000})
    assert big.status_code == 431 and "exceed" in big.json()["error"]
    assert server.get("/healthz").status_code == 200
    assert server.get("/api/v1/gpus", headers={"X-Small": "a" * 1000}).status_code == 200
