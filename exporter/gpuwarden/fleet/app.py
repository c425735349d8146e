"""The fleet service's HTTP API and overview page (FastAPI; the page is server-rendered with Jinja2).

Prometheus unreachable → 503, too slow → 504, a refused query → 502, always as JSON {"error", "detail"}; bad
parameters → 422 JSON naming the parameter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from prometheus_client import CONTENT_TYPE_LATEST, Info, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuwarden import __version__
from gpuwarden.fleet import planner
from gpuwarden.fleet.backpressure import ResponseBudget
from gpuwarden.fleet.nodes import NodeLabel
from gpuwarden.fleet.prometheus import PrometheusClient, PrometheusError
from gpuwarden.fleet.refresh import AnswerCache, Compute, render
from gpuwarden.fleet.settings import FleetSettings, parse_duration
from gpuwarden.fleet.views import Fleet
from gpuwarden.fleet.views.health import PAGE_ROWS, health_by_node
from gpuwarden.web.apidocs import add_offline_docs
from gpuwarden.web.asgi import jsonable_errors, problem
from gpuwarden.web.basic_auth import BasicAuth
from gpuwarden.web.limits import ConnectionGuard

log = logging.getLogger("gpuwarden.fleet")
TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=select_autoescape(["html"])
)


def check_window(window: str, max_window_s: float, max_window: str) -> None:
    """A window between 5m and the configured maximum, or 422 naming the field."""
    try:
        seconds = parse_duration(window)
    except ValueError as exc:
        raise RequestValidationError([{"loc": ("query", "window"), "msg": str(exc), "type": "value_error"}]) from None
    if seconds > max_window_s or seconds < 300:
        raise RequestValidationError(
            [{"loc": ("query", "window"), "type": "value_error", "msg": f"window must be between 5m and {max_window}"}]
        )


def plan_body(result: planner.Plan, parameters: float, precision: str, gpus: int, mode: str) -> dict[str, Any]:
    """The planner's answer as JSON (GiB rounded to 0.01)."""
    gib = planner.GIB
    return {
        "input": {
            "parameters": parameters,
            "precision": precision,
            "optimizer": result.optimizer,
            "sharding": result.sharding,
            "gpus": gpus,
            "mode": mode,
        },
        "per_gpu": {
            "weights_gib": round(result.weights_bytes / gib, 2),
            "gradients_gib": round(result.gradients_bytes / gib, 2),
            "optimizer_state_gib": round(result.optimizer_bytes / gib, 2),
            "activations_gib": round(result.activations_bytes / gib, 2),
            "activations": result.activations_source,
            "total_gib": round(result.per_gpu_bytes / gib, 2),
            "total_gb": round(result.per_gpu_bytes / 1e9, 2),
        },
        "model_states_unsharded_gib": round(result.model_states_unsharded_bytes / gib, 2),
        "usable_memory_ratio": planner.USABLE_MEMORY_RATIO,
    }


def _probe_routes(client: PrometheusClient, settings: FleetSettings) -> APIRouter:
    router = APIRouter()

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        """The fleet service's own health: queries to Prometheus by outcome, their duration, cache hits."""
        return Response(generate_latest(client.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        started = time.monotonic()
        await client.query("vector(1)", queued=False)  # Prometheus errors become 503/504 through the handler
        return JSONResponse(
            {"status": "ready", "prometheus": settings.prometheus_url, "seconds": round(time.monotonic() - started, 3)}
        )

    return router


class SharedJson(Response):
    """A view's answer: its JSON as rendered once for every reader (refresh.AnswerCache), then this reader's
    `freshness`; two body messages, the first the shared bytes themselves (a view, no copy)."""

    media_type = "application/json"

    def __init__(self, shared: bytes, freshness: dict[str, Any]) -> None:
        tail = b'"freshness":' + render(freshness) + b"}"
        opened = memoryview(shared)[:-1]  # without its closing brace
        self.parts = (opened, tail if shared == b"{}" else b"," + tail)
        size = sum(len(part) for part in self.parts)
        super().__init__(headers={"content-length": str(size)})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.parts[0], "more_body": True})
        await send({"type": "http.response.body", "body": self.parts[1], "more_body": False})


