"""What the serving process loads: the real CLI (the real NVML backend, which finds no GPU on the build machine and
stays up), asked for /metrics, /healthz and /readyz, must not have imported the libraries kept out of it for its
footprint (docs/benchmarks.md, Footprint) — and the JSON API, once asked, loads them and answers.
Seen through `python -X importtime`, which lists every module the process imports, as it imports it."""

from __future__ import annotations

import httpx

from tests.helpers.stack import running_cli

KEPT_OUT = {
    "pydantic": "settings are exporter/typedconfig.py dataclasses",
    "uvicorn": "the server is exporter/httpserver.py",
    "prometheus_client": "the exposition is exporter/exposition.py",
    "fastapi": "the JSON API loads on its first request",
    "starlette": "the JSON API loads on its first request",
    "anyio": "the front uses asyncio's executor",
    "yaml": "read only where a file is given",
    "statistics": "0.6 MiB for one median",
    "importlib.metadata": "the binding's version comes from its dist-info folder name",
    "grpc": "the pod-resources client loads only where the kubelet socket exists",
}


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_scrapes_and_probes_load_none_of_the_libraries_kept_out_and_the_api_loads_them_when_asked():
    with running_cli(python_flags=("-X", "importtime")) as (url, proc):
        metrics = httpx.get(url + "/metrics")
        assert metrics.status_code == 200 and b"gpuwarden_build_info" in metrics.content
        assert httpx.get(url + "/readyz").status_code == 503  # no GPU here: not ready, and says so
    loaded = _imported(proc.stderr.read())
    assert "exporter.httpserver" in loaded and "exporter.exposition" in loaded, "the listing itself is broken"
    offenders = {name: why for name, why in KEPT_OUT.items() if name in loaded}
    assert not offenders, offenders


def test_the_api_loads_fastapi_on_its_first_request_and_answers():
    with running_cli(python_flags=("-X", "importtime")) as (url, proc):
        answer = httpx.get(url + "/api/v1/gpus", timeout=30)
        assert answer.status_code == 200 and answer.json()["nvml_up"] is False
    assert {"fastapi", "pydantic"} <= _imported(proc.stderr.read())
