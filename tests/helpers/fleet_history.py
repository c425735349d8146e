"""A multi-node job's history in a real Prometheus without waiting for it: each node's exporter (the real pipeline
over the simulator, tests/helpers/job_cases.py) runs in turn on a manual clock that ends a little before now; what a
Prometheus scraping it every SCRAPE_S would have stored (its job series, with the node label) is written as
OpenMetrics and backfilled with `promtool tsdb create-blocks-from openmetrics`; Debian's Prometheus then serves it,
and the fleet's job view is evaluated at any instant of that history.

Backfilled series carry no staleness markers (a scrape writes one when a series leaves the exposition), so
Prometheus runs with a lookback of LOOKBACK (a little over a scrape interval): a finding that ended is gone from
instant queries one interval later, as it is after a real scrape.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.exposition.render import Renderer
from tests.helpers.common import free_port
from tests.helpers.stack import wait_ready

SCRAPE_S = 15  # the Helm chart's ServiceMonitor interval
LOOKBACK = "20s"
FAMILIES = ("gpuwarden_job_collective_wait_seconds", "gpuwarden_job_finding")


class Scrapes:
    """The job series of every node's exposition, one scrape every SCRAPE_S of the manual clock."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[tuple, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        self.types: dict[str, str] = {}
        self._renderers: dict[int, Renderer] = {}

    def of(self, node: str):  # noqa: ANN201 - job_cases.Scrape
        def scrape(now: float, pipeline, snapshot) -> None:  # noqa: ANN001
            if int(now) % SCRAPE_S:
                return
            renderer = self._renderers.setdefault(id(pipeline), Renderer(pipeline.settings.metrics.selection()))
            text = renderer.render(snapshot).decode()
            for family in text_string_to_metric_families(text):
                if family.name not in FAMILIES:
                    continue
                self.types[family.name] = family.type
                for sample in family.samples:
                    scraped = {"job": "gpuwarden", "instance": f"{node}:9400", "node": node}  # as a scrape adds
                    labels = tuple(sorted({**sample.labels, **scraped}.items()))
                    self.samples[family.name][(sample.name, labels)].append((now, sample.value))

        return scrape

    def openmetrics(self) -> str:
        lines = []
        for family, series in sorted(self.samples.items()):
            lines.append(f"# TYPE {family} {self.types[family]}")
            for (name, labels), points in sorted(series.items()):
                text = ",".join(f'{k}="{v}"' for k, v in labels)
                lines += [f"{name}{{{text}}} {value} {at:.3f}" for at, value in points]
        return "\n".join(lines) + "\n# EOF\n"


class BackfilledPrometheus:
    """Debian's Prometheus over the backfilled history, on a loopback port."""

    def __init__(self, work: Path, history: str) -> None:
        self.work, self.port = work, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        data = work / "history.om"
        data.write_text(history)
        shutil.rmtree(work / "tsdb", ignore_errors=True)
        subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(data), str(work / "tsdb")],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        (work / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", f"--query.lookback-delta={LOOKBACK}"],
            stdout=subprocess.DEVNULL, stderr=(work / "prometheus.log").open("w"),
        )  # fmt: skip
        wait_ready(f"{self.url}/-/ready", timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