class Views:
    """The fleet's views through the answer cache (exporter/gpuwarden/fleet/refresh.py): one key per view and
    parameters; as objects (the page) or as the JSON rendered once per answer (the API)."""

    def __init__(self, fleet: Fleet, answers: AnswerCache) -> None:
        self.fleet, self.answers = fleet, answers
        self.computations: dict[str, Compute] = {
            "inventory": self._named(fleet.inventory),
            "health": self._named(fleet.health),
            "cordon-candidates": self._named(fleet.cordon_candidates),
            "jobs": self._named(fleet.jobs),
        }

    def _named(self, compute: Compute) -> Compute:
        """`compute` once the label naming a node is known (fleet/nodes.py: `node`, or `instance` without it)."""

        async def named() -> dict[str, Any]:
            await self.fleet.nodes.resolve(self.fleet.client, self.fleet.selector)
            return await compute()

        return named

    def _utilization(self, window: str, limit: int) -> tuple[str, Compute]:
        return f"utilization:{window}:{limit}", self._named(lambda: self.fleet.utilization(window, limit))

    async def json(self, key: str, compute: Compute | None = None) -> SharedJson:
        return SharedJson(*await self.answers.get_rendered(key, compute or self.computations[key]))

    async def utilization_json(self, window: str, limit: int) -> SharedJson:
        return await self.json(*self._utilization(window, limit))

    async def inventory(self) -> dict[str, Any]:
        return await self.answers.get("inventory", self.computations["inventory"])

    async def health(self) -> dict[str, Any]:
        return await self.answers.get("health", self.computations["health"])

    async def cordon_candidates(self) -> dict[str, Any]:
        return await self.answers.get("cordon-candidates", self.computations["cordon-candidates"])

    async def utilization(self, window: str, limit: int) -> dict[str, Any]:
        return await self.answers.get(*self._utilization(window, limit))

    async def jobs(self) -> dict[str, Any]:
        return await self.answers.get("jobs", self.computations["jobs"])


class Problem(BaseModel):
    """Every 4xx/5xx answer's body (gpuwarden.web.asgi.problem)."""

    error: str
    detail: Any = None


# What a route that asks Prometheus answers when Prometheus cannot answer it: listed in /openapi.json and /docs, so
# a client knows a 5xx is the backend's and what its body holds.
PROMETHEUS_FAILURES: dict[int | str, dict[str, Any]] = {
    502: {"model": Problem, "description": "Prometheus refused or failed the query (its error in `detail`)."},
    503: {
        "model": Problem,
        "description": "Prometheus is unreachable, or its answers would take the service past --max-answers-bytes "
        "(`detail` says which; retry).",
    },
    504: {"model": Problem, "description": "Prometheus did not answer within --query-timeout."},
}


