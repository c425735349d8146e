"""A small client for the Prometheus HTTP API (Thanos, Mimir and VictoriaMetrics speak it too).

Every query is an instant query evaluated on the server — the fleet service never pulls raw series — with a
deadline, and its answer is cached for `cache_ttl` seconds: concurrent callers of the same query share one request.
At most `max_concurrent` queries are in flight at once, whatever the number of requests (the backend's own
concurrency limit is never the one that trips), and the cache holds at most `cache_max_bytes` (estimated).
Failures are typed so the HTTP layer can answer 503 (unreachable, 5xx) or 504 (too slow) with a JSON reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuwarden.fleet.memory import (
    PARSE_FACTOR,
    SMALL_ANSWER,
    Answer,
    AnswerBudget,
    AnswerTooLarge,
    BoundedDecoder,
    OverBudget,
    Reading,
    held_estimate,
)


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


class AnswersOverBudget(PrometheusError):
    """The answer would take what the service holds of Prometheus' answers past max_answers_bytes: 503, retry."""

    status = 503


@dataclass(frozen=True, slots=True)
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
        for outcome in ("ok", "unavailable", "timeout", "refused", "over_budget"):
            self.queries.labels(outcome)
        self.held = Gauge(
            "gpuwarden_fleet_answers_held_bytes",
            "Estimated memory of Prometheus' answers held at once (being read, parsed, used or cached); at most "
            "--max-answers-bytes.",
            registry=registry,
        )


_OUTCOME = {
    "PrometheusUnavailable": "unavailable",
    "PrometheusTimeout": "timeout",
    "PrometheusQueryError": "refused",
    "AnswersOverBudget": "over_budget",
}


