"""What gpuwarden's rules cost the cluster's Prometheus (and VictoriaMetrics behind vmalert), per rule and per group,
at 100 and 1,000 nodes of 8 GPUs, extrapolated to 10,000.

Usage: python3 bench/rules_cost.py [--nodes 100,1000] [--backends prometheus,victoriametrics] [--repeat 5]
       [--json OUT.json] [--work DIR]

The fleet: one real scrape of the simulator's default node (`gpuwarden --sim`, 8x H100, the exporter's defaults),
cut to the families the shipped rules read, plus one `gpuwarden_gpu_allocation` and one `gpuwarden_bottleneck_info`
per GPU (pod attribution on, GPM's window past), copied to N nodes with their own instance, node and UUIDs, and laid
out every 15 s (the chart's scrape interval): 24 h for the families the day-long windows read, 40 min for the rest
(the longest other window is 30 m), to the instant evaluated and 30 min past it (the loaders' checks and the live
evaluation below read at "now"). Counters grow as on a busy GPU (sampled 1 s/s, busy 0.9 s/s); gauges hold. The
alert rules' own records (group gpuwarden-history) are laid out as that group writes them, every 10 m over the day.

Each rule of alert_rules/gpuwarden.rules.yaml and alert_rules/gpuwarden.recording.yaml is evaluated alone, as the
rule evaluator would, as an instant query at the end of the data, `--repeat` times: the backend's CPU (utime + stime
of its process, from /proc) and the wall time per evaluation, the median of the repeats; on Prometheus also the
samples the query touched and the most it held at once (`stats=all`). A group's time is the sum of its rules' (a
group evaluates its rules one after another); CPU per minute is each rule's CPU times its evaluations a minute (a
group's `interval`, else the 60 s global default: kube-prometheus-stack's 30 s doubles it).
VictoriaMetrics runs with `-search.disableCache` (every evaluation computed, as vmalert's would be the first time).
`--compare REV` measures that revision's rule files too, on the same loaded data. Then the real evaluator runs both
files for `--live-minutes`: Prometheus' own rule manager (its appends fail as out of bounds, the backfilled blocks
reaching past now: the queries are what is measured), or vmalert against VictoriaMetrics; its CPU beyond an idle
minute, and each group's evaluation time as the evaluator reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwarden.fleet.settings import parse_duration  # noqa: E402
from gpuwarden.health.rules import HISTORY_INTERVAL_S, NODE_GPUS_MAX, NVLINK_ACTIVE_MAX  # noqa: E402
from tests.helpers.common import free_port  # noqa: E402
from tests.helpers.stack import wait_ready  # noqa: E402
from tests.helpers.tsdb_backends import Prometheus, VictoriaMetrics  # noqa: E402

RULE_FILES = (ROOT / "alert_rules" / "gpuwarden.rules.yaml", ROOT / "alert_rules" / "gpuwarden.recording.yaml")
STEP = 15
DAY_FAMILIES = {"gpuwarden_nvlink_active_links", "gpuwarden_gpus"}  # read over [1d] / [24h]
DAY_S, RECENT_S = 86400, 40 * 60
AHEAD_S = 30 * 60  # past the instant evaluated, so that a loader's own checks at "now" see the data
DEFAULT_INTERVAL_S = 60
MAX_SAMPLES = 50_000_000  # Prometheus' default --query.max-samples
RATES = {"gpuwarden_utilization_sampled_seconds_total": 1.0, "gpuwarden_busy_seconds_total": 0.9}
TICKS = os.sysconf("SC_CLK_TCK")


def rule_texts(revision: str | None) -> dict[str, str]:
    """Both rule files' text: the working tree's, or a git revision's (`--compare`), measured on the same data."""
    if revision is None:
        return {path.name: path.read_text() for path in RULE_FILES}
    return {
        path.name: subprocess.run(
            ["git", "show", f"{revision}:alert_rules/{path.name}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for path in RULE_FILES
    }


def rules(texts: dict[str, str]) -> list[dict[str, Any]]:
    """Every rule of both files with its group, file and interval."""
    found = []
    for file, text in texts.items():
        for group in yaml.safe_load(text)["groups"]:
            interval = group.get("interval")
            seconds = DEFAULT_INTERVAL_S if interval is None else parse_duration(interval)
            for rule in group["rules"]:
                found.append({
                    "file": file, "group": group["name"], "interval_s": seconds,
                    "name": rule.get("alert") or rule["record"], "expr": rule["expr"],
                })  # fmt: skip
    return found


def read_families() -> set[str]:
    text = " ".join(rule["expr"] for rule in rules(rule_texts(None)))
    return set(re.findall(r"\b(gpuwarden_[a-z_]+)", text))


def simulator_scrape() -> str:
    """One /metrics of the simulator's default node after its slow tier has run twice."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwarden", "--sim", "--web.listen-address", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz", timeout=60)
        time.sleep(35)  # two slow-tier cycles (15 s): ECC, remapping, power limits
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(30)


class RulesFleet:
    """N copies of the scraped node, as exposition lines for the backends' loaders (tests/helpers/tsdb_backends)."""

    def __init__(self, nodes: int, scrape: str, at: int) -> None:
        self.nodes, self.at = nodes, at
        wanted = read_families()
        self.series: list[tuple[str, dict[str, str], float, str]] = []
        for family in text_string_to_metric_families(scrape):
            for sample in family.samples:
                if sample.name in wanted:
                    self.series.append((sample.name, dict(sample.labels), sample.value, family.type))
        gpus = sorted({(s[1]["gpu"], s[1]["uuid"]) for s in self.series if "uuid" in s[1]})
        for gpu, uuid in gpus:  # pod attribution's and GPM's, which the scrape has only with a kubelet or after 5 m
            self.series.append(("gpuwarden_gpu_allocation", {"gpu": gpu, "uuid": uuid, "namespace": "team-a",
                                "pod": "trainer-0", "container": "main"}, 1.0, "gauge"))  # fmt: skip
            self.series.append(("gpuwarden_bottleneck_info", {"gpu": gpu, "uuid": uuid, "class": "tensor_bound"},
                                1.0, "gauge"))  # fmt: skip
        self.per_node = len(self.series)
        # the alert rules' own records (the gpuwarden-history group), as it writes them: every 10 m over the day;
        # per GPU (its index) or per node (None)
        self.history: dict[str, list[tuple[str | None, float]]] = {
            NVLINK_ACTIVE_MAX: [
                (labels["gpu"], value)
                for name, labels, value, _ in self.series
                if name == "gpuwarden_nvlink_active_links"
            ],
            NODE_GPUS_MAX: [(None, value) for name, _, value, _ in self.series if name == "gpuwarden_gpus"],
        }

    @staticmethod
    def node(n: int) -> str:
        return f"gpu-node-{n:05d}"

    @staticmethod
    def uuid(n: int, gpu: str) -> str:
        return f"GPU-{n:05d}-{gpu}"

    def history_lines(self, ts: Callable[[int], str]) -> Iterator[str]:
        times = [ts(t) for t in range(self.at - DAY_S, self.at + AHEAD_S + 1, HISTORY_INTERVAL_S)]
        for name, rows in self.history.items():
            yield f"# TYPE {name} gauge\n"
            for n in range(self.nodes):
                for gpu, value in rows:
                    head = f'{name}{{uuid="{self.uuid(n, gpu)}"}}' if gpu else f'{name}{{node="{self.node(n)}"}}'
                    yield "".join(f"{head} {int(value)} {stamp}\n" for stamp in times)

    def lines(self, ts: Callable[[int], str], recorded: bool = True) -> Iterator[str]:
        """`recorded` is the loaders' parameter for the fleet's records, which this fleet does not lay out."""
        day = [(t, ts(t)) for t in range(self.at - DAY_S, self.at + AHEAD_S + 1, STEP)]
        recent = [(t, ts(t)) for t in range(self.at - RECENT_S, self.at + AHEAD_S + 1, STEP)]
        by_name: dict[str, list[tuple[dict[str, str], float, str]]] = {}
        for name, labels, value, type_ in self.series:
            by_name.setdefault(name, []).append((labels, value, type_))
        for name, rows in by_name.items():
            times = day if name in DAY_FAMILIES else recent
            kind = rows[0][2]
            yield f"# TYPE {name.removesuffix('_total') if kind == 'counter' else name} {kind}\n"
            rate = RATES.get(name)
            for n in range(self.nodes):
                node = self.node(n)
                for labels, value, _ in rows:
                    own = {**labels, "job": "gpuwarden", "instance": f"{node}:10045", "node": node}
                    if "uuid" in own:
                        own["uuid"] = self.uuid(n, own["gpu"])
                    head = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(own.items())) + "}"
                    if rate is None:
                        text = repr(value) if value != int(value) else str(int(value))
                        yield "".join(f"{head} {text} {stamp}\n" for _, stamp in times)
                    else:
                        start = times[0][0]
                        yield "".join(f"{head} {round((t - start) * rate, 1)} {stamp}\n" for t, stamp in times)
        yield from self.history_lines(ts)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def evaluate(backend: Any, expr: str, at: int, repeat: int) -> dict[str, Any]:
    """The rule's expression as the evaluator sends it, `repeat` times: median wall and backend CPU per evaluation."""
    walls, cpus, stats = [], [], None
    params = {"query": expr, "time": str(at)}
    if backend.name == "prometheus":
        params["stats"] = "all"
    with httpx.Client(timeout=600) as client:
        client.post(f"{backend.url}/api/v1/query", data=params)  # warm the index and page cache
        for _ in range(repeat):
            cpu0, wall0 = cpu_seconds(backend.proc.pid), time.perf_counter()
            body = client.post(f"{backend.url}/api/v1/query", data=params).json()
            walls.append(time.perf_counter() - wall0)
            cpus.append(cpu_seconds(backend.proc.pid) - cpu0)
            if body.get("status") != "success":
                raise RuntimeError(f"{backend.name} refused {expr[:80]}: {body}")
            stats = body["data"].get("stats")
    result = {"wall_s": round(statistics.median(walls), 4), "cpu_s": round(statistics.median(cpus), 4)}
    if stats:
        result["samples"] = stats["samples"]["totalQueryableSamples"]
        result["peak_samples"] = stats["samples"]["peakSamples"]
    return result


def live(backend: Any, minutes: float, work: Path) -> dict[str, Any]:
    """Both rule files evaluated by the real evaluator for `minutes`: Prometheus' rule manager, or vmalert against
    VictoriaMetrics (writing back by remote write). The evaluator's CPU beyond an idle minute of the same processes,
    and each group's evaluation time as the evaluator reports it, sampled every 15 s."""
    files = []
    for name, text in rule_texts(None).items():
        if backend.name != "prometheus":  # Debian's vmalert 1.79 predates keep_firing_for (it changes no query)
            document = yaml.safe_load(text)
            for group in document["groups"]:
                for rule in group["rules"]:
                    rule.pop("keep_firing_for", None)
            text = yaml.safe_dump(document, sort_keys=False)
        files.append(work / name)
        files[-1].write_text(text)
    idle0 = cpu_seconds(backend.proc.pid)
    time.sleep(60)
    idle_per_s = (cpu_seconds(backend.proc.pid) - idle0) / 60
    vmalert = None
    if backend.name == "prometheus":
        backend.stop(keep=True)
        backend.rule_files = tuple(files)
        backend.start()
        pids = [backend.proc.pid]
    else:
        port = free_port()
        vmalert = subprocess.Popen(
            ["vmalert", *(f"-rule={f}" for f in files), f"-datasource.url={backend.url}",
             f"-remoteWrite.url={backend.url}", f"-evaluationInterval={DEFAULT_INTERVAL_S}s",
             f"-notifier.url=http://127.0.0.1:{free_port()}",  # nothing listens: 1.79 has no -notifier.blackhole
             f"-httpListenAddr=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(work / "vmalert.log").open("w"),
        )  # fmt: skip
        wait_ready(f"http://127.0.0.1:{port}/health", timeout=60)
        pids = [backend.proc.pid, vmalert.pid]
    cpu0, began = sum(cpu_seconds(pid) for pid in pids), time.monotonic()
    durations: dict[str, list[float]] = {}
    while time.monotonic() - began < minutes * 60:
        time.sleep(15)
        if backend.name == "prometheus":
            body = httpx.get(f"{backend.url}/api/v1/rules", timeout=60).json()
            for group in body["data"]["groups"]:
                durations.setdefault(f"{Path(group['file']).name}:{group['name']}", []).append(group["evaluationTime"])
    spent = sum(cpu_seconds(pid) for pid in pids) - cpu0
    elapsed = time.monotonic() - began
    if vmalert is not None:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        mine = [s for s in samples if s.name.startswith("vmalert_iteration_duration_seconds") and "group" in s.labels]
        sums = {s.labels["group"]: s.value for s in mine if s.name.endswith("_sum")}
        counts = {s.labels["group"]: s.value for s in mine if s.name.endswith("_count")}
        durations = {group: [sums[group] / counts[group]] for group in sums if counts.get(group)}  # the mean
        vmalert.terminate()
        vmalert.wait(30)
    cpu_per_minute = (spent - idle_per_s * elapsed) / elapsed * 60
    return {
        "minutes": round(elapsed / 60, 2),
        "cpu_s_per_minute": round(cpu_per_minute, 2),
        "idle_cpu_s_per_minute": round(idle_per_s * 60, 3),
        "group_seconds": {g: round(max(v), 4) for g, v in durations.items()},
    }


def run(
    nodes: int, backend_kind: type, scrape: str, work: Path, repeat: int, compare: str | None, live_minutes: float
) -> dict[str, Any]:
    at = int(time.time()) // 60 * 60
    fleet = RulesFleet(nodes, scrape, at)
    flags = ("-search.disableCache",) if backend_kind is VictoriaMetrics else ("--query.max-samples=500000000",)
    backend = backend_kind(work / f"{nodes}", *flags)
    loaded = backend.load(fleet, recorded=False)
    backend.start()
    sets = {"now": rule_texts(None), **({compare: rule_texts(compare)} if compare else {})}
    try:
        measured: dict[str, list[dict[str, Any]]] = {}
        for label, texts in sets.items():
            measured[label] = []
            for rule in rules(texts):
                cost = evaluate(backend, rule["expr"], at, repeat)
                measured[label].append({**{k: rule[k] for k in ("file", "group", "name", "interval_s")}, **cost})
                print(f"  {backend.name} {nodes} {label} {rule['name'][:40]:40} {cost}", flush=True)
        evaluated = live(backend, live_minutes, work / f"{nodes}") if live_minutes else None
    finally:
        backend.stop()
    return {"nodes": nodes, "series_per_node": fleet.per_node, "load": loaded, "rules": measured, "live": evaluated}


def summarize(measured: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, dict[str, float]] = {}
    for rule in measured:
        group = groups.setdefault(f"{rule['file']}:{rule['group']}", {"wall_s": 0.0, "cpu_s": 0.0,
                                                                       "interval_s": rule["interval_s"]})  # fmt: skip
        group["wall_s"] += rule["wall_s"]
        group["cpu_s"] += rule["cpu_s"]
    cpu_per_minute = sum(r["cpu_s"] * 60 / r["interval_s"] for r in measured)
    worst_share = max(g["wall_s"] / g["interval_s"] for g in groups.values())
    peak = max((r.get("peak_samples", 0) for r in measured), default=0)
    return {
        "cpu_s_per_minute": round(cpu_per_minute, 2),
        "cores": round(cpu_per_minute / 60, 3),
        "worst_group_share_of_interval": round(worst_share, 4),
        "most_samples_held_share_of_max": round(peak / MAX_SAMPLES, 4),
        "groups": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in groups.items()},
    }


def markdown(report: dict[str, Any]) -> str:
    """The tables docs/benchmarks.md shows (Rules): per backend and size, each rule set's CPU a minute, its worst
    group's share of its interval and the most samples a rule held, measured and extrapolated linearly to 10,000
    nodes from the largest size; then the costliest rules of the working tree's set at that size."""
    lines = [
        "| backend | nodes | rules | CPU s/min | at 10,000 nodes: cores | worst group, share of its interval "
        "(at 10,000) | most samples held, share of --query.max-samples (at 10,000) | live: CPU s/min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        scale = 10_000 / run["nodes"]
        for label, summary in run["summary"].items():
            live_cpu = run["live"]["cpu_s_per_minute"] if label == "now" and run["live"] else ""
            lines.append(
                f"| {run['backend']} | {run['nodes']:,} | {label} | {summary['cpu_s_per_minute']} | "
                f"{summary['cores'] * scale:.2f} | {summary['worst_group_share_of_interval'] * 100:.1f} % "
                f"({summary['worst_group_share_of_interval'] * scale * 100:.0f} %) | "
                f"{summary['most_samples_held_share_of_max'] * 100:.2f} % "
                f"({summary['most_samples_held_share_of_max'] * scale * 100:.1f} %) | {live_cpu} |"
            )
    largest = max(report["runs"], key=lambda r: (r["nodes"], r["backend"] == "prometheus"))
    lines += [
        "",
        f"Costliest rules, {largest['backend']} at {largest['nodes']:,} nodes (working tree):",
        "",
        "| rule | group | samples | CPU s per evaluation | evaluations/min |",
        "|---|---|---|---|---|",
    ]
    for rule in sorted(largest["rules"]["now"], key=lambda r: -r["cpu_s"])[:10]:
        lines.append(
            f"| {rule['name']} | {rule['group']} | {format(rule['samples'], ',') if 'samples' in rule else '—'} | "
            f"{rule['cpu_s']} | "
            f"{60 / rule['interval_s']:g} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="100,1000")
    parser.add_argument("--backends", default="prometheus,victoriametrics")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--compare", metavar="REV", help="also measure the rule files of this git revision")
    parser.add_argument("--live-minutes", type=float, default=5.0, help="the real evaluator's run (0: none)")
    parser.add_argument("--markdown", type=Path, metavar="JSON", help="only print the tables of an earlier --json")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    kinds = {"prometheus": Prometheus, "victoriametrics": VictoriaMetrics}
    work = args.work or Path(tempfile.mkdtemp(prefix="rules-cost-"))
    scrape = simulator_scrape()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename,
                              "cores": os.cpu_count(), "runs": []}  # fmt: skip
    for name in args.backends.split(","):
        for nodes in (int(n) for n in args.nodes.split(",")):
            result = run(nodes, kinds[name], scrape, work, args.repeat, args.compare, args.live_minutes)
            result["backend"] = name
            result["summary"] = {label: summarize(measured) for label, measured in result["rules"].items()}
            brief = {label: {k: v for k, v in s.items() if k != "groups"} for label, s in result["summary"].items()}
            print(json.dumps({"backend": name, "nodes": nodes, **brief, "live": result["live"]}, indent=1), flush=True)
            report["runs"].append(result)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
