"""How long the fleet endpoints take over a large fleet: synthetic history for N nodes x 8 GPUs, backfilled into a
real Prometheus with `promtool tsdb create-blocks-from openmetrics`, asked by `gpuwarden fleet` over HTTP.

Usage: python3 bench/fleet_scale.py --nodes 1000 --hours 2 --step 60 --json OUT.json [--work DIR]

The history holds the series the fleet queries, with the labels a real scrape gives them (job, instance, node):
per node up, build/driver info, nvml_up, gpus, last-collect timestamps; per GPU gpu_info, memory, the
utilization counters, processes, 13 health checks, gpu_up, ECC, remap, recovery action, 18 NVLink links, and a
pod allocation. About 2 % of GPUs are unhealthy, 0.5 % have hardware findings, 5 % are idle and 5 % starved.
Samples run from `--hours` ago to 30 minutes ahead, so "now" stays inside the data while the benchmark runs.
Every request is timed cold (the fleet's cache is off) and warm (a second request within the cache TTL).
With --recording, the shipped recording rules (alert_rules/gpuwarden.recording.yaml) are backfilled over the history
with `promtool tsdb create-blocks-from rules`, and the utilization endpoint and the page are timed twice in the
same run: reading the recorded series, and with `--recording-rules off` (the raw path), with both answers compared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwarden.health.checks import CHECKS  # noqa: E402
from tests.helpers.stack import wait_ready  # noqa: E402

GPUS = 8
LINKS = 18
MEMORY = 85520809984


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(path: Path, nodes: int, start: int, end: int, step: int, seed: int = 7) -> dict[str, int]:
    rng = random.Random(seed)
    times = list(range(start, end + 1, step))
    gpus = [(n, g) for n in range(nodes) for g in range(GPUS)]
    kind: dict[tuple[int, int], str] = {}
    for key in gpus:
        roll = rng.random()
        kind[key] = (
            "hardware"
            if roll < 0.005
            else "unhealthy"
            if roll < 0.025
            else "idle"
            if roll < 0.075
            else "starved"
            if roll < 0.125
            else "busy"
        )
    hw_kinds = ["ecc", "nvlink", "lost", "remap"]
    hardware = {key: hw_kinds[i % 4] for i, key in enumerate(k for k in gpus if kind[k] == "hardware")}
    series = 0
    lines = 0

    def labels(n: int, g: int | None = None, **extra: str) -> str:
        parts = [f'job="gpuwarden",instance="node-{n:04d}:10045",node="node-{n:04d}"']
        if g is not None:
            parts.append(f'gpu="{g}",uuid="GPU-{n:04d}-{g}"')
        parts += [f'{k}="{v}"' for k, v in extra.items()]
        return "{" + ",".join(parts) + "}"

    with path.open("w", buffering=1 << 22) as out:

        def family(name: str, type_: str, rows: list[tuple[str, object]]) -> None:
            """rows: (sample name + labels, value or callable(t) → value)."""
            nonlocal series, lines
            out.write(f"# TYPE {name} {type_}\n")
            for head, value in rows:
                series += 1
                if callable(value):
                    out.write("".join(f"{head} {value(t)} {t}\n" for t in times))
                else:
                    out.write("".join(f"{head} {value} {t}\n" for t in times))
                lines += len(times)

        node_ids = range(nodes)
        family("up", "gauge", [(f"up{labels(n)}", 1) for n in node_ids])
        family(
            "gpuwarden_build_info",
            "gauge",
            [
                (f"gpuwarden_build_info{labels(n, version='0.1.0', nvml_python_version='13.580.82')}", 1)
                for n in node_ids
            ],
        )

        def driver(n: int) -> str:
            return labels(
                n,
                driver_version="580.159.04" if n % 10 else "570.172.08",
                cuda_driver_version="13.0",
                nvml_version="13.580.159.04",
            )

        family("gpuwarden_driver_info", "gauge", [(f"gpuwarden_driver_info{driver(n)}", 1) for n in node_ids])
        family("gpuwarden_nvml_up", "gauge", [(f"gpuwarden_nvml_up{labels(n)}", 1) for n in node_ids])
        family("gpuwarden_gpus", "gauge", [(f"gpuwarden_gpus{labels(n)}", GPUS) for n in node_ids])
        family(
            "gpuwarden_last_collect_timestamp_seconds",
            "gauge",
            [
                (f"gpuwarden_last_collect_timestamp_seconds{labels(n, tier=tier)}", lambda t: t - 1)
                for n in node_ids
                for tier in ("fast", "slow")
            ],
        )

        def identity(n: int, g: int) -> str:
            return labels(
                n,
                g,
                name="NVIDIA H100 80GB HBM3" if n % 4 else "NVIDIA H200",
                serial=f"{n}{g}",
                pci_bus_id=f"00000000:{g:02X}:00.0",
                vbios_version="96.00.99.00.01",
                compute_capability="9.0",
            )

        family("gpuwarden_gpu_info", "gauge", [(f"gpuwarden_gpu_info{identity(n, g)}", 1) for n, g in gpus])
        family(
            "gpuwarden_memory_total_bytes",
            "gauge",
            [(f"gpuwarden_memory_total_bytes{labels(n, g)}", MEMORY if n % 4 else 150754820096) for n, g in gpus],
        )
        duty = {"idle": 0.0, "starved": 0.25, "busy": 0.93, "unhealthy": 0.6, "hardware": 0.0}

        def busy_counter(d: float):
            return lambda t: f"{(t - start) * d:.1f}"

        family(
            "gpuwarden_busy_seconds",
            "counter",
            [(f"gpuwarden_busy_seconds_total{labels(n, g)}", busy_counter(duty[kind[(n, g)]])) for n, g in gpus],
        )
        family(
            "gpuwarden_utilization_sampled_seconds",
            "counter",
            [
                (f"gpuwarden_utilization_sampled_seconds_total{labels(n, g)}", lambda t: f"{t - start:.1f}")
                for n, g in gpus
            ],
        )
        family(
            "gpuwarden_processes",
            "gauge",
            [(f"gpuwarden_processes{labels(n, g)}", 0 if kind[(n, g)] == "idle" else 1) for n, g in gpus],
        )

        def health(n: int, g: int, check: str) -> int:
            k = kind[(n, g)]
            if k == "hardware":
                return (
                    2
                    if check
                    in {"ecc": "ecc", "nvlink": "nvlink", "lost": "gpu_lost", "remap": "row_remap"}[hardware[(n, g)]]
                    else 0
                )
            if k == "unhealthy":
                return 1 if check == ("temperature", "power", "pcie")[g % 3] else 0
            if k == "starved":
                return 1 if check == "utilization" else 0
            return 0

        family(
            "gpuwarden_health",
            "gauge",
            [(f"gpuwarden_health{labels(n, g, check=c)}", health(n, g, c)) for n, g in gpus for c in CHECKS],
        )
        family(
            "gpuwarden_health_since_timestamp_seconds",
            "gauge",
            [
                (f"gpuwarden_health_since_timestamp_seconds{labels(n, g, check=c)}", start + 600)
                for n, g in gpus
                for c in CHECKS
                if health(n, g, c)
            ],
        )
        family(
            "gpuwarden_gpu_up",
            "gauge",
            [(f"gpuwarden_gpu_up{labels(n, g)}", 0 if hardware.get((n, g)) == "lost" else 1) for n, g in gpus],
        )
        family(
            "gpuwarden_ecc_errors",
            "counter",
            [
                (
                    f"gpuwarden_ecc_errors_total{labels(n, g, type=t)}",
                    3 if t == "uncorrected" and hardware.get((n, g)) == "ecc" else 0,
                )
                for n, g in gpus
                for t in ("corrected", "uncorrected")
            ],
        )
        family(
            "gpuwarden_remapped_rows_failed",
            "gauge",
            [
                (f"gpuwarden_remapped_rows_failed{labels(n, g)}", 1 if hardware.get((n, g)) == "remap" else 0)
                for n, g in gpus
            ],
        )
        family(
            "gpuwarden_remapped_rows_pending",
            "gauge",
            [(f"gpuwarden_remapped_rows_pending{labels(n, g)}", 0) for n, g in gpus],
        )
        family("gpuwarden_recovery_action", "gauge", [(f"gpuwarden_recovery_action{labels(n, g)}", 0) for n, g in gpus])
        half = start + (end - start) // 2

        def link_state(n: int, g: int, link: int):
            if hardware.get((n, g)) == "nvlink" and link == 7:
                return lambda t: 1 if t < half else 0
            return 1

        family(
            "gpuwarden_nvlink_up",
            "gauge",
            [
                (f"gpuwarden_nvlink_up{labels(n, g, link=str(link))}", link_state(n, g, link))
                for n, g in gpus
                for link in range(LINKS)
            ],
        )

        def pod(n: int, g: int) -> str:
            return labels(n, g, namespace=f"team-{n % 50:02d}", pod=f"job-{n}", container="main")

        family(
            "gpuwarden_gpu_allocation",
            "gauge",
            [(f"gpuwarden_gpu_allocation{pod(n, g)}", 1) for n, g in gpus if kind[(n, g)] != "idle"],
        )
        out.write("# EOF\n")
    return {
        "series": series,
        "samples": lines,
        "gpus": len(gpus),
        "hardware_gpus": len(hardware),
        "unhealthy_gpus": sum(1 for k in kind.values() if k == "unhealthy"),
        "idle_gpus": sum(1 for k in kind.values() if k == "idle"),
        "starved_gpus": sum(1 for k in kind.values() if k == "starved"),
    }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=2)
    parser.add_argument("--step", type=int, default=60)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--work")
    parser.add_argument("--json")
    parser.add_argument("--recording", action="store_true", help="also time the recording-rules path, side by side")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="fleet-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    now = int(time.time())
    start, end = now - int(args.hours * 3600), now + 1800
    result: dict[str, object] = {
        "nodes": args.nodes,
        "gpus_per_node": GPUS,
        "history_hours": args.hours,
        "step_seconds": args.step,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    data = work / "history.om"
    began = time.monotonic()
    result["data"] = generate(data, args.nodes, start, end, args.step)
    result["generate_seconds"] = round(time.monotonic() - began, 1)
    result["openmetrics_bytes"] = data.stat().st_size
    blocks = work / "tsdb"
    shutil.rmtree(blocks, ignore_errors=True)
    began = time.monotonic()
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=24h", str(data), str(blocks)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    result["backfill_seconds"] = round(time.monotonic() - began, 1)
    data.unlink()
    prom_port, fleet_port = free_port(), free_port()
    (work / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={blocks}",
            "--storage.tsdb.retention.time=30d",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--query.timeout=60s",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    fleet = raw_fleet = None
    try:
        wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", timeout=300)
        if args.recording:
            prometheus = backfill_recording(work, blocks, prom_port, start, now, prometheus, result)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
        fleet = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuwarden",
                "fleet",
                "--prometheus-url",
                f"http://127.0.0.1:{prom_port}",
                "--node-label",
                "node",
                "--web.listen-address",
                f"127.0.0.1:{fleet_port}",
                "--cache-ttl",
                "5",
                "--query-timeout",
                "30",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_ready(f"http://127.0.0.1:{fleet_port}/healthz", timeout=60)
        raw_port = free_port()
        if args.recording:  # the same fleet service on the raw series, for the side-by-side
            raw_fleet = subprocess.Popen(
                [*fleet.args[: fleet.args.index("--web.listen-address")], "--web.listen-address",
                 f"127.0.0.1:{raw_port}", "--cache-ttl", "5", "--query-timeout", "30", "--recording-rules", "off"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            wait_ready(f"http://127.0.0.1:{raw_port}/healthz", timeout=60)
        endpoints = {
            "/api/v1/fleet": {},
            "/api/v1/fleet/health": {},
            "/api/v1/fleet/cordon-candidates": {},
            "/api/v1/fleet/utilization": {"window": "1h"},
            "/api/v1/plan": {"parameters": "7e9"},
            "/": {},
        }
        timings: dict[str, dict[str, object]] = {}
        client = httpx.Client(base_url=f"http://127.0.0.1:{fleet_port}", timeout=120)
        client.get("/api/v1/fleet")  # Prometheus loads the blocks' index lazily: one warm-up request, not timed
        for path, params in endpoints.items():
            cold, warm = [], []
            for _ in range(args.runs):
                time.sleep(5.2)  # past the cache TTL (and its quantized evaluation time): a cold answer
                t0 = time.perf_counter()
                response = client.get(path, params=params)
                cold.append(time.perf_counter() - t0)
                assert response.status_code == 200, (path, response.status_code, response.text[:300])
                t0 = time.perf_counter()
                client.get(path, params=params)
                warm.append(time.perf_counter() - t0)
            body = response.json() if path != "/" else {}
            timings[path] = {
                "cold_median_s": round(statistics.median(cold), 3),
                "cold_max_s": round(max(cold), 3),
                "warm_median_s": round(statistics.median(warm), 4),
                "answer_bytes": len(response.content),
                "summary": summarize(path, body),
            }
            print(path, timings[path], flush=True)
        result["endpoints"] = timings
        if args.recording:
            result["raw_path"] = side_by_side(raw_port, client, args.runs)
        result["prometheus_rss_mib"] = round(rss_mib(prometheus.pid), 1)
        result["fleet_rss_mib"] = round(rss_mib(fleet.pid), 1)
    finally:
        for proc in (raw_fleet, fleet, prometheus):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def backfill_recording(work: Path, blocks: Path, port: int, start: int, now: int, prometheus, result: dict):  # noqa: ANN001, ANN201
    """The recording rules evaluated over the history (every 60 s, as shipped) into blocks, then Prometheus restarted
    on raw and recorded blocks together."""
    from gpuwarden.fleet import recording

    rules = work / "recording.yaml"
    rules.write_text(recording.to_yaml())
    out = work / "rules-blocks"
    shutil.rmtree(out, ignore_errors=True)
    began = time.monotonic()
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "rules", f"--start={start + 300}", f"--end={now}",
         f"--url=http://127.0.0.1:{port}", f"--output-dir={out}", "--quiet", str(rules)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    result["recording_backfill_seconds"] = round(time.monotonic() - began, 1)
    command = prometheus.args
    prometheus.terminate()
    prometheus.wait(60)
    for block in out.iterdir():
        if block.is_dir():
            shutil.move(str(block), blocks / block.name)
    restarted = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/-/ready", timeout=300)
    return restarted


def side_by_side(raw_port: int, recorded: httpx.Client, runs: int) -> dict[str, object]:
    """The utilization endpoint and the page on the raw series, timed like the rest; and the two answers compared."""
    raw = httpx.Client(base_url=f"http://127.0.0.1:{raw_port}", timeout=120)
    out: dict[str, object] = {}
    for path, params in (("/api/v1/fleet/utilization", {"window": "1h"}), ("/", {})):
        cold = []
        for _ in range(runs):
            time.sleep(5.2)
            t0 = time.perf_counter()
            response = raw.get(path, params=params)
            cold.append(time.perf_counter() - t0)
            assert response.status_code == 200, (path, response.status_code, response.text[:300])
        out[path] = {"cold_median_s": round(statistics.median(cold), 3), "cold_max_s": round(max(cold), 3)}
    want = raw.get("/api/v1/fleet/utilization", params={"window": "1h", "limit": 1000}).json()
    got = recorded.get("/api/v1/fleet/utilization", params={"window": "1h", "limit": 1000}).json()
    out["source_recorded"] = got["source"][:40]
    out["totals_raw"] = want["totals"]
    out["totals_recorded"] = got["totals"]
    print("raw path", out, flush=True)
    return out


def summarize(path: str, body: dict) -> dict[str, object]:
    if path == "/api/v1/fleet":
        return {"nodes": body["totals"]["nodes"], "gpus": body["totals"]["gpus"]}
    if path == "/api/v1/fleet/health":
        return {"unhealthy_gpus": len(body["unhealthy_gpus"]), **body["counts"]}
    if path == "/api/v1/fleet/cordon-candidates":
        return {"candidate_nodes": len(body["candidates"])}
    if path == "/api/v1/fleet/utilization":
        return {k: body["totals"][k] for k in ("idle_gpus", "starved_gpus", "wasted_gpu_hours")}
    if path == "/api/v1/plan":
        return {"fits": [f["model"] for f in body["fleet"] if f["fits"]]}
    return {}


if __name__ == "__main__":
    raise SystemExit(main())
