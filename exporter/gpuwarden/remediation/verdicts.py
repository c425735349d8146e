"""The node's health as the systems that act need it: one verdict per condition family, over loopback HTTP.

The node's health as the systems that act need it: the exporter's /api/v1/health fetched over loopback (TLS and
basic auth as its web-config demands), reduced to one verdict per condition family.

Three outcomes, never more: `ok`, `problem` (with a message naming the GPU and the fault) and `unknown` (the
exporter could not be asked, could not see, or has not watched long enough: a check `pending` at a level that counts,
as after a start without the state file). Unknown is never read as recovery by the callers. Standard library and
PyYAML only, so that a command run every 30 s by node-problem-detector or slurmd starts in well under a second.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Condition families: the exporter's health checks each belongs to (exporter/gpuwarden/health/checks.py names them).
FAMILIES: dict[str, tuple[str, ...]] = {
    "hardware": ("gpu_lost", "ecc", "row_remap", "xid", "pcie"),
    "nvlink": ("nvlink",),
    "fabric": ("fabric",),
    "thermal": ("temperature", "thermal_throttling"),
    "driver": ("persistence_mode",),  # and NVML itself: see evaluate()
}
# The health checks no remediation family reports, each with why: a node is drained or conditioned for faults of the
# hardware or the driver, never for how a job uses the GPU. tests/test_npd_plugin.py fails when a check is in neither.
NOT_REMEDIATED: dict[str, str] = {
    "power": "a power cap or draw is the workload's or the operator's setting, not a fault of the node",
    "performance_state": "a low P-state follows the load; a stuck one shows in thermal or hardware",
    "memory_pressure": "a full GPU is the job's, not the node's: draining would not help",
    "utilization": "an idle or starved GPU is a scheduling matter",
    "bottleneck": "a job's bottleneck class is advice to its owner",
}
LEVELS = {"warning": 1, "critical": 2}
DEFAULT_URL = "http://127.0.0.1:10045"
MAX_BODY_BYTES = 4 * 1024 * 1024  # the document is ~11 KB for 8 GPUs
MAX_SNAPSHOT_AGE_S = 60.0  # an older snapshot means the exporter's poller is stuck: nothing current is known


class Unreachable(Exception):
    """The exporter could not be asked (refused, timed out, refused our credentials, answered nonsense)."""


@dataclass(frozen=True)
class Outcome:
    """One family's verdict: `ok`, `problem` or `unknown`, with one line for a person."""

    state: str
    message: str
    fault: str = ""  # a stable key of the fault (GPU and check), for state kept between runs


@dataclass(frozen=True)
class Endpoint:
    """How to reach the node's exporter: URL, the CA to trust, a client certificate, basic-auth credentials."""

    url: str = DEFAULT_URL
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str = ""
    password: str = ""
    timeout_s: float = 3.0


