"""Settings of `gpuwarden fleet`: flags over GPUWARDEN_FLEET_* over defaults, checked by config/typed.py."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpuwarden.commandline import FLEET_ENV_PREFIX, ConfigError, OneLineParser, check_known, own_environment
from gpuwarden.config.settings import ListenPart, check_listen_address, listen_host, listen_port
from gpuwarden.config.typed import SettingError, build, choices, fields, setting
from gpuwarden.fleet import recording
from gpuwarden.health.thresholds import DEFAULT

ENV_PREFIX = FLEET_ENV_PREFIX
_DURATION = re.compile(r"([0-9]+)(s|m|h|d)")  # ASCII digits only, nothing around them
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MATCHER = r'\s*[a-zA-Z_]\w*\s*(=|!=|=~|!~)\s*"[^"\\]*"\s*'
_SELECTOR = re.compile(f"{_MATCHER}(,{_MATCHER})*")
_EXAMPLE_URL = "http://prometheus:9090"


def parse_duration(value: str) -> int:
    """'90s', '15m', '6h', '7d' → seconds; ValueError otherwise."""
    match = _DURATION.fullmatch(value)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"{value!r} is not a duration like 30m, 6h or 7d")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def _check_url(value: str) -> str:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError(f"must be an http(s) URL, e.g. {_EXAMPLE_URL}")
    return value.rstrip("/")


def _check_label(value: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", value):
        raise ValueError("must be a Prometheus label name")
    return value


def _check_selector(value: str) -> str:
    if not _SELECTOR.fullmatch(value):
        raise ValueError('must be label matchers without braces, e.g. job="gpuwarden",cluster="a"')
    return value


def _check_currency(value: str) -> str:
    if not 1 <= len(value) <= 8:
        raise ValueError("must be 1 to 8 characters, e.g. USD or EUR")
    return value


def _check_window(value: str) -> str:
    try:
        parse_duration(value)
    except ValueError:
        raise ValueError("must be a duration like 30m, 6h or 7d") from None
    return value


@dataclass(frozen=True)
class FleetSettings:
    """Every option of `gpuwarden fleet`; `parse` builds it from flags and environment (config/typed.py)."""

    prometheus_url: str = setting(
        description="Base URL of the Prometheus HTTP API (Thanos, Mimir, VictoriaMetrics work too), e.g. "
        f"{_EXAMPLE_URL}.",
        check=_check_url,
    )
    listen_address: str = setting(":10046", description="Address to listen on, HOST:PORT.", check=check_listen_address)
    selector: str = setting(
        'job="gpuwarden"', description="Label matchers that select gpuwarden's series.", check=_check_selector
    )
    node_label: str = setting(
        "node",
        description="The label that names a node: `node`, which the Helm chart's ServiceMonitor/PodMonitor and "
        "deploy/prometheus/prometheus.yml add; where no gpuwarden target carries it (a plain static scrape config), "
        "`instance` is used instead.",
        check=_check_label,
    )
    query_timeout: float = setting(5.0, gt=0, le=60, description="Seconds a Prometheus query may take.")
    cache_ttl: float = setting(15.0, ge=0, le=600, description="Seconds an answer from Prometheus is reused.")
    max_answer_bytes: int = setting(
        8 * 1024 * 1024,
        ge=65536,
        le=1024**3,
        description="Largest Prometheus answer accepted (bytes); a larger one is refused as it arrives (502).",
    )
    max_answer_series: int = setting(
        50_000,
        ge=100,
        le=10_000_000,
        description="Most series accepted in one Prometheus answer (five per node at 10,000 nodes); more is refused "
        "before it is turned into objects (502): ~1 MiB of memory per 1,000 series while parsed.",
    )
    max_concurrent_queries: int = setting(
        4,
        ge=1,
        le=64,
        description="Queries in flight to Prometheus at once, for all requests together: the page's ~35 queries queue "
        "here instead of overrunning the backend's own limit (VictoriaMetrics answers 503 past its "
        "-search.maxConcurrentRequests).",
    )
    max_stale: float = setting(
        300.0,
        ge=0,
        le=3600,
        description="Seconds past the cache TTL that a view's last answer is still served (marked stale, with its "
        "age) while a fresh one is computed behind it; 0 makes every reader past the TTL wait.",
    )
    refresh_interval: float = setting(
        30.0,
        ge=0,
        le=3600,
        description="Seconds between background recomputations of the views read in the last 10 minutes (the "
        "page, health, cordon candidates, utilization); 0 turns the background refresh off.",
    )
    cache_max_bytes: int = setting(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        le=4 * 1024**3,
        description="Memory the cache of Prometheus answers may hold (bytes, estimated); the oldest answers go first.",
    )
    max_answers_bytes: int = setting(
        128 * 1024 * 1024,
        ge=16 * 1024 * 1024,
        le=64 * 1024**3,
        description="Memory all of Prometheus' answers may hold at once (bytes, estimated: being read, parsed, used "
        "by views or cached); a query that would pass it drops cached answers, then is refused (503). Sized for the "
        "chart's 384 MiB limit: raise both together.",
    )
    max_response_bytes: int = setting(
        32 * 1024 * 1024,
        ge=1024 * 1024,
        le=16 * 1024**3,
        description="Bytes of answers on their way to clients at once (a view's JSON, shared by its readers, counted "
        "once); past it new requests are answered 503 with Retry-After until clients read or are cut off (the "
        "probes and /metrics never are).",
    )
    recording_rules: Literal["auto", "off"] = setting(
        "auto",
        description="auto: read the recording rules (alert_rules/gpuwarden.recording.yaml) where Prometheus has "
        "them, else the raw series; off: always the raw series.",
    )
    recording_interval: int = setting(
        recording.INTERVAL_S,
        ge=1,
        le=3600,
        description="Evaluation interval of the recording rules the views integrate over a window "
        "(alert_rules/gpuwarden.recording.yaml: 300 s as shipped) where the backend does not list its rules "
        "(GET /api/v1/rules: Prometheus, vmalert behind VictoriaMetrics' -vmalert.proxyURL list their groups' "
        "interval, and that is used): sums of recorded rates times it are the window's increases.",
    )
    stale_after: float = setting(
        60.0, gt=0, le=3600, description="Seconds after which an exporter's last fast poll counts as stale."
    )
    price_per_gpu_hour: float = setting(2.5, ge=0, description="Price of one GPU-hour, for the cost of waste.")
    currency: str = setting("USD", description="Currency of price_per_gpu_hour.", check=_check_currency)
    idle_ratio: float = setting(
        DEFAULT.utilization_low_ratio,
        gt=0,
        lt=1,
        description="Utilization below which a GPU counts as idle (no job) or starved "
        "(a job holds it); the alert rules' threshold by default.",
    )
    max_window: str = setting("7d", description="Longest window a caller may ask for.", check=_check_window)
    web_config_file: Path | None = setting(
        None, description="Prometheus exporter-toolkit web-config file (TLS, basic auth), as the exporter takes it."
    )

    host = ListenPart("listen_address", listen_host)
    port = ListenPart("listen_address", listen_port)


# Where the Prometheus exporter convention spells a flag differently from our derivation (the environment does not).
_FLAGS = {"listen_address": "--web.listen-address", "web_config_file": "--web.config.file"}


def flag(name: str) -> str:
    """The flag of the setting `name`: --max-window for max_window."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def env_name(name: str) -> str:
    """The environment variable of the setting `name`: GPUWARDEN_FLEET_MAX_WINDOW for max_window."""
    return f"{ENV_PREFIX}{name.upper()}"


