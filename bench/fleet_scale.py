"""The fleet service over a large synthetic fleet, on Prometheus and on VictoriaMetrics, side by side in one run.

Usage: python3 bench/fleet_scale.py --nodes 10000 [--backends prometheus,victoriametrics] [--runs 3]
       [--hours 6] [--ahead 120] [--json OUT.json] [--work DIR]

The fleet (tests/helpers/synthetic_fleet.py): N nodes × 8 GPUs, ~385 series per node in the families the fleet
queries and the critical rules read, 6 h of history for the families read over windows, the recording rules'
series as the shipped rules evaluate them. Both backends are Debian's packages at their default flags:
- Prometheus 2.42: backfilled with `promtool tsdb create-blocks-from openmetrics`;
- VictoriaMetrics 1.79.5: the same samples through its import API (`/api/v1/import/prometheus`).
The fleet service runs at its defaults (query timeout 5 s, 4 queries in flight, cache TTL 15 s). For every
endpoint and run, a fresh fleet process answers a first request (cold: nothing cached, the backend's own caches
warmed by one untimed page view) and a second one (warm). A burst of every endpoint at once on a fresh process
checks that nothing fails under the default limits. The answers are reduced to what they say (nodes, unhealthy
GPUs and checks, cordon findings, idle and starved GPUs, hours) and compared between backends and against the
generator's ground truth; the recorded series are compared with the shipped rules' own expressions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwarden.fleet import recording  # noqa: E402
from tests.helpers.common import free_port  # noqa: E402
from tests.helpers.stack import wait_ready  # noqa: E402
from tests.helpers.synthetic_fleet import Fleet  # noqa: E402
from tests.helpers.tsdb_backends import Prometheus, VictoriaMetrics, instant  # noqa: E402

ENDPOINTS: list[tuple[str, dict[str, str]]] = [
    ("/api/v1/fleet", {}),
    ("/api/v1/fleet/health", {}),
    ("/api/v1/fleet/cordon-candidates", {}),
    ("/api/v1/fleet/utilization", {"window": "1h"}),
    ("/api/v1/plan", {"parameters": "7e9"}),
    ("/", {}),
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# -- the fleet service ---------------------------------------------------------------------------------------------


class FleetService:
    def __init__(self, backend_url: str, *extra: str) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwarden", "fleet", "--prometheus-url", backend_url, "--node-label", "node",
             "--web.listen-address", f"127.0.0.1:{self.port}", *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_ready(f"http://127.0.0.1:{self.port}/healthz", timeout=60)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def get(self, path: str, params: dict[str, str]) -> tuple[float, httpx.Response]:
        t0 = time.perf_counter()
        response = self.client.get(path, params=params)
        return time.perf_counter() - t0, response

    def close(self) -> float:
        rss = rss_mib(self.proc.pid)
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)
        return rss


def time_endpoints(backend_url: str, runs: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Cold and warm times of every endpoint (a fresh fleet process for each run), and the last answers."""
    warmup = FleetService(backend_url, "--query-timeout", "60")
    for path, params in ENDPOINTS:  # the backend loads its index lazily: one untimed pass
        warmup.get(path, params)
    warmup.close()
    timings: dict[str, Any] = {}
    answers: dict[str, Any] = {}
    fleet_rss = []
    for path, params in ENDPOINTS:
        cold, warm, statuses = [], [], []
        for _ in range(runs):
            service = FleetService(backend_url)
            seconds, response = service.get(path, params)
            cold.append(seconds)
            statuses.append(response.status_code)
            seconds, again = service.get(path, params)
            warm.append(seconds)
            statuses.append(again.status_code)
            fleet_rss.append(service.close())
            if response.status_code == 200:
                answers[path] = response.json() if path != "/" else {"html_bytes": len(response.content)}
            else:
                answers[path] = {"error": response.status_code, "detail": response.text[:400]}
        timings[path] = {
            "cold_median_s": round(statistics.median(cold), 3),
            "cold_max_s": round(max(cold), 3),
            "warm_median_s": round(statistics.median(warm), 4),
            "warm_max_s": round(max(warm), 4),
            "statuses": sorted(set(statuses)),
            "answer_bytes": len(response.content),
        }
        print(" ", path, timings[path], flush=True)
    timings["fleet_rss_mib_max"] = max(fleet_rss)
    return timings, answers