def endpoint_from(
    url: str | None,
    web_config: Path | None,
    ca_file: Path | None,
    cert_file: Path | None,
    key_file: Path | None,
    username: str,
    password_file: Path | None,
    timeout_s: float,
) -> Endpoint:
    """The endpoint the flags describe. With the exporter's web-config: https when it serves TLS (trusting its own
    certificate unless a CA is given), and credentials required when it asks for basic auth. Raises ValueError with
    one line naming the flag."""
    tls = False
    auth_required = False
    if web_config is not None:
        try:
            document = yaml.safe_load(web_config.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"--web.config.file {web_config}: {error}; give the exporter's web-config file") from None
        if not isinstance(document, dict):
            raise ValueError(f"--web.config.file {web_config}: not a mapping; give the exporter's web-config file")
        server_tls = document.get("tls_server_config") or {}
        tls = bool(server_tls)
        auth_required = bool(document.get("basic_auth_users"))
        if tls and ca_file is None and server_tls.get("cert_file"):
            ca_file = (web_config.parent / server_tls["cert_file"]).resolve()
    if url is None:
        url = DEFAULT_URL.replace("http://", "https://") if tls else DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--exporter-url {url!r}: give http://HOST:PORT or https://HOST:PORT")
    password = ""
    if password_file is not None:
        try:
            password = password_file.read_text().strip()
        except OSError as error:
            raise ValueError(f"--auth.password-file {password_file}: {error.strerror}") from None
    if auth_required and not (username and password):
        raise ValueError("the exporter's web-config asks for basic auth: give --auth.username and --auth.password-file")
    if (cert_file is None) != (key_file is None):
        raise ValueError("--tls.cert-file and --tls.key-file go together (a client certificate and its key)")
    return Endpoint(url.rstrip("/"), ca_file, cert_file, key_file, username, password, timeout_s)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """The exporter never redirects /api/v1/health: a redirect is refused, never followed (following one sent the
    basic-auth credentials to another host and acted on its answer)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201, PLR0913 - urllib's
        raise Unreachable(f"exporter answered a redirect (HTTP {code}): not followed")


class _DeadlineExceeded(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """One deadline for the whole exchange (connect, TLS, headers, body): urllib's timeout applies to each socket
    operation, so an answer trickled a byte a second kept the commands running past NPD's and slurmd's limits.
    A real-time timer (SIGALRM) in the main thread, where these commands run; elsewhere only the per-operation
    timeout holds."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame) -> None:  # noqa: ANN001
        raise _DeadlineExceeded

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fetch(endpoint: Endpoint) -> dict[str, Any]:
    """The exporter's /api/v1/health, or Unreachable with the reason: whatever the other end does (a wrong shape,
    a redirect, a protocol it does not speak, a trickle), the answer is a document of the expected shape or
    Unreachable, within `timeout_s` in all."""
    request = urllib.request.Request(f"{endpoint.url}/api/v1/health", headers={"Accept": "application/json"})
    if endpoint.username:
        token = base64.b64encode(f"{endpoint.username}:{endpoint.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = None
    if endpoint.url.startswith("https://"):
        try:
            context = ssl.create_default_context(cafile=str(endpoint.ca_file) if endpoint.ca_file else None)
            if endpoint.ca_file is not None:
                # a pinned certificate (the exporter's own, or a private CA's) on loopback: the name is not the point;
                # and the exporter's certificate itself may be what is trusted, though a CA issued it (the chart
                # trusts the served certificate): a partial chain ends at a trusted certificate, as Python 3.13
                # does by default and 3.11/3.12 do not
                context.check_hostname = False
                context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
            if endpoint.cert_file is not None:
                context.load_cert_chain(str(endpoint.cert_file), str(endpoint.key_file))
        except (OSError, ssl.SSLError, ValueError) as error:
            raise Unreachable(f"TLS settings unusable: {error}") from None
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),  # loopback: never through a proxy from the environment
        urllib.request.HTTPSHandler(context=context),
        _NoRedirect(),
    )
    try:
        with _deadline(endpoint.timeout_s), opener.open(request, timeout=endpoint.timeout_s) as response:
            body = response.read(MAX_BODY_BYTES + 1)
    except _DeadlineExceeded:
        raise Unreachable(f"exporter timed out: no complete answer within {endpoint.timeout_s:g} s") from None
    except urllib.error.HTTPError as error:
        hint = " (check --auth.username and --auth.password-file)" if error.code == 401 else ""
        raise Unreachable(f"exporter answered HTTP {error.code}{hint}") from None
    except (urllib.error.URLError, OSError, ssl.SSLError) as error:
        reason = getattr(error, "reason", error)
        raise Unreachable(f"exporter unreachable: {reason}") from None
    except (http.client.HTTPException, ValueError) as error:  # not HTTP/1.x: a banner, HTTP/0.9, too many headers
        raise Unreachable(f"exporter answered something other than HTTP ({type(error).__name__})") from None
    if len(body) > MAX_BODY_BYTES:
        raise Unreachable(f"exporter answered more than {MAX_BODY_BYTES} bytes: not a health document")
    try:
        return checked(json.loads(body))
    except (ValueError, RecursionError):
        raise Unreachable("exporter answered something other than /api/v1/health JSON") from None
    except TypeError as error:
        raise Unreachable(f"exporter answered an unexpected health document ({error})") from None