def environment_names() -> dict[str, str]:
    """GPUWARDEN_FLEET_<SETTING> → the setting's name."""
    return {env_name(field.name): field.name for field in dataclasses.fields(FleetSettings)}


def _help_text(field: dataclasses.Field[Any], annotation: Any) -> str:
    """Description, the allowed values of a choice, the default (or that there is none), the environment name."""
    allowed = choices(annotation)
    one_of = f" One of: {', '.join(map(str, allowed))}." if allowed else ""
    default = field.default
    shown = " Required." if default is dataclasses.MISSING else f" Default: {'none' if default is None else default}."
    return f"{field.metadata['description']}{one_of}{shown} Env: {env_name(field.name)}."


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="gpuwarden fleet", description="Fleet view of every GPU, served from Prometheus.")
    for field, annotation in fields(FleetSettings):
        parser.add_argument(
            flag(field.name),
            dest=field.name,
            default=None,
            metavar=field.name.upper(),
            help=_help_text(field, annotation),
        )
    return parser


def parse(argv: list[str], environ: Mapping[str, str] | None = None) -> FleetSettings:
    """Flags (`--prometheus-url`) over environment (`GPUWARDEN_FLEET_PROMETHEUS_URL`) over defaults, built and
    checked by exporter/gpuwarden/config/typed.py as the exporter's own settings are; ConfigError with one line
    naming the flag or variable that set a bad value."""
    environ = os.environ if environ is None else environ
    flags = {name: raw for name, raw in vars(_parser().parse_args(argv)).items() if raw is not None}
    known = environment_names()
    mine = own_environment(environ, ENV_PREFIX)
    ignored = check_known(mine, known, "gpuwarden fleet")
    values: dict[str, Any] = {known[var]: raw for var, raw in mine.items() if var not in ignored}
    values.update(flags)
    if "prometheus_url" not in values:
        url = flag("prometheus_url")
        raise ConfigError(f"{url} is required (or {env_name('prometheus_url')}), e.g. {url} {_EXAMPLE_URL}")
    try:
        return build(FleetSettings, values)
    except SettingError as exc:
        name = exc.loc[0] if exc.loc else ""
        raise ConfigError(f"{flag(name) if name in flags else env_name(name)}: {exc.reason()}") from None