class PrometheusClient:
    def __init__(
        self,
        base_url: str,
        timeout: float = 5.0,
        cache_ttl: float = 15.0,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        registry: CollectorRegistry | None = None,
        max_answer_bytes: int = 8 * 1024 * 1024,
        max_answer_series: int = 50_000,
        max_concurrent: int = 4,
        cache_max_bytes: int = 64 * 1024 * 1024,
        max_answers_bytes: int = 128 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._clock = clock  # what the cache's ages are read on (tests move it by hand)
        self.max_concurrent = max_concurrent
        self.cache_max_bytes = cache_max_bytes
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the server's event loop
        self._cache_bytes = 0
        self.max_answer_bytes = max_answer_bytes
        self.max_answer_series = max_answer_series
        self._parsing = threading.Lock()  # one large answer turned into objects at a time: the peak is one answer's
        self._closed = False
        self.timeout = timeout
        self.cache_ttl = cache_ttl
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout),
            headers={**(headers or {}), "Accept-Encoding": "gzip"},  # decoded here, bounded (see _read)
            transport=transport,
        )
        self._cache: dict[str, tuple[float, list[Series], int]] = {}  # key → (when, answer, estimated bytes)
        self._inflight: dict[str, asyncio.Future[list[Series]]] = {}
        self.registry = registry or CollectorRegistry()
        self.metrics = ClientMetrics(self.registry)
        self.budget = AnswerBudget(max_answers_bytes, self._make_room)
        self.metrics.held.set_function(lambda: self.budget.used)
        self.latency_offset = 0.0  # seconds the backend shifts a recent instant back (VictoriaMetrics: 30 s)
        self._rule_health: tuple[float, dict[str, str] | None] | None = None
        self._record_intervals: dict[str, float] = {}  # record name → its group's interval, as the backend lists it

    def stop_parsing(self) -> None:
        """Drop the answers still waiting to be parsed: a stop must not wait for them (ten 8 MB answers queued for
        the parser, which the stopping views' threads cannot be cancelled out of, kept a service up for a minute)."""
        self._closed = True

    async def close(self) -> None:
        self.stop_parsing()
        await self._client.aclose()

    def evaluation_time(self) -> float:
        """One evaluation time for all the queries of an answer, so they describe the same instant; quantized to
        the cache TTL so that concurrent answers share their queries, and at least the backend's latency offset
        in the past, where the backend would otherwise move it there itself (see calibrate)."""
        step = max(self.cache_ttl, 1.0)
        return float(int((time.time() - self.latency_offset) / step) * step)

    async def calibrate(self) -> float:
        """Learn how far back the backend moves a recent evaluation time, by asking it what `time()` is now.

        VictoriaMetrics evaluates an instant within `-search.latencyOffset` (30 s by default) of now at now − 30 s
        and labels the answer with the time asked, so its "now" and Prometheus' differ by 30 s. Evaluating at
        least that far back makes every backend answer for the instant asked (Prometheus, Thanos and Mimir answer
        0 here and nothing changes). A failure keeps the last value; the next calibration tries again."""
        async with self._slot():
            asked = time.time()
            answer = await self._fetch("time()", asked)
        shift = asked - answer[0].value if answer else 0.0
        # a second's margin: an instant exactly at the offset's edge would still be moved
        self.latency_offset = float(math.ceil(shift) + 1) if shift >= 1 else 0.0
        return self.latency_offset

    async def query(self, expr: str, at: float | None = None, queued: bool = True) -> list[Series]:
        """Instant vector (or scalar) at `at` (default: now); cached and shared between concurrent callers.
        `queued=False` skips the max_concurrent queue: the readiness probe's one small query, which must not wait
        behind a page's 35 large ones (it waited 7 s of the chart's 8 s timeout)."""
        key = f"{at}|{expr}"
        now = self._clock()
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
            async with self._slot() if queued else contextlib.nullcontext():
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
            self._remember(key, result)
            return result
        finally:
            del self._inflight[key]

    def _slot(self) -> asyncio.Semaphore:
        """One of the max_concurrent slots every request to the backend takes."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        return self._slots

    def _remember(self, key: str, result: list[Series]) -> None:
        """Cache an answer; the oldest answers (and any expired) go while the estimate is over cache_max_bytes."""
        held = getattr(result, "held", None)
        if held is None:  # not read by _fetch (a test's list): estimated as _fetch would
            held = held_estimate(len(result), sum(len(k) + len(v) + 6 for s in result for k, v in s.labels.items()))
        size = len(key) + held
        previous = self._cache.pop(key, None)
        if previous is not None:
            self._cache_bytes -= previous[2]
        if size > self.cache_max_bytes:
            return  # an answer larger than the whole cache is served, not kept
        now = self._clock()
        self._cache[key] = (now, result, size)
        self._cache_bytes += size
        expired = now - self.cache_ttl
        for old in [k for k, entry in self._cache.items() if entry[0] < expired]:
            self._cache_bytes -= self._cache.pop(old)[2]
        while self._cache_bytes > self.cache_max_bytes:
            oldest = next(iter(self._cache))  # insertion order: the oldest answer first
            self._cache_bytes -= self._cache.pop(oldest)[2]

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    def _make_room(self, wanted: int) -> None:
        """Drop cached answers, oldest first, until `wanted` more bytes fit the answers' budget or none is left
        (an answer a view still uses stays counted until that view is done). On the event loop only."""
        while self._cache and self.budget.used + wanted > self.budget.limit:
            oldest = next(iter(self._cache))
            self._cache_bytes -= self._cache.pop(oldest)[2]

    async def rule_health(self) -> dict[str, str] | None:
        """Each recording rule's health where the backend lists its rules (`GET /api/v1/rules`: Prometheus, and
        vmalert or VictoriaMetrics proxying to it with -vmalert.proxyURL): record name → "" where every rule
        recording it evaluates, else its last error. None where the backend lists no recording rule at all (rules
        evaluated elsewhere, or VictoriaMetrics without a vmalert to ask): then nothing is known of their health.
        Cached for the answer cache's TTL; a failure to ask is None too (the answers still come, from the canary)."""
        now = self._clock()
        if self._rule_health is not None and now - self._rule_health[0] < self.cache_ttl:
            return self._rule_health[1]
        try:
            async with self._slot(), asyncio.timeout(self.timeout):
                with Reading(self.budget) as reading:
                    status = await self._read("GET", "/api/v1/rules", reading, params={"type": "record"})
                    peak = self._reserve_parse(held_estimate(0, len(reading.text)), len(reading.text))
                    try:
                        body = await anyio.to_thread.run_sync(self._parse_bounded, reading.text)
                    finally:
                        self.budget.give(peak)
            listed = status == 200 and isinstance(body, dict)
            health, self._record_intervals = _recording_rules(body) if listed else (None, {})
        except (TimeoutError, httpx.HTTPError, PrometheusError):
            health, self._record_intervals = None, {}
        self._rule_health = (now, health)
        return health

    async def record_interval(self, record: str) -> float | None:
        """The evaluation interval of the group recording `record`, where the backend lists its rules (None
        elsewhere): what a sum of its samples is multiplied by. The file's interval, not a flag that can disagree
        with it (a fleet reading 60 s records as 120 s ones doubled every GPU-hour)."""
        await self.rule_health()
        return self._record_intervals.get(record)

    async def _fetch(self, expr: str, at: float | None) -> list[Series]:
        form = {"query": expr, "timeout": f"{self.timeout:g}"}
        if at is not None:
            form["time"] = f"{at:.3f}"
        with Reading(self.budget) as reading:
            try:
                # One deadline for the whole exchange, body included: httpx's timeout applies to each read, so an
                # upstream trickling a byte every second would otherwise never be cut off.
                async with asyncio.timeout(self.timeout):
                    status = await self._read("POST", "/api/v1/query", reading, data=form)
            except TimeoutError:
                raise PrometheusTimeout(
                    f"Prometheus at {self.base_url} did not answer within {self.timeout:g} s"
                ) from None
            except httpx.TimeoutException:
                raise PrometheusTimeout(
                    f"Prometheus at {self.base_url} did not answer within {self.timeout:g} s"
                ) from None
            except httpx.HTTPError as exc:
                raise PrometheusUnavailable(f"Prometheus at {self.base_url} is unreachable: {exc}") from None
            series = reading.text.count(b'"metric"')
            held = held_estimate(series, len(reading.text)) if series <= self.max_answer_series else 0
            peak = self._reserve_parse(held, len(reading.text))
            try:
                # Parsed off the event loop: a large answer must not stall the probes and the other requests.
                answer = await anyio.to_thread.run_sync(self._parse_answer, status, reading.text)
            except BaseException:
                self.budget.give(peak)
                raise
            answer.held = held
            self.budget.give(peak - held)
            self.budget.hold(answer, held)  # until nothing refers to its series: views done, cache dropped it
            return answer

    def _reserve_parse(self, held: int, text_bytes: int) -> int:
        """Reserve what parsing an answer peaks at (its text decoded, json.loads' objects, the series kept)."""
        peak = int(held * PARSE_FACTOR) + text_bytes
        try:
            self.budget.take(peak, small=text_bytes <= SMALL_ANSWER)
        except OverBudget as exc:
            raise AnswersOverBudget(f"an answer of Prometheus at {self.base_url} is not held: {exc}") from None
        return peak

    def _parse_answer(self, status: int, raw: bytearray) -> Answer:
        """The answer's series (a worker thread's job: a large answer must not stall the event loop)."""
        return Answer(self._interpret(status, self._parse_bounded(raw), raw))

    def _parse_bounded(self, raw: bytes | bytearray) -> dict[str, Any] | str:
        """The JSON answer, refused before parsing where it holds more series than max_answer_series (parsed JSON
        costs ~1 MiB per 1,000 series: 95,000 series in an 8 MB answer OOM-killed the service at 384 MiB); large
        answers are parsed one at a time."""
        if self._closed:
            return "not parsed: the fleet service is stopping"
        series = raw.count(b'"metric"')
        if series > self.max_answer_series:
            return (
                f"{series} series, more than max_answer_series ({self.max_answer_series}); narrow the selector or "
                "raise the limit"
            )
        if len(raw) < 1024 * 1024:
            return _parse(raw)
        with self._parsing:
            if self._closed:  # while this one waited for the parser
                return "not parsed: the fleet service is stopping"
            return _parse(raw)

    async def _read(self, method: str, path: str, reading: Reading, **request: Any) -> int:
        """The answer's status, its body read into `reading`, refusing a body larger than max_answer_bytes as it
        arrives, counted after decompression (a 500 KB gzip answer expanding to 512 MB killed the service in a
        second: httpx's decoder inflates a whole chunk at once, so the body is read raw and inflated here in bounded
        steps), each piece reserved in the answers' budget. Every request to the backend reads its answer here."""
        async with self._client.stream(method, path, **request) as response:
            try:
                decoder = BoundedDecoder(response.headers.get("content-encoding", ""), self.max_answer_bytes)
                async for chunk in response.aiter_raw():
                    reading.add(decoder.feed(chunk))
                reading.add(decoder.flush())
            except OverBudget as exc:
                raise AnswersOverBudget(f"an answer of Prometheus at {self.base_url} is not read: {exc}") from None
            except AnswerTooLarge:
                raise PrometheusQueryError(
                    f"Prometheus at {self.base_url} answered more than {self.max_answer_bytes} bytes "
                    "(max_answer_bytes); narrow the selector or raise the limit"
                ) from None
            except (zlib.error, ValueError) as exc:
                raise PrometheusQueryError(
                    f"Prometheus at {self.base_url} answered a body that does not decode: {exc}"
                ) from None
            return response.status_code

    def _interpret(self, status: int, parsed: dict[str, Any] | str, raw: bytes | bytearray) -> list[Series]:
        where = f"Prometheus at {self.base_url}"
        body = parsed if isinstance(parsed, dict) else {}
        if body.get("errorType") == "timeout":
            raise PrometheusTimeout(f"{where} timed out evaluating a query: {body.get('error')}")
        if status >= 500:
            raise PrometheusUnavailable(f"{where} answered {status}: {body.get('error') or _reason(raw)}")
        if status >= 400 or body.get("status") != "success":
            if isinstance(parsed, str):
                raise PrometheusQueryError(
                    f"{where} answered {status} with a malformed body ({parsed}): {_reason(raw)}"
                )
            raise PrometheusQueryError(
                f"{where} refused the query ({status}, {body.get('errorType')}): {body.get('error')}"
            )
        try:
            return _series(body)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise PrometheusQueryError(f"{where} answered a malformed result: {exc}") from None


