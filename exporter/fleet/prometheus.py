"""A small client for the Prometheus HTTP API (Thanos, Mimir and VictoriaMetrics speak it too).

Every query is an instant query evaluated on the server — the fleet service never pulls raw series — with a
deadline, and its answer is cached for `cache_ttl` seconds: concurrent callers of the same query share one request.
Failures are typed so the HTTP layer can answer 503 (unreachable, 5xx) or 504 (too slow) with a JSON reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram


class PrometheusError(Exception):
    """The fleet cannot be answered because Prometheus could not be asked."""

    status = 503


class PrometheusUnavailable(PrometheusError):
    status = 503


class PrometheusTimeout(PrometheusError):
    status = 504


class PrometheusQueryError(PrometheusError):
    """Prometheus refused a query (a bug on our side or an incompatible server): 502, the upstream said no."""

    status = 502


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    value: float


class ClientMetrics:
    """The fleet service's own metrics, in a registry of its own (served at the fleet's /metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queries = Counter(
            "gpuwarden_fleet_prometheus_queries",
            "Queries sent to Prometheus, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "gpuwarden_fleet_prometheus_query_duration_seconds",
            "Time Prometheus took to answer a query (answers and errors).",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.cache_hits = Counter(
            "gpuwarden_fleet_cache_hits",
            "Queries answered from the cache or shared with a concurrent caller.",
            registry=registry,
        )
        for outcome in ("ok", "unavailable", "timeout", "refused"):
            self.queries.labels(outcome)


_OUTCOME = {"PrometheusUnavailable": "unavailable", "PrometheusTimeout": "timeout", "PrometheusQueryError": "refused"}


class PrometheusClient:
    def __init__(
        self,
        base_url: str,
        timeout: float = 5.0,
        cache_ttl: float = 15.0,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.cache_ttl = cache_ttl
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout), headers=headers, transport=transport
        )
        self._cache: dict[str, tuple[float, list[Series]]] = {}
        self._inflight: dict[str, asyncio.Future[list[Series]]] = {}
        self.registry = registry or CollectorRegistry()
        self.metrics = ClientMetrics(self.registry)

    async def close(self) -> None:
        await self._client.aclose()

    def evaluation_time(self) -> float:
        """One evaluation time for all the queries of an answer, so they describe the same instant; quantized to
        the cache TTL so that concurrent answers share their queries."""
        step = max(self.cache_ttl, 1.0)
        return float(int(time.time() / step) * step)

    async def query(self, expr: str, at: float | None = None) -> list[Series]:
        """Instant vector (or scalar) at `at` (default: now); cached and shared between concurrent callers."""
        key = f"{at}|{expr}"
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached and now - cached[0] < self.cache_ttl:
            self.metrics.cache_hits.inc()
            return cached[1]
        pending = self._inflight.get(key)
        if pending is not None:
            self.metrics.cache_hits.inc()
            return await asyncio.shield(pending)
        future: asyncio.Future[list[Series]] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        started = time.monotonic()
        try:
            result = await self._fetch(expr, at)
        except BaseException as exc:
            self.metrics.duration.observe(time.monotonic() - started)
            self.metrics.queries.labels(_OUTCOME.get(type(exc).__name__, "unavailable")).inc()
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        else:
            self.metrics.duration.observe(time.monotonic() - started)
            self.metrics.queries.labels("ok").inc()
            future.set_result(result)
            self._cache[key] = (time.monotonic(), result)
            if len(self._cache) > 512:  # queries are a fixed set times a few windows; bound it anyway
                oldest = min(self._cache, key=lambda k: self._cache[k][0])
                del self._cache[oldest]
            return result
        finally:
            del self._inflight[key]

    async def _fetch(self, expr: str, at: float | None) -> list[Series]:
        form = {"query": expr, "timeout": f"{self.timeout:g}"}
        if at is not None:
            form["time"] = f"{at:.3f}"
        try:
            response = await self._client.post("/api/v1/query", data=form)
        except httpx.TimeoutException:
            raise PrometheusTimeout(f"Prometheus at {self.base_url} did not answer within {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(f"Prometheus at {self.base_url} is unreachable: {exc}") from None
        body = _json(response)
        if body.get("errorType") == "timeout":
            raise PrometheusTimeout(f"Prometheus at {self.base_url} timed out evaluating a query: {body.get('error')}")
        if response.status_code >= 500:
            raise PrometheusUnavailable(
                f"Prometheus at {self.base_url} answered {response.status_code}: "
                f"{body.get('error') or response.text[:200]}"
            )
        if response.status_code >= 400 or body.get("status") != "success":
            raise PrometheusQueryError(
                f"Prometheus at {self.base_url} refused the query ({response.status_code}, "
                f"{body.get('errorType')}): {body.get('error')}"
            )
        data = body["data"]
        if data["resultType"] == "scalar":
            return [Series({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise PrometheusQueryError(f"expected an instant vector, got {data['resultType']}")
        return [Series(item["metric"], float(item["value"][1])) for item in data["result"]]


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
