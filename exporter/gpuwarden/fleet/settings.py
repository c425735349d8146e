"""Settings of `gpuwarden fleet`: flags (`--prometheus-url`) over environment (`GPUWARDEN_FLEET_PROMETHEUS_URL`)
over defaults, validated in one place; every problem is one line naming the flag."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuwarden.commandline import FLEET_ENV_PREFIX, ConfigError, OneLineParser, check_known, own_environment
from gpuwarden.config.settings import check_listen_address, listen_host, listen_port
from gpuwarden.fleet import recording
from gpuwarden.health.thresholds import DEFAULT

ENV_PREFIX = FLEET_ENV_PREFIX
_DURATION = re.compile(r"([0-9]+)(s|m|h|d)")  # ASCII digits only, nothing around them
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MATCHER = r'\s*[a-zA-Z_]\w*\s*(=|!=|=~|!~)\s*"[^"\\]*"\s*'
_SELECTOR = re.compile(f"{_MATCHER}(,{_MATCHER})*")


def parse_duration(value: str) -> int:
    """'90s', '15m', '6h', '7d' → seconds; ValueError otherwise."""
    match = _DURATION.fullmatch(value)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"{value!r} is not a duration like 30m, 6h or 7d")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


class FleetSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_url: str = Field(
        description="Base URL of the Prometheus HTTP API (Thanos, Mimir, "
        "VictoriaMetrics work too), e.g. http://prometheus:9090."
    )
    listen_address: str = Field(":10046", description="Address to listen on, HOST:PORT.")
    selector: str = Field('job="gpuwarden"', description="Label matchers that select gpuwarden's series.")
    node_label: str = Field(
        "node",
        description="The label that names a node: `node`, which the Helm chart's ServiceMonitor/PodMonitor and "
        "deploy/prometheus/prometheus.yml add; where no gpuwarden target carries it (a plain static scrape config), "
        "`instance` is used instead.",
    )
    query_timeout: float = Field(5.0, gt=0, le=60, description="Seconds a Prometheus query may take.")
    cache_ttl: float = Field(15.0, ge=0, le=600, description="Seconds an answer from Prometheus is reused.")
    max_answer_bytes: int = Field(
        8 * 1024 * 1024,
        ge=65536,
        le=1024**3,
        description="Largest Prometheus answer accepted (bytes); a larger one is refused as it arrives (502).",
    )
    max_answer_series: int = Field(
        50_000,
        ge=100,
        le=10_000_000,
        description="Most series accepted in one Prometheus answer (five per node at 10,000 nodes); more is refused "
        "before it is turned into objects (502): ~1 MiB of memory per 1,000 series while parsed.",
    )
    max_concurrent_queries: int = Field(
        4,
        ge=1,
        le=64,
        description="Queries in flight to Prometheus at once, for all requests together: the page's ~35 queries queue "
        "here instead of overrunning the backend's own limit (VictoriaMetrics answers 503 past its "
        "-search.maxConcurrentRequests).",
    )
    max_stale: float = Field(
        300.0,
        ge=0,
        le=3600,
        description="Seconds past the cache TTL that a view's last answer is still served (marked stale, with its "
        "age) while a fresh one is computed behind it; 0 makes every reader past the TTL wait.",
    )
    refresh_interval: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Seconds between background recomputations of the views read in the last 10 minutes (the "
        "page, health, cordon candidates, utilization); 0 turns the background refresh off.",
    )
    cache_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        le=4 * 1024**3,
        description="Memory the cache of Prometheus answers may hold (bytes, estimated); the oldest answers go first.",
    )
    max_answers_bytes: int = Field(
        128 * 1024 * 1024,
        ge=16 * 1024 * 1024,
        le=64 * 1024**3,
        description="Memory all of Prometheus' answers may hold at once (bytes, estimated: being read, parsed, used "
        "by views or cached); a query that would pass it drops cached answers, then is refused (503). Sized for the "
        "chart's 384 MiB limit: raise both together.",
    )
    max_response_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024 * 1024,
        le=16 * 1024**3,
        description="Bytes of answers on their way to clients at once (a view's JSON, shared by its readers, counted "
        "once); past it new requests are answered 503 with Retry-After until clients read or are cut off (the "
        "probes and /metrics never are).",
    )
    recording_rules: Literal["auto", "off"] = Field(
        "auto",
        description="auto: read the recording rules (alert_rules/gpuwarden.recording.yaml) where Prometheus has "
        "them, else the raw series; off: always the raw series.",
    )
    recording_interval: int = Field(
        recording.INTERVAL_S,
        ge=1,
        le=3600,
        description="Evaluation interval of the recording rules (alert_rules/gpuwarden.recording.yaml, 120 s as "
        "shipped) where the backend does not list its rules (GET /api/v1/rules: Prometheus, vmalert behind "
        "VictoriaMetrics' -vmalert.proxyURL list their groups' interval, and that is used): sums of recorded rates "
        "times it are the window's increases.",
    )
    stale_after: float = Field(
        60.0, gt=0, le=3600, description="Seconds after which an exporter's last fast poll counts as stale."
    )
    price_per_gpu_hour: float = Field(2.5, ge=0, description="Price of one GPU-hour, for the cost of waste.")
    currency: str = Field("USD", min_length=1, max_length=8, description="Currency of price_per_gpu_hour.")
    idle_ratio: float = Field(
        DEFAULT.utilization_low_ratio,
        gt=0,
        lt=1,
        description="Utilization below which a GPU counts as idle (no job) or starved "
        "(a job holds it); the alert rules' threshold by default.",
    )
    max_window: str = Field("7d", description="Longest window a caller may ask for.")
    web_config_file: Path | None = Field(
        None, description="Prometheus exporter-toolkit web-config file (TLS, basic auth), as the exporter takes it."
    )

    @field_validator("listen_address")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        return check_listen_address(value)

    @field_validator("prometheus_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError("must be an http(s) URL, e.g. http://prometheus:9090")
        return value.rstrip("/")

    @field_validator("node_label")
    @classmethod
    def _check_label(cls, value: str) -> str:
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", value):
            raise ValueError("must be a Prometheus label name")
        return value

    @field_validator("selector")
    @classmethod
    def _check_selector(cls, value: str) -> str:
        if not _SELECTOR.fullmatch(value):
            raise ValueError('must be label matchers without braces, e.g. job="gpuwarden",cluster="a"')
        return value

    @field_validator("max_window")
    @classmethod
    def _check_window(cls, value: str) -> str:
        parse_duration(value)
        return value

    @property
    def host(self) -> str:
        return listen_host(self.listen_address)

    @property
    def port(self) -> int:
        return listen_port(self.listen_address)


_FLAGS = {"listen_address": "--web.listen-address", "web_config_file": "--web.config.file"}


def _flag(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def environment_names() -> dict[str, str]:
    """GPUWARDEN_FLEET_<SETTING> → the setting's name."""
    return {f"{ENV_PREFIX}{name.upper()}": name for name in FleetSettings.model_fields}