def _recording_rules(body: dict[str, Any]) -> tuple[dict[str, str] | None, dict[str, float]]:
    """From /api/v1/rules: record name → "" (healthy) or the last error of a failing rule recording it (None where
    no recording rule is listed); and record name → its group's `interval` in seconds (Prometheus and vmalert both
    list it; a group without a usable one is left out)."""
    health: dict[str, str] = {}
    intervals: dict[str, float] = {}
    groups = (body.get("data") or {}).get("groups") if isinstance(body.get("data"), dict) else None
    for group in groups if isinstance(groups, list) else []:
        if not isinstance(group, dict):
            continue
        interval = group.get("interval")
        usable = isinstance(interval, (int, float)) and not isinstance(interval, bool) and 0 < interval <= 86400
        for rule in group.get("rules") or []:
            if not isinstance(rule, dict) or rule.get("type") != "recording" or not isinstance(rule.get("name"), str):
                continue
            failing = rule.get("health") == "err"  # "unknown": not evaluated yet, the canary says whether data exists
            error = str(rule.get("lastError") or "evaluation failed")[:300] if failing else ""
            health[rule["name"]] = health.get(rule["name"]) or error
            if usable:
                intervals.setdefault(rule["name"], float(interval))
    return health or None, intervals


def _reason(raw: bytes | bytearray, keep: int = 600) -> str:
    """A plain-text error's reason: VictoriaMetrics echoes the whole request first and says why at the end, so the
    end is kept (the first 200 characters were the echoed query, and the reason was lost)."""
    text = " ".join(raw.decode("utf-8", "replace").split())
    return text if len(text) <= keep else "…" + text[-keep:]