def _fleet_routes(views: Views, settings: FleetSettings, max_window_s: float) -> APIRouter:
    router = APIRouter(responses=PROMETHEUS_FAILURES)

    # JSON rendered once per answer and shared by its readers (SharedJson); the schema stays "an object"
    @router.get("/api/v1/fleet", response_model=dict[str, Any])
    async def inventory() -> Response:
        """Nodes, GPUs per node, models, memory, driver and exporter versions, stale exporters."""
        return await views.json("inventory")

    @router.get("/api/v1/fleet/health", response_model=dict[str, Any])
    async def health() -> Response:
        """Every GPU that is not healthy, with its failing checks, severity and since when."""
        return await views.json("health")

    @router.get("/api/v1/fleet/cordon-candidates", response_model=dict[str, Any])
    async def cordon_candidates() -> Response:
        """Nodes with hardware findings that warrant draining, the evidence, runbooks and kubectl commands."""
        return await views.json("cordon-candidates")

    @router.get("/api/v1/fleet/jobs", response_model=dict[str, Any])
    async def jobs() -> Response:
        """Jobs across nodes (by the job key the exporters agree on), each GPU's share of time waiting in
        collectives and its bottleneck class, and the straggler: the GPU, node and rank the others wait for."""
        return await views.json("jobs")

    @router.get("/api/v1/fleet/utilization", response_model=dict[str, Any])
    async def utilization(
        window: Annotated[str, Query(description="e.g. 1h, 24h, 7d")] = "1h",
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Response:
        """Idle and starved GPUs over the window, GPU-hours wasted and their cost, by node and namespace."""
        check_window(window, max_window_s, settings.max_window)
        return await views.utilization_json(window, limit)

    return router


def _plan_routes(fleet: Fleet) -> APIRouter:
    router = APIRouter(responses=PROMETHEUS_FAILURES)

    @router.get("/api/v1/plan")
    async def plan(
        parameters: Annotated[float, Query(gt=0, le=1e14, description="model parameters, e.g. 7e9")],
        precision: Annotated[planner.Precision, Query()] = "bf16",
        optimizer: Annotated[planner.Optimizer, Query()] = "adamw",
        sharding: Annotated[planner.Sharding, Query(description="none (DDP), zero1, zero2, zero3, fsdp")] = "none",
        gpus: Annotated[int, Query(ge=1, le=100_000)] = 1,
        mode: Annotated[planner.Mode, Query()] = "training",
        activations_gib: Annotated[float | None, Query(ge=0, le=10_000)] = None,
        layers: Annotated[int | None, Query(ge=1, le=1000)] = None,
        hidden_size: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
        heads: Annotated[int | None, Query(ge=1, le=10_000)] = None,
        sequence_length: Annotated[int | None, Query(ge=1, le=10_000_000)] = None,
        micro_batch_size: Annotated[int | None, Query(ge=1, le=100_000)] = None,
        activation_checkpointing: bool = False,
        flash_attention: bool = True,
    ) -> JSONResponse:
        """Memory per GPU (weights + gradients + optimizer state + activations) and the fleet's GPUs that fit."""
        shape_fields = (layers, hidden_size, heads, sequence_length, micro_batch_size)
        if any(v is not None for v in shape_fields) and any(v is None for v in shape_fields):
            return problem(
                422,
                "invalid request",
                [
                    {
                        "loc": ["query"],
                        "msg": "the activation estimate needs layers, hidden_size, heads, "
                        "sequence_length and micro_batch_size together",
                    }
                ],
            )
        shape = (
            planner.ActivationShape(
                layers,  # type: ignore[arg-type]
                hidden_size,  # type: ignore[arg-type]
                heads,  # type: ignore[arg-type]
                sequence_length,  # type: ignore[arg-type]
                micro_batch_size,  # type: ignore[arg-type]
                activation_checkpointing,
                flash_attention,
            )
            if layers is not None
            else None
        )
        try:
            result = planner.plan(parameters, precision, optimizer, sharding, gpus, mode, shape, activations_gib)
        except planner.PlanError as exc:
            return problem(422, "invalid request", [{"loc": ["query"], "msg": str(exc)}])
        body = plan_body(result, parameters, precision, gpus, mode)
        try:
            body["fleet"] = await fleet.fit(result)
        except PrometheusError as exc:  # the plan stands on its own; say why the fleet part is missing
            body["fleet"], body["fleet_error"] = None, str(exc)
        return JSONResponse(body)

    return router


class PageCache:
    """The overview page rendered at most once a second for the same answers, every reader sent the same bytes: a
    flood of page requests rendered it each time (grouping every unhealthy GPU by node included), which held the
    event loop for seconds at 10,000 unhealthy GPUs, and held a copy per reader that never read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._key: tuple[Any, ...] | None = None
        self._page = b""

    def get(self, answers: tuple[dict[str, Any], ...], render: Callable[[], str]) -> bytes:
        key = (*((a["freshness"]["computed_at"], a["freshness"]["stale"]) for a in answers), int(self.clock()))
        if key != self._key:
            self._page, self._key = render().encode(), key
        return self._page


def _page_routes(views: Views, settings: FleetSettings) -> APIRouter:
    router = APIRouter()
    pages = PageCache()

    @router.get("/", response_class=HTMLResponse)
    async def overview() -> Response:
        """A quick look when Grafana is not at hand."""
        try:
            answers = await asyncio.gather(
                views.inventory(), views.health(), views.cordon_candidates(), views.utilization("1h", 20), views.jobs()
            )
        except PrometheusError as exc:
            page = TEMPLATES.get_template("error.html").render(error=str(exc), settings=settings, version=__version__)
            return HTMLResponse(page, status_code=exc.status)
        inventory, health, cordon, usage, jobs = answers

        def render() -> str:
            return TEMPLATES.get_template("overview.html").render(
                inventory=inventory,
                health=health,
                health_nodes=health_by_node(health["unhealthy_gpus"]),
                rows=PAGE_ROWS,
                cordon=cordon,
                usage=usage,
                jobs=jobs,
                settings=settings,
                version=__version__,
                generated=_as_of(*answers),
            )

        return Response(pages.get(tuple(answers), render), media_type="text/html; charset=utf-8")

    return router


def _as_of(*answers: dict[str, Any]) -> str:
    """When the page's oldest answer was computed, how old it is, and whether a fresher one is on its way."""
    oldest = min(answers, key=lambda a: a["freshness"]["computed_at"])["freshness"]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(oldest["computed_at"]))
    stale = any(a["freshness"]["stale"] for a in answers)
    return f"data as of {when} ({oldest['age_seconds']:.0f} s old{', refreshing' if stale else ''})"


