"""What gpuwarden's rules cost the cluster's Prometheus: its live rule manager over a day laid out as Prometheus
holds one (compacted blocks and the head), at 1,000 nodes of 8 GPUs, extrapolated × 10 to 10,000.

Usage: python -m bench.rules_cost [--nodes 1000] [--windows 3] [--window-minutes 10] [--compare REV|DIR]
       [--json OUT.json] [--work DIR]

The fleet: one real scrape of the simulator's default node (`gpuwarden --sim`, 8x H100, the exporter's defaults),
cut to the families the shipped rules read, plus one `gpuwarden_gpu_allocation` and one `gpuwarden_bottleneck_info`
per GPU, copied to N nodes with their own instance, node and UUIDs, every 15 s (the chart's scrape interval), with
noise: counters grow by each scrape's own interval (15 s ± 0.3, full-precision floats), busy time by a utilization
that wanders, power-cap and thermal throttling on some GPUs, rare error increments, 1 % of the nodes restarted
once in the head's span (their counters reset); temperatures and memory in use walk; the collection timestamps
jitter.

The layout, as Prometheus holds a day: the head starts at the 2 h boundary that leaves it 1-3 h (Prometheus persists
the head's oldest 2 h once it spans 3 h) and is filled by remote write, in time order, up to now; then the feed goes
on live, every 15 s, for the whole run. Before the head: 26 h of 2 h blocks (`promtool tsdb create-blocks-from`),
which Prometheus compacts upward itself (2 h → 6 h → 18 h) before anything is measured. The blocks hold what the
rules read further back than the head: the alert rules' own records (group gpuwarden-history, every 10 m; the head
has them too up to the rules' start, then the rule manager writes them). Every other family the rules read over
30 m at most, which the head holds (≥ 1 h): the blocks before it do not hold them here (no rule reads them there).

Three Prometheus processes on the same blocks get the same feed: one evaluating the working tree's rule files
(alert_rules/*.rules.yaml and *.recording.yaml), one none, and with `--compare` one evaluating another revision's
(or directory's) rule files. The rule manager's cost is the CPU (utime + stime from /proc) of a process with rules
minus that of the one without, over the same windows (`--windows` of `--window-minutes`, a whole number of the
longest group interval); reported beside each: Prometheus' own evaluation time (prometheus_rule_group_duration
_seconds_sum) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.rules_layout import BLOCKS_SPAN_S, STEP, RulesFleet, head_start
from gpuwarden.fleet.settings import parse_duration
from tests.helpers.common import free_port
from tests.helpers.stack import wait_ready

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def rule_files(source: str | None) -> dict[str, str]:
    """The rule files' text: the working tree's, a directory's, or a git revision's."""
    if source is None or Path(source).is_dir():
        folder = Path(source) if source else ROOT / "alert_rules"
        paths = sorted([*folder.glob("*.rules.yaml"), *folder.glob("gpuwarden.recording.yaml")])
        return {path.name: path.read_text() for path in paths}
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", source, "alert_rules/"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    names = [Path(p).name for p in listed if p.endswith(".rules.yaml") or p.endswith("gpuwarden.recording.yaml")]
    return {
        name: subprocess.run(
            ["git", "show", f"{source}:alert_rules/{name}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        for name in names
    }


def read_families() -> set[str]:
    text = " ".join(
        rule["expr"]
        for body in rule_files(None).values()
        for group in yaml.safe_load(body)["groups"]
        for rule in group["rules"]
    )
    return set(re.findall(r"\b(gpuwarden_[a-z_]+)", text))


def longest_interval_s(texts: dict[str, str]) -> int:
    return max(
        parse_duration(group.get("interval", "60s"))
        for body in texts.values()
        for group in yaml.safe_load(body)["groups"]
    )


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


# --- Prometheus processes --------------------------------------------------------------------------------------


class Prometheus:
    """Debian's Prometheus on loopback over a copy of the blocks, taking remote writes; rules set by a reload."""

    def __init__(self, work: Path, blocks: Path, name: str) -> None:
        self.name, self.work, self.port = name, work / name, free_port()
        shutil.copytree(blocks, self.work / "tsdb")
        self.config = self.work / "prometheus.yml"
        self.write_config({})
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.config}", f"--storage.tsdb.path={self.work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-remote-write-receiver",
             "--query.max-samples=500000000"],
            stdout=subprocess.DEVNULL, stderr=(self.work / "prometheus.log").open("w"),
        )  # fmt: skip
        wait_ready(f"{self.url}/-/ready", timeout=600)
        self.client = httpx.Client(timeout=600)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self, rules: dict[str, str]) -> None:
        files = []
        for name, text in rules.items():
            files.append(self.work / name)
            files[-1].write_text(text)
        listed = "".join(f"\n  - {path}" for path in files)
        self.config.write_text(
            "global: {scrape_interval: 15s, evaluation_interval: 60s}\n" + (f"rule_files:{listed}\n" if files else "")
        )

    def set_rules(self, rules: dict[str, str]) -> None:
        """The rule files in, by a reload (SIGHUP), once the head is filled: the rule manager's appends at now
        would otherwise push the head past the backfill's timestamps."""
        self.write_config(rules)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            groups = self.client.get(f"{self.url}/api/v1/rules").json()["data"]["groups"]
            if len(groups) == sum(len(yaml.safe_load(t)["groups"]) for t in rules.values()):
                return
            time.sleep(1)
        raise RuntimeError(f"{self.name}: the rules did not load (see {self.work / 'prometheus.log'})")

    def write(self, body: bytes) -> None:
        response = self.client.post(
            f"{self.url}/api/v1/write", content=body,
            headers={"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                     "X-Prometheus-Remote-Write-Version": "0.1.0"},
        )  # fmt: skip
        if response.status_code >= 300:
            raise RuntimeError(f"{self.name} refused a remote write: {response.status_code} {response.text[:300]}")

    def metrics(self) -> dict[str, float]:
        text = self.client.get(f"{self.url}/metrics").text
        return {
            name: float(value)
            for line in text.splitlines()
            if line and not line.startswith("#")
            for name, value in [line.rsplit(" ", 1)]
        }

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS

    def blocks(self) -> list[float]:
        """Each loaded block's span in hours, oldest first."""
        spans = []
        for meta in sorted((self.work / "tsdb").glob("*/meta.json")):
            body = json.loads(meta.read_text())
            spans.append((body["minTime"], round((body["maxTime"] - body["minTime"]) / 3.6e6, 1)))
        return [span for _, span in sorted(spans)]

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(120)


def wait_compacted(servers: list[Prometheus], timeout: float = 1200) -> None:
    """Until every server's compactions have stopped for two minutes (the compactor runs once a minute)."""
    deadline, last, quiet_since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        now = [s.metrics().get("prometheus_tsdb_compactions_total", 0) for s in servers]
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since > 130:
            return
        time.sleep(5)
    raise RuntimeError("Prometheus kept compacting")


class Feed(threading.Thread):
    """The live feed: every series' next sample every 15 s, to every server, until stopped."""

    def __init__(self, fleet: RulesFleet, servers: list[Prometheus], start: int) -> None:
        super().__init__(daemon=True)
        self.fleet, self.servers, self.next_t = fleet, servers, start
        self.halt, self.failure = threading.Event(), None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                if self.next_t > time.time():
                    self.halt.wait(self.next_t - time.time())
                    continue
                for body in self.fleet.requests(self.next_t, self.next_t + STEP, 0):
                    for server in self.servers:
                        server.write(body)
                self.next_t += STEP
        except Exception as error:  # noqa: BLE001 - reported by the main thread, which stops the run
            self.failure = f"{type(error).__name__}: {error}"


def run(nodes: int, scrape: str, work: Path, windows: int, window_s: int, compare: str | None) -> dict[str, Any]:
    began = int(time.time())
    fleet = RulesFleet(nodes, scrape, read_families())
    head = head_start(began)
    blocks, om = work / "blocks", work / "history.om"
    with om.open("w") as out:
        out.writelines(fleet.history_openmetrics(head - BLOCKS_SPAN_S, head))
    shutil.rmtree(blocks, ignore_errors=True)
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=2h", str(om), str(blocks)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    om.unlink()
    sets = {"rules": rule_files(None)}
    if compare:
        sets[f"rules of {Path(compare).name if Path(compare).is_dir() else compare}"] = rule_files(compare)
    servers = [Prometheus(work, blocks, "none"), *(Prometheus(work, blocks, name) for name in sets)]
    feed = None
    try:
        fleet.restart_some(head, began + (windows * window_s) + 1200)
        now = int(time.time()) // STEP * STEP
        clock = time.monotonic()
        for body in fleet.requests(head, now, history_until=now):
            for server in servers:
                server.write(body)
        backfill_s = round(time.monotonic() - clock)
        feed = Feed(fleet, servers, now)
        feed.start()
        for server in servers[1:]:
            server.set_rules(sets[server.name])
        wait_compacted(servers)
        time.sleep(120)  # the rules' first evaluations (each group's first read is colder)
        measured = measure(servers, windows, window_s, feed, nodes)
    finally:
        if feed is not None:
            feed.halt.set()
            feed.join(60)
        layout = {s.name: s.blocks() for s in servers}
        for server in servers:
            server.stop()
    return {
        "nodes": nodes,
        "series_per_node": fleet.per_node,
        "head_start_utc": time.strftime("%H:%M", time.gmtime(head)),
        "head_hours_at_start": round((began - head) / 3600, 2),
        "backfill_seconds": backfill_s,
        "blocks_hours": layout,
        "longest_group_interval_s": longest_interval_s(sets["rules"]),
        "windows": measured,
    }


def measure(servers: list[Prometheus], windows: int, window_s: int, feed: Feed, nodes: int) -> list[dict[str, Any]]:
    """Each window: every server's CPU seconds, its rule groups' evaluation seconds, the load average; the rule
    manager's cores (with rules minus without), at `nodes` and × 10,000 / nodes."""
    results = []
    for _ in range(windows):
        cpu0 = {s.name: s.cpu_seconds() for s in servers}
        eval0 = {s.name: s.metrics().get("prometheus_rule_group_duration_seconds_sum", 0.0) for s in servers}
        load0, clock = os.getloadavg()[0], time.monotonic()
        time.sleep(window_s)
        if feed.failure:
            raise RuntimeError(f"the feed failed: {feed.failure}")
        elapsed = time.monotonic() - clock
        cpu = {s.name: round(s.cpu_seconds() - cpu0[s.name], 2) for s in servers}
        evaluation = {
            s.name: round(s.metrics().get("prometheus_rule_group_duration_seconds_sum", 0.0) - eval0[s.name], 2)
            for s in servers
        }
        window = {
            "seconds": round(elapsed),
            "cpu_seconds": cpu,
            "evaluation_seconds": evaluation,
            "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "rule_manager_cores": {},
            "rule_manager_cores_at_10000": {},
        }
        for s in servers[1:]:
            cores = (cpu[s.name] - cpu["none"]) / elapsed
            window["rule_manager_cores"][s.name] = round(cores, 4)
            window["rule_manager_cores_at_10000"][s.name] = round(cores * 10_000 / nodes, 3)
        print(json.dumps(window), flush=True)
        results.append(window)
    return results


def markdown(report: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows: per window, each server's CPU and the rule manager's cores."""
    result = report["run"]
    names = list(result["windows"][0]["rule_manager_cores"])
    lines = [
        "| window | load average (1 m) | CPU s, no rules | "
        + " | ".join(f"CPU s, {n} | evaluation s, {n} | rule manager at 10,000 nodes: cores, {n}" for n in names)
        + " |",
        "|---" * (3 + 3 * len(names)) + "|",
    ]
    for i, window in enumerate(result["windows"], 1):
        cells = [f"{i} ({window['seconds']} s)", "-".join(map(str, window["load_average_1m"])),
                 str(window["cpu_seconds"]["none"])]  # fmt: skip
        for n in names:
            cells += [str(window["cpu_seconds"][n]), str(window["evaluation_seconds"][n]),
                      f"**{window['rule_manager_cores_at_10000'][n]:.2f}**"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-minutes", type=float, default=10.0, help="a whole number of the longest interval")
    parser.add_argument("--compare", metavar="REV|DIR", help="also evaluate this revision's or folder's rule files")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--markdown", type=Path, metavar="JSON", help="only print the table of an earlier --json")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            print(f"rules_cost: {tool} is not on PATH; install Debian's prometheus package", file=sys.stderr)
            return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="rules-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    version = subprocess.run(["prometheus", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
                              "prometheus": version}  # fmt: skip
    report["run"] = run(
        args.nodes, simulator_scrape(), work, args.windows, round(args.window_minutes * 60), args.compare
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report["run"].items() if k != "windows"}))
    print(markdown(report))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