def burst(backend_url: str) -> dict[str, Any]:
    """Every endpoint at once, twice over, on a fresh fleet service at its defaults: what fails, how long."""
    service = FleetService(backend_url)
    results: list[tuple[str, int, float]] = []

    def one(path: str, params: dict[str, str]) -> None:
        seconds, response = service.get(path, params)
        results.append((path, response.status_code, seconds))

    threads = [threading.Thread(target=one, args=e) for e in ENDPOINTS * 2]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    service.close()
    return {
        "requests": len(results),
        "failed": [r for r in results if r[1] != 200],
        "slowest_s": round(max(r[2] for r in results), 3),
        "wall_s": round(wall, 3),
    }


def screenshot(backend_url: str, path: Path, work: Path) -> None:
    """The page as a reader sees it: a fleet service at its defaults, its page computed once, then Chromium."""
    from tests.helpers.browser import CHROMIUM_FLAGS, chromium

    service = FleetService(backend_url)
    service.get("/", {})
    subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={work / 'chromium'}", "--window-size=1400,2600",
         f"--screenshot={path}", f"http://127.0.0.1:{service.port}/"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    service.close()


def recorded_vs_rules(backend_url: str, at: float) -> dict[str, Any]:
    """Each recorded series' count and sum at one instant, against the shipped rule's own expression there."""
    out = {}
    for rule in recording.rules():
        got: list[tuple[Any, Any]] = []
        static = "".join(f',{k}="{v}"' for k, v in rule.get("labels", {}).items())
        for expr in (f'{rule["record"]}{{job="gpuwarden"{static}}}', rule["expr"]):
            count = instant(backend_url, f"count({expr}) or vector(0)", at)
            total = instant(backend_url, f"sum({expr}) or vector(0)", at)
            try:
                got.append(
                    (float(count["data"]["result"][0]["value"][1]), float(total["data"]["result"][0]["value"][1]))
                )
            except (KeyError, IndexError):
                got.append(("error", count.get("error") or total.get("error")))
        key = rule["record"] + static
        out[key] = {"recorded": got[0], "rule": got[1], "equal": _close(got[0], got[1])}
    return out


def _close(a: tuple, b: tuple) -> bool:
    return all(
        isinstance(x, float) and isinstance(y, float) and abs(x - y) <= 1e-6 * max(1, abs(y))
        for x, y in zip(a, b, strict=True)
    )


def reduce(answers: dict[str, Any]) -> dict[str, Any]:
    """What each answer says, without the instants and ages that differ between two runs."""
    inventory = answers.get("/api/v1/fleet", {})
    health = answers.get("/api/v1/fleet/health", {})
    cordon = answers.get("/api/v1/fleet/cordon-candidates", {})
    usage = answers.get("/api/v1/fleet/utilization", {})
    plan = answers.get("/api/v1/plan", {})
    return {
        "inventory": {k: inventory.get("totals", {}).get(k)
                      for k in ("nodes", "gpus", "models", "driver_versions", "exporter_versions")}
        | {"stale": len(inventory.get("stale_exporters", []))},
        "health": sorted(
            f"{g['node']}/{g['gpu']}/{c['check']}={c['level']}"
            for g in health.get("unhealthy_gpus", []) for c in g["checks"]
        ),
        "cordon": sorted(
            f"{n['node']}/{f['alert']}/{f['labels'].get('gpu', '')}"
            for n in cordon.get("candidates", []) for f in n["findings"]
        ),
        "utilization": {
            "totals": usage.get("totals"),
            "source": (usage.get("source") or "")[:30],
            "namespaces": sorted(
                (n["namespace"], n.get("allocated_gpu_hours"), n.get("wasted_gpu_hours"))
                for n in usage.get("by_namespace", [])
            ),
        },
        "bottlenecks": {
            "gpus_by_class": (usage.get("bottlenecks") or {}).get("gpus_by_class"),
            "wasted_gpu_hours_by_class": (usage.get("bottlenecks") or {}).get("wasted_gpu_hours_by_class"),
        },
        "plan_fits": sorted(f["model"] for f in plan.get("fleet") or [] if f.get("fits")),
    }  # fmt: skip