async def _calibrate_forever(client: PrometheusClient) -> None:
    """The backend's latency offset (PrometheusClient.calibrate), learnt at start and every 10 minutes; retried
    every 30 s while the backend cannot be asked."""
    while True:
        try:
            offset = await client.calibrate()
        except PrometheusError as exc:
            log.info("could not learn the backend's latency offset yet: %s", exc)
            await asyncio.sleep(30)
            continue
        if offset:
            log.info("the backend evaluates recent instants %g s back: queries are evaluated that far back", offset)
        await asyncio.sleep(600)


def create_app(
    settings: FleetSettings,
    client: PrometheusClient | None = None,
    basic_auth_users: dict[str, str] | None = None,
    guard: ConnectionGuard | None = None,
) -> FastAPI:
    client = client or PrometheusClient(
        settings.prometheus_url,
        settings.query_timeout,
        settings.cache_ttl,
        max_answer_bytes=settings.max_answer_bytes,
        max_answer_series=settings.max_answer_series,
        max_concurrent=settings.max_concurrent_queries,
        cache_max_bytes=settings.cache_max_bytes,
        max_answers_bytes=settings.max_answers_bytes,
    )
    fleet = Fleet(client, settings, NodeLabel(settings.node_label))
    answers = AnswerCache(
        settings.cache_ttl,
        settings.cache_ttl + settings.max_stale,
        settings.refresh_interval,
        registry=client.registry,
    )
    views = Views(fleet, answers)
    max_window_s = parse_duration(settings.max_window)
    Info("gpuwarden_fleet_build", "Build of the fleet service.", registry=client.registry).info(
        {"version": __version__, "prometheus_url": settings.prometheus_url}
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        answers.start_refreshing()
        calibration = asyncio.get_running_loop().create_task(_calibrate_forever(client))
        yield
        client.stop_parsing()  # first: the views being stopped wait on their answers' parsing otherwise
        calibration.cancel()
        await answers.stop()
        await client.close()

    app = FastAPI(
        docs_url=None,
        redoc_url=None,
        title="gpuwarden fleet",
        version=__version__,
        lifespan=lifespan,
        description="A fleet view of every GPU, computed by Prometheus from gpuwarden's series.",
    )

    @app.exception_handler(PrometheusError)
    async def _prometheus(request: Request, exc: PrometheusError) -> JSONResponse:
        return problem(exc.status, "prometheus", str(exc))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return problem(500, "internal error", "see the fleet service's log")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return problem(422, "invalid request", jsonable_errors(exc))

    app.include_router(_probe_routes(client, settings))
    app.include_router(_fleet_routes(views, settings, max_window_s))
    app.include_router(_plan_routes(fleet))
    app.include_router(_page_routes(views, settings))
    add_offline_docs(app)
    if basic_auth_users:  # /healthz and /readyz stay open for the kubelet's probes
        app.add_middleware(BasicAuth, users=basic_auth_users, guard=guard)
    app.add_middleware(ResponseBudget, limit_bytes=settings.max_response_bytes)  # outermost: a refusal costs least
    return app
