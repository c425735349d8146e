"""Debian's Prometheus and VictoriaMetrics on loopback, loaded with a synthetic fleet's history
(tests/helpers/synthetic_fleet.py), for the fleet's two-backend test and its scale bench (bench/fleet_scale.py).

Prometheus is backfilled with `promtool tsdb create-blocks-from openmetrics`; VictoriaMetrics gets the same samples
through its import API. `record()` evaluates the shipped recording rules over the history where each backend's own
tool would: promtool's rule backfill for Prometheus, vmalert's replay mode for VictoriaMetrics.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from alert_rules import generate
from tests.helpers.common import free_port
from tests.helpers.stack import wait_ready
from tests.helpers.synthetic_fleet import Fleet


def disk_mib(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 1)


def instant(url: str, expr: str, at: float | None = None) -> dict[str, Any]:
    form = {"query": expr} if at is None else {"query": expr, "time": f"{at}"}
    return httpx.post(f"{url}/api/v1/query", data=form, timeout=300).json()


class Prometheus:
    name = "prometheus"
    binary = "prometheus"
    rule_files: tuple[Path, ...] = ()

    def __init__(self, work: Path, *flags: str) -> None:
        self.work, self.port, self.flags = work / self.name, free_port(), list(flags)
        self.proc: subprocess.Popen[bytes] | None = None
        self.work.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def load(self, fleet: Fleet, recorded: bool = True) -> dict[str, Any]:
        data, blocks = self.work / "history.om", self.work / "tsdb"
        began = time.monotonic()
        with data.open("w", buffering=1 << 22) as out:
            for chunk in fleet.lines(str, recorded=recorded):
                out.write(chunk)
            out.write("# EOF\n")
        generated = time.monotonic() - began
        size = data.stat().st_size
        began = time.monotonic()
        shutil.rmtree(blocks, ignore_errors=True)
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=24h", str(data),
             str(blocks)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        data.unlink()
        return {
            "generate_seconds": round(generated, 1),
            "openmetrics_bytes": size,
            "load_seconds": round(time.monotonic() - began, 1),
            "storage_mib": disk_mib(blocks),
        }

    def add(self, fleet: Fleet, names: set[str]) -> dict[str, Any]:
        """Recorded series added to a loaded backend (a rule added after the load): a block of their own, which
        Prometheus merges into the overlapping one after it starts (vertical compaction; wait_compacted)."""
        data, out = self.work / "added.om", self.work / "added-blocks"
        with data.open("w") as file:
            file.writelines(fleet.recorded_lines(str, names))
            file.write("# EOF\n")
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=24h", str(data), str(out)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.blocks_before = sum(1 for b in (self.work / "tsdb").iterdir() if b.is_dir() and len(b.name) == 26)
        added = [block for block in out.iterdir() if block.is_dir()] if out.exists() else []
        for block in added:
            shutil.move(str(block), self.work / "tsdb" / block.name)
        data.unlink()
        return {"added_blocks": len(added)}

    def wait_compacted(self, timeout: float = 1800) -> float:
        """Seconds until Prometheus has merged the added block (its loaded blocks back to the count before)."""
        began, deadline = time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = httpx.get(f"{self.url}/metrics", timeout=30).text
            loaded = next(
                (
                    float(line.split()[1])
                    for line in text.splitlines()
                    if line.startswith("prometheus_tsdb_blocks_loaded ")
                ),
                None,
            )
            if loaded is not None and loaded <= self.blocks_before:
                return round(time.monotonic() - began, 1)
            time.sleep(1)
        raise RuntimeError("Prometheus did not merge the added block")

    def start(self) -> None:
        """Prometheus over the loaded blocks; it evaluates `rule_files` every minute when a caller sets them
        (bench/rules_cost.py's live run)."""
        rules = "".join(f"\n  - {path}" for path in self.rule_files)
        config = "global: {scrape_interval: 15s, evaluation_interval: 60s}\n"
        config += f"rule_files:{rules}\n" if rules else ""
        (self.work / "prometheus.yml").write_text(config)
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.work / 'prometheus.yml'}", f"--storage.tsdb.path={self.work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", *self.flags],
            stdout=subprocess.DEVNULL, stderr=(self.work / "prometheus.log").open("a"),
        )  # fmt: skip
        wait_ready(f"{self.url}/-/ready", timeout=600)

    def record(self, start: int, end: int) -> None:
        """The shipped recording rules over [start, end] with promtool's rule backfill, then a restart on the raw
        and the recorded blocks together."""
        rules, out = self.work / "recording.yaml", self.work / "rules-blocks"
        rules.write_text(generate.recording_rules_yaml())
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "rules", f"--start={start}", f"--end={end}",
             f"--url={self.url}", f"--output-dir={out}", "--quiet", str(rules)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.stop(keep=True)
        self.blocks_before = sum(1 for b in (self.work / "tsdb").iterdir() if b.is_dir() and len(b.name) == 26)
        for block in out.iterdir():
            if block.is_dir():
                shutil.move(str(block), self.work / "tsdb" / block.name)
        self.start()

    def stop(self, keep: bool = False) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(120)
            self.proc = None
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)


