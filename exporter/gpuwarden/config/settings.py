"""Typed settings, validated in one place.

Sources, lowest to highest precedence: defaults < YAML file < environment (GPUWARDEN_*) < flags.
Every option is a field of `Settings`; its flag (`--section.option-name`) and environment variable
(`GPUWARDEN_SECTION_OPTION_NAME`) are derived from the field, so the CLI, the environment and the
configuration reference (docs/configuration.md) cannot drift apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, overload

from gpuwarden.commandline import EXPORTER_ENV_PREFIX, ConfigError, check_known, own_environment
from gpuwarden.config.typed import SettingError, build, fields, is_list, setting

ENV_PREFIX = EXPORTER_ENV_PREFIX


def check_listen_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be HOST:PORT with a port 1-65535, e.g. ':10045' or '127.0.0.1:10045'")
    return value


def check_probe_listen_address(value: str) -> str:
    return check_listen_address(value) if value else value


def _check_devices(value: tuple[str, ...]) -> tuple[str, ...]:
    if len(value) > 1024:
        raise ValueError("at most 1024 GPUs")
    for entry in value:
        if not (entry.isdigit() or (entry.startswith("GPU-") and len(entry) <= 64 and entry.isprintable())):
            raise ValueError(f"'{entry}' is neither a GPU index (0, 1, ...) nor a GPU UUID (GPU-...)")
    return value


def _auto_off_or_path(example: str) -> Callable[[str], str]:
    """The check of a setting that takes auto, off or an absolute path (`example` names one in the message)."""

    def check(value: str) -> str:
        if value not in ("auto", "off") and not value.startswith("/"):
            raise ValueError(f"'{value}' is neither auto, off nor an absolute path ({example})")
        return value

    return check


def _check_api_server(value: str) -> str:
    if value not in ("", "in-cluster") and not (
        value.startswith("https://") and value.isprintable() and " " not in value
    ):
        raise ValueError(f"'{value}' is neither empty (off), in-cluster nor an https:// URL")
    return value


def _check_telemetry_path(value: str) -> str:
    if not value.startswith("/") or value in ("/", "/healthz", "/readyz") or value.startswith("/api/"):
        raise ValueError("must start with '/' and not clash with /, /healthz, /readyz or /api/")
    return value


def _known_groups(value: tuple[str, ...]) -> tuple[str, ...]:
    from gpuwarden.model.families import GROUPS

    if "all" in value:
        return tuple(GROUPS)
    unknown = [name for name in value if name not in GROUPS]
    if unknown:
        raise ValueError(f"unknown group '{unknown[0]}'; known: {', '.join(GROUPS)}, all")
    return value


def listen_host(listen_address: str) -> str:
    return listen_address.rpartition(":")[0].strip("[]") or "0.0.0.0"


def listen_port(listen_address: str) -> int:
    return int(listen_address.rpartition(":")[2])


_Part = TypeVar("_Part")


class ListenPart(Generic[_Part]):
    """The host or the port of a listen-address setting, read as an attribute (`web.port`: an int, as the part's
    function returns), for every settings class that listens."""

    def __init__(self, field: str, part: Callable[[str], _Part]) -> None:
        self.field, self.part = field, part

    @overload
    def __get__(self, settings: None, owner: type | None = None) -> ListenPart[_Part]: ...
    @overload
    def __get__(self, settings: object, owner: type | None = None) -> _Part: ...
    def __get__(self, settings: object | None, owner: type | None = None) -> ListenPart[_Part] | _Part:
        return self if settings is None else self.part(getattr(settings, self.field))


_section = dataclass(frozen=True)
_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"  # a pod's service-account token and CA


@_section
class WebSettings:
    """Where and how the HTTP server listens, and what a client may hold of it."""

    listen_address: str = setting(
        ":10045", description="Address to listen on, HOST:PORT (`:PORT` = all interfaces).", check=check_listen_address
    )
    probe_listen_address: str = setting(
        "",
        description="Address of a second listener, HOST:PORT, that serves only /healthz and /readyz, in plain HTTP "
        "on a thread of its own, for the kubelet's probes: they are answered whatever load the main listener is "
        "under, and /healthz fails when the main listener's loop stops turning. Empty: none.",
        check=check_probe_listen_address,
    )
    telemetry_path: str = setting(
        "/metrics", description="Path under which metrics are served.", check=_check_telemetry_path
    )
    config_file: Path | None = setting(
        None, description="Prometheus exporter-toolkit web-config file (TLS, basic auth)."
    )
    header_timeout: float = setting(
        5.0, ge=0.5, le=120, description="Seconds a connection has to send a request's headers before it is closed."
    )
    max_connections: int = setting(
        1000,
        ge=16,
        le=100_000,
        description="Open connections; at the limit one whose response its client leaves unread is closed, else "
        "the oldest one that has sent nothing (capped below the open-file limit).",
    )

    host = ListenPart("listen_address", listen_host)
    port = ListenPart("listen_address", listen_port)
    probe_host = ListenPart("probe_listen_address", listen_host)
    probe_port = ListenPart("probe_listen_address", listen_port)


@_section
class PollSettings:
    """The tiers' cadences and the deadline after which a GPU's reads are abandoned."""

    fast_interval: float = setting(1.0, ge=0.1, le=60, description="Seconds between fast-tier polls.")
    slow_interval: float = setting(15.0, ge=1, le=3600, description="Seconds between slow-tier polls.")
    samples_interval: float = setting(
        5.0,
        ge=0,
        le=10,
        description="Seconds between drains of the driver's utilization sample buffer (it holds ~14 s; each drain "
        "costs ~2.4 ms per GPU and type); 0 = every fast poll.",
    )
    nvlink_errors_interval: float = setting(
        60.0,
        ge=0,
        le=3600,
        description="Seconds between reads of the per-link NVLink error counters (~40 ms of driver CPU per GPU "
        "with 18 links); link state is read every slow poll; 0 = every slow poll.",
    )
    call_deadline: float = setting(
        5.0,
        gt=0,
        le=120,
        description="Seconds a GPU's reads may take before they are abandoned and its data marked stale.",
    )


@_section
class NvmlSettings:
    """Which NVML (the driver's or the simulator's) and which optional parts of it are read."""

    backend: Literal["nvml", "sim"] = setting("nvml", description="`nvml`: the real driver; `sim`: simulator.")
    scenario: str | None = setting(
        None, description="Simulator scenario: a shipped name (see `gpuwarden scenarios`) or a YAML path."
    )
    on_missing: Literal["stay_up", "exit"] = setting(
        "stay_up", description="When NVML cannot be loaded at start: `stay_up` (serve nvml_up 0, retry) or `exit`."
    )
    xid_events: bool = setting(True, description="Watch NVML XID critical-error events.")
    kernel_log: str = setting(
        "auto",
        description="The kernel log read for XIDs (from boot, so those logged before the start count), NVSwitch "
        "SXids and GPUs fallen off the bus, each counted only from the driver's own record naming one of this host's "
        "GPUs or NVSwitches: `auto` (/dev/kmsg with the real driver, none with the simulator), a path (/dev/kmsg, "
        "or a file of /dev/kmsg records; dmesg text is not read), or `off`. /dev/kmsg needs root or CAP_SYSLOG "
        "where kernel.dmesg_restrict is 1; unreadable, it is said once (gpuwarden_kernel_log_up 0) and the rest "
        "is served.",
        check=_auto_off_or_path("/dev/kmsg"),
    )
    gpm: bool = setting(
        True,
        description="Read profiling-class activity (SM, tensor, DRAM, NVLink, PCIe) from NVML GPM on GPUs that "
        "have it (Hopper and newer); off: no gpuwarden_gpm_* series, PCIe bytes from the driver's counters.",
    )
    gpm_isolation: Literal["process", "thread"] = setting(
        "process",
        description="Where GPM's calls run: `process`, a supervised child process, so that a crash in the driver's "
        "GPM code costs only the GPM series; `thread`, in the exporter (one GPM call at a time either way).",
    )
    gpm_crash_limit: int = setting(
        3,
        ge=1,
        le=100,
        description="Consecutive crashes or hangs of the GPM child process after which GPM is turned off "
        '(gpuwarden_gpm_unavailable_info{reason="crashed"}) until the backoff passes.',
    )
    gpm_crash_backoff: float = setting(
        600.0,
        ge=1,
        le=86400,
        description="Seconds GPM stays off after repeated crashes before one new child is tried; doubles after each "
        "failed try, up to an hour.",
    )
    devices: tuple[str, ...] = setting(
        (),
        description="GPUs this exporter watches, by NVML index or UUID (dcgm-exporter's --devices): empty, every "
        "GPU. For a node split between exporters (two jobs' GPUs, a test of two nodes on one host); the others are "
        "neither opened nor served. Applied at discovery (start, or NVML's re-initialisation).",
        check=_check_devices,
    )
    expected_gpus: int = setting(
        0,
        ge=0,
        le=1024,
        description="GPUs this node should have; exported as gpuwarden_gpus_expected so that GpuwardenGpuCountDropped "
        "keeps firing while one is missing, across restarts (0: not set; the alert then remembers 24 h).",
    )
    version_mismatch_grace: float = setting(
        10.0,
        ge=0,
        le=600,
        description="Seconds to keep serving after a driver/library version mismatch before exiting.",
    )


@_section
class MetricsSettings:
    """What /metrics exports: name globs and opt-in collector groups."""

    include: tuple[str, ...] = setting(
        (), description="Metric-name globs to export (empty = all). Comma-separated in env and flags."
    )
    exclude: tuple[str, ...] = setting((), description="Metric-name globs to drop, applied after include.")
    enable_groups: tuple[str, ...] = setting(
        (),
        description="Collector groups of detail to export beside the default set, by name (every group is in the "
        "table of docs/metrics.md, Series budget; an unknown name is refused); 'all' for every one.",
        check=_known_groups,
    )

    def selection(self):  # noqa: ANN201 - metrics.Selection (imported late: config stays light)
        """What /metrics exports under these settings."""
        from gpuwarden.model.families import Selection

        return Selection(self.include, self.exclude, self.enable_groups)


@_section
class HealthSettings:
    """Where operators override the health thresholds."""

    thresholds_file: Path | None = setting(
        None, description="YAML file overriding health thresholds (keys of exporter/gpuwarden/health/thresholds.toml)."
    )
    state_file: str = setting(
        "auto",
        description="Where the verdicts' memory is kept across restarts (when each held condition and non-ok "
        "verdict began, the NVLinks seen up; JSON, a few KB, written crash-safe): `auto` "
        "(/var/lib/gpuwarden/state.json with the real driver, none with the simulator), an absolute path, or `off`. "
        "Without it a restart starts every sustain window afresh: checks read pending, which npd-plugin and "
        "slurm-healthcheck report as unknown. One file per exporter (docs/reliability.md, The state file).",
        check=_auto_off_or_path("/var/lib/gpuwarden/state.json"),
    )
    state_max_gap: float = setting(
        300.0,
        ge=0,
        le=86400,
        description="Seconds the exporter may have been down (from the state file's last write to the next start) "
        "for the conditions it held to be recalled; a longer outage starts their windows afresh.",
    )

    def state_path(self, backend: str) -> Path | None:
        """The state file in force: `auto` is the default path with the real driver, none with the simulator."""
        if self.state_file == "off" or (self.state_file == "auto" and backend == "sim"):
            return None
        return Path("/var/lib/gpuwarden/state.json" if self.state_file == "auto" else self.state_file)


@_section
class PodsSettings:
    """Pod attribution through the kubelet's pod-resources API."""

    attribution: bool = setting(
        True,
        description="Read the kubelet pod-resources API to label GPUs with the pods holding them "
        "(turns itself off, with one log line, where the socket is absent).",
    )
    resources_socket: Path = setting(
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        description="The kubelet pod-resources gRPC socket (mount its directory read-only).",
    )
    refresh_interval: float = setting(10.0, ge=1, le=600, description="Seconds between pod-resources List calls.")
    resource_names: tuple[str, ...] = setting(
        ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"),
        description="Extended-resource name globs that are GPUs. Comma-separated in env and flags.",
    )
    dra_drivers: tuple[str, ...] = setting(
        ("gpu.nvidia.com",),
        description="DRA drivers whose devices are GPUs (Kubernetes 1.34+): their devices gpu-<minor> and "
        "gpu-<minor>-mig-<profile>-<profile ID>-<start> are matched to GPUs and MIG slices without API access. "
        "Comma-separated in env and flags; empty: DRA allocations ignored.",
    )
    api_server: str = setting(
        "",
        description="The Kubernetes API server the job view asks for a GPU process's pod (one GET each: its operator's "
        "labels and the launcher variables of its spec, for ranks and job keys where the process's environment is "
        "another user's): `in-cluster`, an https:// URL, or empty (off). Needs RBAC `get` on pods (Helm: jobs.podApi).",
        check=_check_api_server,
    )
    api_token_file: Path = setting(Path(_ACCOUNT, "token"), description="Bearer token for pods.api_server (re-read).")
    api_ca_file: Path | None = setting(
        Path(_ACCOUNT, "ca.crt"), description="CA of pods.api_server (empty: the system's)."
    )