def parse(argv: list[str], environ: Mapping[str, str] | None = None) -> FleetSettings:
    """Flags over GPUWARDEN_FLEET_* over defaults; ConfigError with one line on any problem."""
    environ = os.environ if environ is None else environ
    parser = OneLineParser(prog="gpuwarden fleet", description="Fleet view of every GPU, served from Prometheus.")
    for name, field in FleetSettings.model_fields.items():
        parser.add_argument(
            _flag(name),
            dest=name,
            default=None,
            metavar=name.upper(),
            help=f"{field.description} Env: {ENV_PREFIX}{name.upper()}.",
        )
    args = vars(parser.parse_args(argv))
    known = environment_names()
    mine = own_environment(environ, ENV_PREFIX)
    ignored = check_known(mine, known, "gpuwarden fleet")
    values: dict[str, Any] = {known[var]: raw for var, raw in mine.items() if var not in ignored}
    values.update({k: v for k, v in args.items() if v is not None})
    try:
        return FleetSettings(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "settings"
        if error["type"] == "missing":
            raise ConfigError(
                f"{_flag(name)} is required (or {ENV_PREFIX}{name.upper()}), e.g. {_flag(name)} http://prometheus:9090"
            ) from None
        raise ConfigError(
            f"{_flag(name)}: {error['msg'].removeprefix('Value error, ')} (got {error.get('input')!r})"
        ) from None