def checked(document: Any) -> dict[str, Any]:
    """The document, once every field the verdicts read has the type they read it as; TypeError naming the field
    otherwise (a wrong type must be Unknown, never a traceback that NPD reads as a problem)."""

    def need(value: Any, kinds: type | tuple[type, ...], field: str) -> Any:
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
            raise TypeError(f"{field} is {type(value).__name__}")
        return value

    need(document, dict, "the document")
    if not math.isfinite(need(document.get("taken_at", 0), (int, float), "taken_at")):
        raise TypeError("taken_at is not a finite number")
    need(document.get("nvml_up", False), bool, "nvml_up")
    need(document.get("nvml_error"), (str, type(None)), "nvml_error")
    need(document.get("gpus_expected"), (int, type(None)), "gpus_expected")
    skipped = need(document.get("gpus_skipped") or {}, dict, "gpus_skipped")
    for index, reason in skipped.items():
        need(reason, str, "gpus_skipped")
        if not str(index).isdigit():
            raise TypeError("gpus_skipped has a key that is not a GPU index")
    for gpu in need(document.get("gpus"), list, "gpus"):
        need(gpu, dict, "gpus[]")
        need(gpu.get("index"), int, "gpus[].index")
        need(gpu.get("stale", False), bool, "gpus[].stale")
        for verdict in need(gpu.get("checks") or {}, dict, "gpus[].checks").values():
            need(verdict, dict, "gpus[].checks[]")
            need(verdict.get("level", 0), int, "gpus[].checks[].level")
            need(verdict.get("severity", ""), str, "gpus[].checks[].severity")
            need(verdict.get("pending_level") or 0, int, "gpus[].checks[].pending_level")
            need(verdict.get("observed", ""), str, "gpus[].checks[].observed")
            need(verdict.get("since") or 0, (int, float), "gpus[].checks[].since")
    return document


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _fit(text: str, limit: int) -> str:
    """`text` cut to `limit` bytes of UTF-8 without splitting a character (NPD cuts bytes, not characters)."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore").rstrip() + "..."


def _message(faults: list[tuple[int, float, str, str]], limit: int) -> str:
    """The worst fault first ("GPU1 ecc: 2 uncorrected (volatile)"), and how many more, within `limit` bytes."""
    first = faults[0][3]
    more = f" (+{len(faults) - 1} more)" if len(faults) > 1 else ""
    return _fit(first, limit - len(more.encode())) + more


Finding = tuple[int, float, str, str]  # level, since, key, text


def _findings(
    gpus: list[dict[str, Any]], checks: tuple[str, ...], min_level: int
) -> tuple[list[Finding], list[Finding]]:
    """The family's checks at `min_level` or worse (faults), and those pending that could reach it once watched (an
    exporter that does not say which level: any)."""
    faults: list[Finding] = []
    pending: list[Finding] = []
    for gpu in gpus:
        for check, verdict in (gpu.get("checks") or {}).items():
            if check not in checks:
                continue
            key = f"GPU{gpu['index']} {check}"
            if verdict.get("level", 0) >= min_level:
                faults.append((verdict["level"], verdict.get("since") or 0.0, key, f"{key}: {verdict['observed']}"))
            elif verdict.get("severity") == "pending" and (verdict.get("pending_level") or 2) >= min_level:
                pending.append((verdict.get("pending_level") or 2, 0.0, key, f"{key} pending: {verdict['observed']}"))
    return faults, pending


def _missing_gpus(document: dict[str, Any], faults: list[Finding], stale: list[int]) -> None:
    """GPUs absent from the readings: lost before discovery, hung at it, or fewer than nvml.expected_gpus."""
    skipped = document.get("gpus_skipped") or {}
    for index, reason in sorted(skipped.items()):
        if reason in ("gpu_is_lost", "lost"):
            key = f"GPU{index} gpu_lost"
            faults.append((2, 0.0, key, f"{key}: fell off the bus before the exporter started"))
        elif reason == "timeout":  # hung at discovery: not observed, which is Unknown unless a fault is seen
            stale.append(int(index))
    expected = document.get("gpus_expected")
    counted = len(document["gpus"]) + len(skipped)
    if expected and counted < expected:
        faults.append((2, 0.0, "gpu_count", f"{counted} of {expected} GPUs counted by NVML: GPU(s) missing"))


def evaluate(document: dict[str, Any], family: str, min_level: int, now: float, limit: int = 80) -> Outcome:
    """One family's outcome from the exporter's health document."""
    taken_at = float(document.get("taken_at") or 0.0)
    if taken_at <= 0:
        return Outcome("unknown", "exporter starting: no reading yet")
    if now - taken_at > MAX_SNAPSHOT_AGE_S:
        return Outcome("unknown", _fit(f"exporter's last reading is {now - taken_at:.0f} s old (poller stuck)", limit))
    if not document.get("nvml_up"):
        if family == "driver":
            return Outcome(
                "problem", _fit(f"NVML down: {document.get('nvml_error') or 'unknown error'}", limit), "nvml"
            )
        return Outcome("unknown", "NVML down: GPUs cannot be read (see the driver condition)")
    gpus = document["gpus"]
    faults, pending = _findings(gpus, FAMILIES[family], min_level)
    stale = [gpu["index"] for gpu in gpus if gpu.get("stale")]
    if family == "hardware":
        _missing_gpus(document, faults, stale)
    if faults:
        faults.sort(key=lambda f: (-f[0], f[1]))
        return Outcome("problem", _message(faults, limit), faults[0][2])
    if pending:  # could be a fault that lasted through a restart, or one beginning now: not watched long enough
        pending.sort(key=lambda f: (-f[0], f[2]))
        return Outcome("unknown", _message(pending, limit))
    if stale:
        return Outcome("unknown", _fit(f"GPU {','.join(map(str, stale))} readings stale: not observed", limit))
    return Outcome("ok", f"{len(gpus)} GPU(s): no {family} fault")


def outcomes(endpoint: Endpoint, families: list[str], min_level: int, limit: int = 80) -> list[Outcome]:
    """Ask the exporter once and judge each family; Unknown for all where it cannot be asked."""
    try:
        document = fetch(endpoint)
    except Unreachable as error:
        return [Outcome("unknown", _fit(str(error), limit))] * len(families)
    now = time.time()
    try:
        return [evaluate(document, family, min_level, now, limit) for family in families]
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # a shape checked() let through: Unknown
        return [Outcome("unknown", _fit(f"exporter answered an unexpected health document ({error})", limit))] * len(
            families
        )


def outcome(endpoint: Endpoint, family: str, min_level: int, limit: int = 80) -> Outcome:
    """Ask the exporter and judge one family."""
    return outcomes(endpoint, [family], min_level, limit)[0]