@_section
class ProcessesSettings:
    """Who holds the GPU: the host paths that name processes and their pods, and per-PID series."""

    proc_root: Path | None = setting(
        None,
        description="The host's /proc, to name GPU processes and find their pods from their cgroups: /proc on bare "
        "metal or under systemd, the host's /proc mounted read-only in a pod (Helm: processes.hostProc). Unset: "
        "processes are attributed through the GPU's allocation only.",
    )
    sys_root: Path | None = setting(Path("/sys"), description="The host's /sys: RDMA port counters for the hang rule.")
    pod_logs_root: Path | None = setting(
        Path("/var/log/pods"),
        description="The kubelet's pod log directory (namespace_pod_uid/container/), mounted read-only: maps a "
        "process's pod UID to its namespace and name.",
    )
    per_pid_series: bool = setting(
        False,
        description="Also export gpuwarden_process_gpu_memory_used_bytes per PID (series churn with every job: "
        "opt-in, capped by max_pid_series).",
    )
    max_pid_series: int = setting(
        16, ge=1, le=256, description="Per-PID series per GPU at most, the largest memory holders first."
    )


@_section
class LogSettings:
    """Log level and line format."""

    level: Literal["debug", "info", "warn", "error"] = setting("info", description="Log level.")
    format: Literal["logfmt", "json"] = setting("logfmt", description="Log line format.")