def truth_check(reduced: dict[str, Any], fleet: Fleet) -> dict[str, Any]:
    truth = fleet.truth()
    totals = reduced["utilization"]["totals"] or {}
    hardware_cordon = {entry.split("/")[0] + "/" + entry.split("/")[2] for entry in reduced["cordon"]}
    return {
        "nodes": reduced["inventory"]["nodes"] == fleet.nodes,
        "gpus": reduced["inventory"]["gpus"] == truth["gpus"],
        "idle_gpus": totals.get("idle_gpus") == truth["idle_gpus"],
        "starved_gpus": totals.get("starved_gpus") == truth["starved_gpus"],
        "hardware_gpus_in_cordon": len(hardware_cordon) == truth["hardware_gpus"],
        "unhealthy_gpus": len({"/".join(h.split("/")[:2]) for h in reduced["health"]})
        == truth["hardware_gpus"] + truth["unhealthy_gpus"] + truth["starved_gpus"] - truth["hardware_gpus"],
        "gpus_by_class": reduced["bottlenecks"]["gpus_by_class"]
        == {k: v for k, v in truth["gpus_by_class"].items() if v},
        "no_stale_exporters": reduced["inventory"]["stale"] == 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=6)
    parser.add_argument("--ahead", type=int, default=120, help="minutes of data past the start")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="prometheus,victoriametrics")
    parser.add_argument("--work")
    parser.add_argument("--json")
    parser.add_argument("--load-only", action="store_true", help="load the backends into --work and keep them")
    parser.add_argument("--reuse", action="store_true", help="time the backends --load-only left in --work")
    parser.add_argument("--add-recorded", help="recorded series (names, comma-separated) to add before timing")
    parser.add_argument("--screenshot", help="a PNG of the overview page from the first backend (headless Chromium)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="fleet-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    state = work / "state.json"
    if args.reuse:
        kept = json.loads(state.read_text())
        fleet = Fleet(**kept["fleet"])
        args.nodes = fleet.nodes
    else:
        fleet = Fleet(nodes=args.nodes, now=int(time.time()), hours=args.hours, ahead_minutes=args.ahead)
        kept = {"fleet": {"nodes": fleet.nodes, "now": fleet.now, "hours": fleet.hours,
                          "ahead_minutes": fleet.ahead_minutes}, "loads": {}}  # fmt: skip
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus_per_node": 8,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {memory_gib} GiB",
        "history": {"range_read_hours": fleet.hours, "range_step_s": fleet.range_step,
                    "instant_minutes": fleet.instant_minutes, "instant_step_s": fleet.instant_step,
                    "recorded_minutes": fleet.recorded_minutes, "ahead_minutes": fleet.ahead_minutes},
        "truth": fleet.truth(),
    }  # fmt: skip
    reduced: dict[str, Any] = {}
    for name in args.backends.split(","):
        backend = {"prometheus": Prometheus, "victoriametrics": VictoriaMetrics}[name](work)
        entry: dict[str, Any] = {}
        result[name] = entry
        try:
            if args.reuse:
                entry.update(kept["loads"][name])
                if args.add_recorded:
                    entry["added"] = backend.add(fleet, set(args.add_recorded.split(",")))
                    backend.start()
                    entry["added"]["compaction_seconds"] = backend.wait_compacted()
                    backend.stop(keep=True)
                    print(f"{name}: added {entry['added']}", flush=True)
            else:
                print(f"{name}: loading {args.nodes} nodes", flush=True)
                entry.update(backend.load(fleet))
                kept["loads"][name] = dict(entry)
                state.write_text(json.dumps(kept))
                print(f"{name}: loaded {entry}", flush=True)
                if args.load_only:
                    backend.stop(keep=True)
                    continue
            backend.start()
            entry["endpoints"], answers = time_endpoints(backend.url, args.runs)
            entry["burst_at_defaults"] = burst(backend.url)
            if args.screenshot:
                screenshot(backend.url, Path(args.screenshot), work)
                args.screenshot = None
            print(f"{name}: burst {entry['burst_at_defaults']}", flush=True)
            # an instant of the recorded series' own grid (they are written every 60 s from the fleet's start)
            at = fleet.now + (int(time.time() - 120 - fleet.now) // 60) * 60
            entry["recorded_vs_rules"] = recorded_vs_rules(backend.url, float(at))
            entry["backend_rss_mib"] = rss_mib(backend.proc.pid) if backend.proc else None
            reduced[name] = reduce(answers)
            entry["answers"] = {
                "health_checks": len(reduced[name]["health"]),
                "cordon_findings": len(reduced[name]["cordon"]),
                "utilization_totals": reduced[name]["utilization"]["totals"],
                "utilization_source": reduced[name]["utilization"]["source"],
                "page_html_bytes": answers.get("/", {}).get("html_bytes"),
            }
            entry["matches_ground_truth"] = truth_check(reduced[name], fleet)
        finally:
            backend.stop(keep=args.load_only or args.reuse)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    if len(reduced) == 2:
        a, b = reduced.values()
        result["backends_agree"] = {key: a[key] == b[key] for key in a}
        result["backends_differ_in"] = {
            key: {"prometheus": str(a[key])[:300], "victoriametrics": str(b[key])[:300]}
            for key in a
            if a[key] != b[key]
        }
    print(json.dumps({k: v for k, v in result.items() if k not in ("prometheus", "victoriametrics")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
