"""The node's own page (GET /): what an on-call reads after `kubectl port-forward` at 3 a.m.

Each GPU's state (up or lost, temperature, power, memory, utilization, bottleneck class, worst verdict), the
diagnosis findings with cause and action, and who holds the GPUs, from the same snapshot as /metrics and the JSON
API. Plain server-rendered HTML (Jinja2, autoescaped, no script), refreshed by the browser every 15 s. Jinja2 is
imported on the first request: a node that is only scraped never loads it.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuwarden import __version__
from gpuwarden.health.diagnosis import Finding
from gpuwarden.jobs.findings import diagnose
from gpuwarden.model.snapshot import GpuSnapshot, ProcessView, Snapshot

GIB = 1024**3
LINKS = (
    "/api/v1/gpus",
    "/api/v1/diagnosis",
    "/api/v1/health",
    "/api/v1/processes",
    "/api/v1/topology",
    "/readyz",
    "/healthz",
    "/docs",
)
SEVERITY_ORDER = {"critical": 4, "warning": 3, "pending": 2, "info": 1, "ok": 0}


@dataclass(frozen=True)
class GpuRow:
    index: int
    uuid: str
    state: str
    model: str
    temperature: str
    power: str
    memory: str
    utilization: str
    klass: str
    health: str


def _value(gpu: GpuSnapshot, name: str) -> float | None:
    return next((s.value for s in gpu.samples if s.name == name and not s.labels), None)


def _fmt(value: float | None, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def _not_yet_classed(verdicts: tuple[Any, ...]) -> str:
    """Why the class is empty in the first minutes: the bottleneck check's "measuring: 42 s of the 300 s window"."""
    return next((v.observed for v in verdicts if v.check == "bottleneck" and v.observed.startswith("measuring")), "")


def gpu_row(snap: Snapshot, gpu: GpuSnapshot) -> GpuRow:
    verdicts = snap.health.get(gpu.uuid, ())
    worst = _severest(v.severity for v in verdicts)
    used, total = _value(gpu, "gpuwarden_memory_used_bytes"), _value(gpu, "gpuwarden_memory_total_bytes")
    memory = "–" if used is None else f"{used / GIB:.1f} GiB" + (f" of {total / GIB:.0f}" if total else "")
    state = "up" if gpu.up else f"lost ({gpu.lost_reason or 'no answer'})"
    if gpu.up and gpu.stale:
        state = "stale (a read overran its deadline)"
    return GpuRow(
        index=gpu.index,
        uuid=gpu.uuid,
        state=state,
        model=gpu.info.name or "",
        temperature=_fmt(_value(gpu, "gpuwarden_temperature_celsius"), "{:.0f} °C"),
        power=_fmt(_value(gpu, "gpuwarden_power_usage_watts"), "{:.0f} W"),
        memory=memory,
        utilization=_fmt(_value(gpu, "gpuwarden_utilization_ratio"), "{:.0%}"),
        klass=next((v.detail for v in verdicts if v.detail), "") or _not_yet_classed(verdicts),
        health=worst,
    )


def _severest(severities: Iterable[str]) -> str:
    return max(severities, key=lambda s: SEVERITY_ORDER.get(s, 0), default="ok")


def _node_verdict(snap: Snapshot, rows: list[GpuRow], findings: list[Finding]) -> str:
    """The node's worst: its GPUs', critical while NVML is down, and the findings'."""
    worst = _severest(r.health for r in rows)
    if not snap.nvml_up:
        worst = "critical"
    return _severest([worst, *(f.severity for f in findings)])


def _holder(gpu: GpuSnapshot, process: ProcessView) -> dict[str, Any]:
    """One process on a GPU: where it runs (its pod's path, else its Slurm job) and its memory."""
    where = "/".join(x for x in (process.namespace, process.pod, process.container) if x)
    memory = process.used_memory_bytes
    return {
        "gpu": gpu.index,
        "pid": process.pid,
        "name": process.name or "?",
        "where": where or (process.slurm_job and f"slurm job {process.slurm_job}") or "–",
        "memory": "–" if memory is None else f"{memory / GIB:.1f} GiB",
        "share": "–" if process.memory_share is None else f"{process.memory_share:.0%}",
    }


def _taken(snap: Snapshot) -> str:
    if not snap.taken_at:
        return "not yet (starting)"
    return datetime.datetime.fromtimestamp(snap.taken_at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def page_model(snap: Snapshot, telemetry_path: str) -> dict[str, Any]:
    """What the template shows, computed here (the template only lays it out)."""
    findings = diagnose(snap)
    rows = [gpu_row(snap, gpu) for gpu in snap.gpus]
    worst = _node_verdict(snap, rows, findings)
    return {
        "verdict": worst if worst != "info" else "ok",
        "verdict_text": {"critical": "critical", "warning": "warning"}.get(worst, "healthy"),
        "answering": sum(1 for gpu in snap.gpus if gpu.up),
        "counted": len(snap.gpus) + len(snap.gpus_skipped),
        "nvml": "up" if snap.nvml_up else f"down ({snap.nvml_error or 'unknown'})",
        "driver": snap.driver.get("driver_version", "n/a"),
        "taken": _taken(snap),
        "version": __version__,
        "gpus": rows,
        "skipped": sorted(snap.gpus_skipped.items()),
        "findings": findings,
        "holders": [_holder(gpu, p) for gpu in snap.gpus for p in snap.processes.get(gpu.uuid, ())],
        "links": (telemetry_path, *LINKS),
    }


@functools.cache
def _template() -> Any:  # noqa: ANN401 - jinja2.Template, imported late
    from jinja2 import Environment, PackageLoader, select_autoescape

    environment = Environment(loader=PackageLoader("gpuwarden.web", "templates"), autoescape=select_autoescape())
    return environment.get_template("node.html")


def render(snap: Snapshot, telemetry_path: str) -> str:
    return _template().render(page=page_model(snap, telemetry_path))