@_section
class Settings:
    """Every option of the exporter, one section per concern; built and checked by load_settings."""

    web: WebSettings = setting(WebSettings())
    poll: PollSettings = setting(PollSettings())
    nvml: NvmlSettings = setting(NvmlSettings())
    metrics: MetricsSettings = setting(MetricsSettings())
    health: HealthSettings = setting(HealthSettings())
    pods: PodsSettings = setting(PodsSettings())
    processes: ProcessesSettings = setting(ProcessesSettings())
    log: LogSettings = setting(LogSettings())

    def validate(self) -> None:
        """Checks across sections (typedconfig.build runs it last)."""
        if self.poll.slow_interval < self.poll.fast_interval:
            raise ValueError("poll.slow_interval must be >= poll.fast_interval")
        if self.nvml.scenario is not None and self.nvml.backend != "sim":
            raise ValueError("nvml.scenario needs nvml.backend: sim (or the --sim flag)")


# Where the Prometheus exporter convention spells a flag differently from our derivation.
_FLAG_OVERRIDES = {"web.config_file": "--web.config.file"}


@dataclass(frozen=True)
class Option:
    """One leaf setting, with the names it goes by in each source."""

    section: str
    name: str
    field: Any  # the dataclasses.Field
    annotation: Any  # its resolved type

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        return _FLAG_OVERRIDES.get(self.key, f"--{self.section}.{self.name.replace('_', '-')}")

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.section.upper()}_{self.name.upper()}"

    @property
    def is_list(self) -> bool:
        return is_list(self.annotation)

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def description(self) -> str:
        return self.field.metadata["description"]