def _parse(raw: bytes | bytearray) -> dict[str, Any] | str:
    """The JSON answer, or a one-line reason it is not one."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return f"not JSON ({exc})"
    except RecursionError:
        return "not JSON the fleet reads (nested too deeply)"
    return body if isinstance(body, dict) else f"JSON {type(body).__name__}, not an object"


def _series(body: dict[str, Any]) -> list[Series]:
    """The instant vector or scalar of a successful answer, its shape checked field by field."""
    data = body.get("data")
    if not isinstance(data, dict):
        raise ValueError("'data' is not an object")
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        value = _sample_value(result, "data.result")
        return [Series({}, value)] if math.isfinite(value) else []
    if kind != "vector":
        raise ValueError(f"expected an instant vector, got resultType {kind!r}")
    if not isinstance(result, list):
        raise ValueError("'data.result' is not a list")
    series = []
    for position, item in enumerate(result):
        metric = item.get("metric") if isinstance(item, dict) else None
        if not isinstance(metric, dict) or not all(isinstance(v, str) for v in metric.values()):
            raise ValueError(f"data.result[{position}].metric is not an object of strings")
        if any(len(v) > MAX_LABEL_VALUE for v in metric.values()):
            raise ValueError(f"data.result[{position}].metric has a label value over {MAX_LABEL_VALUE} characters")
        value = _sample_value(item.get("value"), f"data.result[{position}].value")
        if math.isfinite(value):  # NaN and ±Inf (a ratio over no samples) say nothing; JSON cannot carry them
            series.append(Series(metric, value))
    return series


MAX_LABEL_VALUE = 4096  # gpuwarden's own label values are short; 900 KB ones took the service to 341 MiB


def _sample_value(pair: Any, where: str) -> float:
    if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], str):
        raise ValueError(f'{where} is not a [timestamp, "value"] pair')
    try:
        return float(pair[1])
    except ValueError:
        raise ValueError(f"{where} has a non-numeric value {pair[1][:40]!r}") from None


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal holding `value` exactly (quotes, backslashes, newlines escaped):
    label values read from Prometheus never change the matchers of a query they are put into."""
    return json.dumps(value, ensure_ascii=False)
