"""HTTP: routes only. Every handler reads the latest immutable snapshot; none touches NVML."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuwarden import __version__
from gpuwarden.health.diagnosis import as_json
from gpuwarden.jobs.findings import diagnose
from gpuwarden.model.families import FAMILIES
from gpuwarden.model.snapshot import GpuSnapshot, ProcessView, Snapshot, Verdict
from gpuwarden.web.apidocs import add_offline_docs
from gpuwarden.web.asgi import first_error, jsonable_errors
from gpuwarden.web.health_document import node_health
from gpuwarden.web.readiness import Readiness, SnapshotSource

GPU_KEY_PATTERN = r"^([0-9]{1,3}|GPU-[0-9a-fA-F-]{8,64}|MIG-[0-9a-fA-F-]{8,64})$"


class MetricValue(BaseModel):
    labels: dict[str, str] = Field(default_factory=dict)
    value: float


class Metric(BaseModel):
    unit: str = ""
    type: str
    values: list[MetricValue]


class ProcessModel(BaseModel):
    pid: int = Field(description="host PID")
    name: str = Field(description="/proc/PID/comm; empty where the host's /proc is not visible")
    kind: str = Field(description="compute, graphics or compute+graphics")
    used_memory_bytes: int | None
    memory_share: float | None = Field(description="of the GPU's total memory, 0-1")
    sm_ratio: float | None = Field(description="SM utilization over the last window, 0-1")
    memory_ratio: float | None = Field(description="memory-bandwidth utilization over the last window, 0-1")
    gpu_instance: int | None = Field(description="MIG GPU instance ID")
    namespace: str
    pod: str
    container: str
    attributed_by: str = Field(description="cgroup, allocation, or empty when no container was found")
    slurm_job: str = Field("", description="the Slurm job whose step holds the process (from its cgroup)")
    slurm_user: str = Field("", description="the Slurm job's user")


class NodeProcess(ProcessModel):
    gpu: int
    uuid: str


class ProcessList(BaseModel):
    processes: list[NodeProcess] = Field(description="every process on every GPU, largest memory holder first")


class Gpu(BaseModel):
    index: int
    uuid: str
    up: bool
    stale: bool = Field(description="true while a read is stuck past the deadline; values are from earlier")
    lost_reason: str | None = None
    hardware_error: str | None = None
    sample_age_seconds: dict[str, float] = Field(
        description="per tier: age of its last reading when the snapshot was taken (add snapshot_age_seconds)"
    )
    info: dict[str, Any]
    metrics: dict[str, Metric] = Field(description="metric name (without gpuwarden_) → values")
    health: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="check → level (0/1/2), severity, observed, threshold"
    )
    pods: list[dict[str, str]] = Field(
        default_factory=list, description="containers the kubelet allocated this GPU to: namespace, pod, container"
    )
    processes: list[ProcessModel] = Field(default_factory=list, description="processes holding it, by memory")
    memory_by_gpu_instance: dict[str, int] | None = Field(
        None, description="MIG: GPU memory held by the processes of each GPU instance ID"
    )


class GpuList(BaseModel):
    nvml_up: bool
    nvml_error: str | None
    driver: dict[str, str]
    snapshot_age_seconds: float
    gpus: list[Gpu]


class TopologyPeer(BaseModel):
    gpu: int
    uuid: str
    level: str
    nvlinks: int | None


class Topology(BaseModel):
    gpus: list[int]
    matrix: dict[str, dict[str, str]] = Field(description="row GPU → column GPU → X, NV#, PIX, PXB, PHB, NODE, SYS")
    peers: dict[str, list[TopologyPeer]]


class FindingModel(BaseModel):
    gpu: int | None
    uuid: str | None
    check: str
    severity: str = Field(description="critical, warning or info")
    observed: str
    threshold: str
    likely_cause: str
    recommended_action: str
    holders: list[dict[str, Any]] = Field(
        default_factory=list, description="processes holding the GPU's memory, largest first (memory findings)"
    )
    job: dict[str, Any] | None = Field(
        None,
        description="a job finding's structure (straggler, collective_hang, waiting_elsewhere): job, kind, the "
        "straggler (gpu, uuid, pid, rank, pod, slurm_job), cause, the waiting GPUs with their wait shares, since",
    )


class Diagnosis(BaseModel):
    nvml_up: bool
    driver: dict[str, str]
    findings: list[FindingModel]


class Problem(BaseModel):
    error: str
    detail: Any = None


def process_dict(process: ProcessView) -> dict[str, Any]:
    return {field.name: getattr(process, field.name) for field in dataclasses.fields(ProcessView)}


def gpu_dict(
    gpu: GpuSnapshot,
    taken_at: float,
    verdicts: tuple[Verdict, ...] = (),
    pods: tuple[Any, ...] = (),
    processes: tuple[ProcessView, ...] = (),
) -> dict[str, Any]:
    """One GPU as JSON-ready plain data (the shape of the `Gpu` model; ages as of the snapshot)."""
    metrics: dict[str, dict[str, Any]] = {}
    for sample in gpu.samples:
        family = FAMILIES[sample.name]
        entry = metrics.setdefault(
            sample.name.removeprefix("gpuwarden_"), {"unit": family.unit, "type": family.type, "values": []}
        )
        entry["values"].append({"labels": dict(zip(family.labels, sample.labels, strict=True)), "value": sample.value})
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "up": gpu.up,
        "stale": gpu.stale,
        "lost_reason": gpu.lost_reason,
        "hardware_error": gpu.hardware_error,
        "sample_age_seconds": {tier: round(max(taken_at - at, 0.0), 3) for tier, at in gpu.updated_at.items()},
        "info": gpu.info.as_json(),
        "metrics": metrics,
        "health": {
            v.check: {
                "level": v.level,
                "severity": v.severity,
                "observed": v.observed,
                "threshold": v.threshold,
                **({"class": v.detail} if v.detail else {}),
                **({"since": v.since} if v.level else {}),
                **({"pending_level": v.pending_level} if v.pending_level else {}),
            }
            for v in verdicts
        },
        "pods": [{"namespace": a.namespace, "pod": a.pod, "container": a.container} for a in pods],
        "processes": [process_dict(p) for p in processes],
        **(
            {"memory_by_gpu_instance": _by_instance(processes)}
            if any(p.gpu_instance is not None for p in processes)
            else {}
        ),
    }


def _by_instance(processes: tuple[ProcessView, ...]) -> dict[str, int]:
    """GPU memory held per MIG GPU instance (the processes' sum): who fills which slice."""
    held: dict[str, int] = {}
    for process in processes:
        if process.gpu_instance is not None and process.used_memory_bytes is not None:
            key = str(process.gpu_instance)
            held[key] = held.get(key, 0) + process.used_memory_bytes
    return held


class PartsResponse(Response):
    """A body sent as its parts, one ASGI message each, never joined: a part shared by every request (the GPUs'
    JSON, cached per snapshot) is then never copied into a per-request body, and a client that reads slowly holds a
    view of it rather than its own ~100 KB (gpuwarden.web.pacing.PacedWrites)."""

    def __init__(self, parts: tuple[bytes, ...], media_type: str) -> None:
        self.parts = parts
        super().__init__(headers={"content-length": str(sum(map(len, parts)))}, media_type=media_type)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for index, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": index < len(self.parts) - 1})


class GpuJsonCache:
    """The GPUs' JSON, serialized once per snapshot and shared by every request (as the exposition is): each GPU's
    object, and the tail of /api/v1/gpus (`, "gpus": [...]}`) that follows the per-request head."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot_id = -1
        self._by_index: dict[int, bytes] = {}
        self._all = b', "gpus": []}'

    def cached(self, snapshot: Snapshot) -> tuple[bytes, dict[int, bytes]] | None:
        if self._snapshot_id != snapshot.id:
            return None
        return self._all, self._by_index

    def build(self, snapshot: Snapshot) -> tuple[bytes, dict[int, bytes]]:
        with self._lock:
            if self._snapshot_id != snapshot.id:
                by_index = {
                    gpu.index: json.dumps(
                        gpu_dict(
                            gpu,
                            snapshot.taken_at,
                            snapshot.health.get(gpu.uuid, ()),
                            snapshot.pods.get(gpu.uuid, ()),
                            snapshot.processes.get(gpu.uuid, ()),
                        ),
                        ensure_ascii=False,
                    ).encode()
                    for gpu in snapshot.gpus
                }
                self._all = b', "gpus": [' + b",".join(by_index.values()) + b"]}"
                self._by_index = by_index
                self._snapshot_id = snapshot.id
            return self._all, self._by_index

    async def get(self, snapshot: Snapshot) -> tuple[bytes, dict[int, bytes]]:
        return self.cached(snapshot) or await anyio.to_thread.run_sync(self.build, snapshot)


def _probe_routes(snapshots: SnapshotSource, ready: Readiness, telemetry_path: str) -> APIRouter:
    router = APIRouter()

    # Documentation: exporter/gpuwarden/web/front.py answers GET and HEAD on these three paths before this app is
    # reached.

    @router.get(
        telemetry_path,
        summary="Prometheus metrics (text format, or OpenMetrics when asked; gzip when asked)",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}},
    )
    def metrics() -> Response:  # pragma: no cover - never reached
        raise StarletteHTTPException(500, "served by the fast path")

    @router.get("/healthz", summary="Liveness: the process serves HTTP (never touches NVML)")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get(
        "/readyz",
        summary="Readiness: NVML up, a GPU visible, the fast snapshot fresh",
        responses={503: {"model": Problem}},
    )
    def readyz() -> JSONResponse:
        reason = ready(snapshots(), time.time())
        if reason is not None:
            return JSONResponse({"status": "not ready", "error": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    return router


def _gpu_routes(snapshots: SnapshotSource) -> APIRouter:
    router = APIRouter()
    gpu_json = GpuJsonCache()

    @router.get("/api/v1/gpus", response_model=GpuList, summary="Every GPU's latest readings, with units")
    async def gpus() -> Any:
        snap = snapshots()
        gpus_tail, _ = await gpu_json.get(snap)
        head = json.dumps(
            {
                "nvml_up": snap.nvml_up,
                "nvml_error": snap.nvml_error,
                "driver": snap.driver,
                "snapshot_age_seconds": round(max(time.time() - snap.taken_at, 0.0), 3),
            }
        )
        return PartsResponse((head[:-1].encode(), gpus_tail), media_type="application/json")

    @router.get(
        "/api/v1/gpus/{gpu}",
        response_model=Gpu,
        responses={404: {"model": Problem}},
        summary="One GPU by index or UUID",
    )
    async def gpu(gpu: Annotated[str, Path(pattern=GPU_KEY_PATTERN, description="index (0) or UUID (GPU-...)")]) -> Any:
        snap = snapshots()
        found = snap.gpu(gpu)
        if found is None:
            return JSONResponse(
                {"error": f"no GPU '{gpu}' on this node", "detail": {"known": [g.index for g in snap.gpus]}},
                status_code=404,
            )
        _, by_index = await gpu_json.get(snap)
        return Response(by_index[found.index], media_type="application/json")

    @router.get(
        "/api/v1/processes",
        response_model=ProcessList,
        summary="Every process on every GPU with its memory, share and pod, largest first",
    )
    def processes() -> Any:
        snap = snapshots()
        rows = [
            {"gpu": gpu.index, "uuid": gpu.uuid, **process_dict(p)}
            for gpu in snap.gpus
            for p in snap.processes.get(gpu.uuid, ())
        ]
        rows.sort(key=lambda row: (-(row["used_memory_bytes"] or 0), row["gpu"], row["pid"]))
        return {"processes": rows}

    return router


class CheckVerdict(BaseModel):
    level: int = Field(description="0 ok, 1 warning, 2 critical")
    severity: str = Field(description="ok, info, pending, warning or critical")
    observed: str
    threshold: str
    since: float | None = Field(None, description="unix time this non-ok level began; null while ok")
    pending_level: int | None = Field(
        None,
        description="only while pending (the condition holds, not yet for its window; or not read yet): the level "
        "the check turns into if it lasts. npd-plugin and slurm-healthcheck report it as unknown",
    )


class GpuHealth(BaseModel):
    index: int
    uuid: str
    up: bool = Field(description="false: the GPU stopped answering (lost, fallen off the bus)")
    stale: bool
    checks: dict[str, CheckVerdict]


class NodeHealth(BaseModel):
    taken_at: float = Field(description="unix time of the snapshot; 0 before the first one (the exporter starts)")
    nvml_up: bool
    nvml_error: str | None
    gpus_expected: int | None = Field(description="nvml.expected_gpus; null when not set")
    gpus_skipped: dict[str, str] = Field(
        description="GPUs NVML counts that discovery left out (index → no_permission, timeout); a lost one is "
        "in `gpus`, not up"
    )
    gpus: list[GpuHealth]
    jobs: list[dict[str, Any]] = Field(
        default_factory=list,
        description="jobs on the node whose GPUs disagree: straggler (UUID), collective_hang or waiting_elsewhere, "
        "with the cause, its numbers, the waiting GPUs' wait shares and since when; never a GPU fault",
    )


def _diagnosis_routes(snapshots: SnapshotSource, expected_gpus: Callable[[], int]) -> APIRouter:
    router = APIRouter()

    @router.get(
        "/api/v1/health",
        response_model=NodeHealth,
        summary="Every GPU's health verdicts (what npd-plugin and slurm-healthcheck act on)",
    )
    def health() -> Any:
        return node_health(snapshots(), expected_gpus())

    @router.get(
        "/api/v1/diagnosis",
        response_model=Diagnosis,
        summary="Findings for the node: check, severity, observed, threshold, cause, action",
    )
    def diagnosis() -> Any:
        snap = snapshots()
        return as_json(snap, diagnose(snap))

    @router.get(
        "/api/v1/diagnosis/{gpu}",
        response_model=Diagnosis,
        responses={404: {"model": Problem}},
        summary="Findings for one GPU",
    )
    def gpu_diagnosis(gpu: Annotated[str, Path(pattern=GPU_KEY_PATTERN, description="index or UUID")]) -> Any:
        snap = snapshots()
        found = snap.gpu(gpu)
        if found is None:
            return JSONResponse({"error": f"no GPU '{gpu}' on this node"}, status_code=404)
        return as_json(snap, [f for f in diagnose(snap) if f.uuid == found.uuid])

    return router


def _topology_routes(snapshots: SnapshotSource) -> APIRouter:
    router = APIRouter()

    @router.get("/api/v1/topology", response_model=Topology, summary="GPU matrix as nvidia-smi topo -m shows it")
    def topology() -> Topology:
        snap = snapshots()
        up = [gpu for gpu in snap.gpus if gpu.up]
        matrix: dict[str, dict[str, str]] = {}
        peers: dict[str, list[TopologyPeer]] = {}
        for gpu in up:
            row = {str(gpu.index): "X"}
            for peer in snap.topology.get(gpu.uuid, ()):
                row[str(peer.peer_index)] = peer.level
            matrix[str(gpu.index)] = row
            peers[str(gpu.index)] = [
                TopologyPeer(
                    gpu=p.peer_index, uuid=p.peer_uuid, level=p.level, nvlinks=None if p.nvlinks < 0 else p.nvlinks
                )
                for p in snap.topology.get(gpu.uuid, ())
            ]
        return Topology(gpus=[gpu.index for gpu in up], matrix=matrix, peers=peers)

    return router


def _page_routes(snapshots: SnapshotSource, telemetry_path: str) -> APIRouter:
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def landing() -> HTMLResponse:
        """The node's page for a person (gpuwarden.web.node_page); the API's JSON says the same to programs."""
        from gpuwarden.web import node_page

        return HTMLResponse(node_page.render(snapshots(), telemetry_path))

    return router


def create_app(
    snapshots: SnapshotSource,
    ready: Readiness,
    telemetry_path: str = "/metrics",
    expected_gpus: Callable[[], int] = lambda: 0,
) -> FastAPI:
    """The exporter's JSON API and documentation over a source of snapshots; it never sees the poller or NVML.
    Built on the first request that exporter/gpuwarden/web/front.py does not answer itself (scrapes and probes); the
    header limit and basic auth sit in front of both."""
    app = FastAPI(
        docs_url=None,
        redoc_url=None,
        title="gpuwarden",
        version=__version__,
        description="NVIDIA GPU metrics, health and topology from NVML.",
    )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": first_error(exc), "detail": jsonable_errors(exc)}, status_code=422)

    app.include_router(_probe_routes(snapshots, ready, telemetry_path))
    app.include_router(_gpu_routes(snapshots))
    app.include_router(_diagnosis_routes(snapshots, expected_gpus))
    app.include_router(_topology_routes(snapshots))
    app.include_router(_page_routes(snapshots, telemetry_path))
    add_offline_docs(app)
    return app