def options() -> Iterator[Option]:
    """Every leaf option of `Settings`, in declaration order."""
    for section_field, section_type in fields(Settings):
        for field, annotation in fields(section_type):
            yield Option(section_field.name, field.name, field, annotation)


def _split_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _env_layer(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    known = {opt.env: opt for opt in options()}
    layer: dict[str, dict[str, Any]] = {}
    mine = own_environment(environ, ENV_PREFIX)  # GPUWARDEN_FLEET_* is the fleet service's
    ignored = check_known(mine, known, "gpuwarden")
    for var, raw in mine.items():
        if var in ignored:
            continue
        opt = known[var]
        layer.setdefault(opt.section, {})[opt.name] = _split_list(raw) if opt.is_list else raw
    return layer


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: Path, what: str = "config file", flag: str = "--config") -> dict[str, Any]:
    """Read a YAML file; every failure becomes one ConfigError line naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror}); check the {flag} path") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None
    import yaml  # only where a file is read: a start without files does not pay for it

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{what} {path}: {problem}{where}; fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: top level must be a mapping of keys")
    return data


def load_settings(
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from all sources; raise ConfigError with one line on any problem. `defaults` ("section.key")
    sit below every source: a mode's own defaults (the simulator's loopback address), which any source overrides."""
    environ = os.environ if environ is None else environ
    layers: list[tuple[str, dict[str, Any]]] = []
    if defaults:
        default_layer: dict[str, dict[str, Any]] = {}
        for key, value in defaults.items():
            section, name = key.split(".", 1)
            default_layer.setdefault(section, {})[name] = value
        layers.append(("defaults", default_layer))
    if config_file is not None:
        layers.append((f"config file {config_file}", read_yaml(config_file)))
    layers.append(("environment", _env_layer(environ)))
    flag_layer: dict[str, dict[str, Any]] = {}
    for key, value in (flags or {}).items():
        section, name = key.split(".", 1)
        flag_layer.setdefault(section, {})[name] = value
    layers.append(("flags", flag_layer))

    merged: dict[str, Any] = {}
    for _source, layer in layers:
        merged = _merge(merged, layer)
    try:
        return build(Settings, merged)
    except SettingError as exc:
        raise ConfigError(exc.line(_source_of(exc, layers))) from None


def _source_of(exc: SettingError, layers: list[tuple[str, dict[str, Any]]]) -> str:
    """Name the highest-precedence source that set the offending key (for the error line)."""
    loc = list(exc.loc)
    for source, layer in reversed(layers):
        node: Any = layer
        for part in loc:
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            if loc:
                return source
    return "configuration"


__all__ = ["ConfigError", "Settings", "load_settings", "options"]