class VictoriaMetrics(Prometheus):
    name = "victoriametrics"

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen(
                ["victoria-metrics", f"-storageDataPath={self.work / 'data'}",
                 f"-httpListenAddr=127.0.0.1:{self.port}", *self.flags],
                stdout=subprocess.DEVNULL, stderr=(self.work / "vm.log").open("w"),
            )  # fmt: skip
            wait_ready(f"{self.url}/health", timeout=120)

    def load(self, fleet: Fleet, recorded: bool = True) -> dict[str, Any]:
        """The same samples, streamed to the import API in ~16 MB posts (timestamps in milliseconds) by a thread
        while the generator writes the next batch; then flushed and waited for until every GPU is visible."""
        self.start()
        batches: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
        failures: list[str] = []

        def post() -> None:
            with httpx.Client(timeout=600) as client:
                while (batch := batches.get()) is not None:
                    response = client.post(f"{self.url}/api/v1/import/prometheus", content=batch)
                    if response.status_code >= 300:
                        failures.append(f"{response.status_code} {response.text[:300]}")

        poster = threading.Thread(target=post)
        poster.start()
        began = time.monotonic()
        size, pending, total = 0, [], 0
        for chunk in fleet.lines(lambda t: f"{t}000", recorded=recorded):
            pending.append(chunk)
            size += len(chunk)
            if size > 16 << 20:
                batch = "".join(pending).encode()
                total += len(batch)
                batches.put(batch)
                pending, size = [], 0
        batch = "".join(pending).encode()
        total += len(batch)
        batches.put(batch)
        batches.put(None)
        poster.join()
        if failures:
            raise RuntimeError(f"VictoriaMetrics refused an import: {failures[0]}")
        self.flush()
        want, deadline = fleet.nodes * 8, time.monotonic() + 600
        while time.monotonic() < deadline:
            got = instant(self.url, "count(gpuwarden_gpu_info)")
            if got["data"]["result"] and int(float(got["data"]["result"][0]["value"][1])) == want:
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"VictoriaMetrics shows {got} GPUs of {want} after the import")
        return {
            "generate_and_load_seconds": round(time.monotonic() - began, 1),
            "import_bytes": total,
            "storage_mib": disk_mib(self.work / "data"),
        }

    def add(self, fleet: Fleet, names: set[str]) -> dict[str, Any]:
        """Recorded series added to a loaded VictoriaMetrics, through the import API."""
        self.start()
        body = "".join(fleet.recorded_lines(lambda t: f"{t}000", names)).encode()
        response = httpx.post(f"{self.url}/api/v1/import/prometheus", content=body, timeout=600)
        response.raise_for_status()
        self.flush()
        return {"added_bytes": len(body)}

    def wait_compacted(self, timeout: float = 0) -> float:
        return 0.0

    def flush(self) -> None:
        httpx.get(f"{self.url}/internal/force_flush", timeout=600)

    def record(self, start: int, end: int) -> None:
        """The shipped recording rules over [start, end] with vmalert's replay mode, written back to this
        VictoriaMetrics by remote write. vmalert 1.79's replay steps by -datasource.queryStep (5m by default), not
        by the group's interval: it wrote a point every 5 minutes and the hours read from them were a fifth of the
        truth; 0s makes it step by the rules' interval (60 s), as live evaluation does."""
        rules = self.work / "recording.yaml"
        rules.write_text(generate.recording_rules_yaml())

        def rfc3339(t: int) -> str:
            return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

        subprocess.run(
            ["vmalert", f"-rule={rules}", f"-datasource.url={self.url}", f"-remoteWrite.url={self.url}",
             f"-replay.timeFrom={rfc3339(start)}", f"-replay.timeTo={rfc3339(end)}", "-replay.rulesDelay=0s",
             "-datasource.queryStep=0s",
             "-replay.disableProgressBar", f"-httpListenAddr=127.0.0.1:{free_port()}"],
            check=True, stdout=subprocess.DEVNULL, stderr=(self.work / "vmalert.log").open("w"), timeout=600,
        )  # fmt: skip
        time.sleep(1)  # vmalert's remote-write queue drains on exit; the server makes the samples searchable
        self.flush()
