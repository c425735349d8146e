"""HTTP: routes only. Every handler reads the latest immutable snapshot; none touches NVML."""

from __future__ import annotations

import html
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

from exporter import __version__
from exporter.asgi import HeaderLimit, first_error, jsonable_errors
from exporter.config import Settings
from exporter.health.diagnosis import as_json, diagnose
from exporter.metrics import FAMILIES
from exporter.render import Renderer, content_type
from exporter.serving import ConnectionGuard
from exporter.snapshot import GpuSnapshot, ProcessView, Snapshot, Verdict
from exporter.webconfig import BasicAuth

READY_INTERVALS = 3  # /readyz fails when the fast snapshot is older than this many intervals
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


class Diagnosis(BaseModel):
    nvml_up: bool
    driver: dict[str, str]
    findings: list[FindingModel]


class Problem(BaseModel):
    error: str
    detail: Any = None


def process_dict(process: ProcessView) -> dict[str, Any]:
    return {spec: getattr(process, spec) for spec in ProcessView.__slots__}  # type: ignore[attr-defined]


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
            }
            for v in verdicts
        },
        "pods": [{"namespace": a.namespace, "pod": a.pod, "container": a.container} for a in pods],
        "processes": [process_dict(p) for p in processes],
    }


class GpuJsonCache:
    """The GPUs' JSON, serialized once per snapshot and shared by every request (as the exposition is)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot_id = -1
        self._by_index: dict[int, bytes] = {}
        self._all = b"[]"

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
                self._all = b"[" + b",".join(by_index.values()) + b"]"
                self._by_index = by_index
                self._snapshot_id = snapshot.id
            return self._all, self._by_index

    async def get(self, snapshot: Snapshot) -> tuple[bytes, dict[int, bytes]]:
        return self.cached(snapshot) or await anyio.to_thread.run_sync(self.build, snapshot)


SnapshotSource = Callable[[], Snapshot]
Readiness = Callable[[Snapshot, float], "str | None"]


def readiness(snapshot: Snapshot, fast_interval: float, now: float) -> str | None:
    """None when ready, else the reason."""
    if not snapshot.nvml_up:
        return f"nvml is down: {snapshot.nvml_error or 'not initialised'}"
    if not any(gpu.up for gpu in snapshot.gpus):
        return "no GPU is visible"
    fast_at = snapshot.tier_finished.get("fast")
    limit = READY_INTERVALS * fast_interval
    if fast_at is None or now - fast_at > limit:
        return f"the fast snapshot is older than {limit:g} s"
    return None


def readiness_under(settings: Callable[[], Settings]) -> Readiness:
    """Readiness judged by the fast interval in force now (a reload may change it), not the one at start."""
    return lambda snapshot, now: readiness(snapshot, settings().poll.fast_interval, now)


def _quality(header: str, wanted: str) -> float:
    """The q-value `header` (Accept or Accept-Encoding) gives `wanted`; 0 when it is not listed or q=0."""
    for part in header.split(","):
        token, *params = (piece.strip() for piece in part.split(";"))
        if token.lower() != wanted:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    return max(0.0, min(float(value), 1.0))
                except ValueError:
                    return 0.0
        return 1.0
    return 0.0


def negotiate(accept: str, accept_encoding: str) -> tuple[bool, bool]:
    """(OpenMetrics?, gzip?) as the scraper asked, honouring quality values (q=0 means "not this")."""
    openmetrics = _quality(accept, "application/openmetrics-text")
    text = max(_quality(accept, "text/plain"), _quality(accept, "*/*"))
    return openmetrics > 0 and openmetrics >= text, _quality(accept_encoding, "gzip") > 0


class MetricsFastPath:
    """Serve GET/HEAD on the telemetry path straight from the render cache, ahead of FastAPI's routing.

    A cached scrape costs a dict lookup and two ASGI messages on the event loop; only the first scrape of a new
    snapshot renders, in a worker thread, so the loop never blocks.
    """

    def __init__(self, app: Any, path: str, snapshots: SnapshotSource, renderer: Renderer) -> None:
        self.app, self.path, self.snapshots, self.renderer = app, path, snapshots, renderer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        openmetrics, compress = negotiate(
            headers.get(b"accept", b"").decode("latin-1"), headers.get(b"accept-encoding", b"").decode("latin-1")
        )
        snapshot = self.snapshots()
        body = self.renderer.cached(snapshot, openmetrics, compress)
        if body is None:
            body = await anyio.to_thread.run_sync(self.renderer.render, snapshot, openmetrics, compress)
        response = [(b"content-type", content_type(openmetrics).encode()), (b"content-length", str(len(body)).encode())]
        if compress:
            response += [(b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
        await send({"type": "http.response.start", "status": 200, "headers": response})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})


def _probe_routes(snapshots: SnapshotSource, ready: Readiness, telemetry_path: str) -> APIRouter:
    router = APIRouter()

    # Documentation only: MetricsFastPath answers GET and HEAD on this path before routing reaches it.

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

    # HEAD probes (load balancers, some probers) answer like GET; one operation each in the OpenAPI document
    router.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
    router.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)
    return router


def _gpu_routes(snapshots: SnapshotSource) -> APIRouter:
    router = APIRouter()
    gpu_json = GpuJsonCache()

    @router.get("/api/v1/gpus", response_model=GpuList, summary="Every GPU's latest readings, with units")
    async def gpus() -> Any:
        snap = snapshots()
        all_gpus, _ = await gpu_json.get(snap)
        head = json.dumps(
            {
                "nvml_up": snap.nvml_up,
                "nvml_error": snap.nvml_error,
                "driver": snap.driver,
                "snapshot_age_seconds": round(max(time.time() - snap.taken_at, 0.0), 3),
            }
        )
        return Response(head[:-1].encode() + b', "gpus": ' + all_gpus + b"}", media_type="application/json")

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


def _diagnosis_routes(snapshots: SnapshotSource) -> APIRouter:
    router = APIRouter()

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
        snap = snapshots()
        state = "up" if snap.nvml_up else f"down ({html.escape(snap.nvml_error or '')})"
        up = sum(1 for gpu in snap.gpus if gpu.up)
        links = "".join(
            f'<li><a href="{path}">{path}</a></li>'
            for path in (
                telemetry_path,
                "/api/v1/gpus",
                "/api/v1/topology",
                "/api/v1/processes",
                "/api/v1/diagnosis",
                "/readyz",
                "/healthz",
                "/docs",
            )
        )
        return HTMLResponse(
            f"<!doctype html><html><head><title>gpuwarden</title></head><body><h1>gpuwarden {__version__}</h1>"
            f"<p>NVML {state}; {up} of {len(snap.gpus)} GPU(s) answering; driver "
            f"{html.escape(snap.driver.get('driver_version', 'n/a'))}.</p><ul>{links}</ul></body></html>"
        )

    return router


def create_app(
    snapshots: SnapshotSource,
    ready: Readiness,
    renderer: Renderer,
    telemetry_path: str = "/metrics",
    basic_auth_users: dict[str, str] | None = None,
    guard: ConnectionGuard | None = None,
) -> FastAPI:
    """The exporter's HTTP API over a source of snapshots; it never sees the poller or NVML. `guard` counts refused
    requests by reason (exporter/serving.py)."""
    app = FastAPI(
        title="gpuwarden", version=__version__, description="NVIDIA GPU metrics, health and topology from NVML."
    )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": first_error(exc), "detail": jsonable_errors(exc)}, status_code=422)

    app.include_router(_probe_routes(snapshots, ready, telemetry_path))
    app.include_router(_gpu_routes(snapshots))
    app.include_router(_diagnosis_routes(snapshots))
    app.include_router(_topology_routes(snapshots))
    app.include_router(_page_routes(snapshots, telemetry_path))
    app.add_middleware(MetricsFastPath, path=telemetry_path, snapshots=snapshots, renderer=renderer)
    if basic_auth_users:
        app.add_middleware(BasicAuth, users=basic_auth_users, guard=guard)
    app.add_middleware(HeaderLimit)  # added last: runs first
    return app
