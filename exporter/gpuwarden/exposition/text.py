"""Metric families in the Prometheus text format and OpenMetrics, byte for byte as prometheus_client writes them.

Metric families in the Prometheus text format (0.0.4) and OpenMetrics 1.0, byte for byte as prometheus_client
writes them, and the exporter's own process_* families.

Why not prometheus_client in the serving process: importing any part of it imports its HTTP servers, urllib,
wsgiref and email (~3 MiB of resident memory and ~30 ms at start on the GPU host, docs/benchmarks.md, Footprint),
which a node exporter held to the footprint of the lightest peer cannot carry for two string formats. The fleet
service and the tests still use prometheus_client; tests/test_exposition.py renders every shipped scenario, odd
label values and special floats with both and fails on any byte of difference.

What is written is what the exporter exports: gauges and counters with legacy-valid names (checked by the metric
contract tests), label values escaped (backslash, newline, double quote), labels sorted by name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the classic format every scraper understands


class Family:
    """One metric family: its exposition name (a counter's ends in _total), help, type, label names, samples."""

    __slots__ = ("name", "help", "type", "labels", "samples")

    def __init__(self, name: str, help_text: str, metric_type: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.type, self.labels = name, help_text, metric_type, tuple(labels)
        self.samples: list[tuple[Sequence[str], float]] = []

    def add(self, values: Sequence[str], value: float) -> None:
        self.samples.append((values, value))


def go_float(value: float) -> str:
    """A sample value as Go (and so Prometheus and prometheus_client) prints it."""
    number = float(value)
    if number == math.inf:
        return "+Inf"
    if number == -math.inf:
        return "-Inf"
    if math.isnan(number):
        return "NaN"
    text = repr(number)
    dot = text.find(".")
    if number > 0 and dot > 6:  # Go switches to an exponent sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str, quotes: bool) -> str:
    escaped = text.replace("\\", "\\\\").replace("\n", "\\n")
    return escaped.replace('"', '\\"') if quotes else escaped


def _samples(family: Family, sample_name: str, out: list[str]) -> None:
    names = family.labels
    for values, value in family.samples:
        if names:
            pairs = sorted(zip(names, values, strict=False))
            labels = "{" + ",".join(f'{name}="{_escape_value(text)}"' for name, text in pairs) + "}"
        else:
            labels = ""
        out.append(f"{sample_name}{labels} {go_float(value)}\n")


def _base_name(family: Family) -> str:
    return family.name[:-6] if family.type == "counter" and family.name.endswith("_total") else family.name


def sample_name(family: Family) -> str:
    """The name its samples carry in the text format (a counter's with _total)."""
    return _base_name(family) + "_total" if family.type == "counter" else family.name


def text_format(families: Iterable[Family]) -> bytes:
    """The Prometheus text format 0.0.4 (prometheus_client.generate_latest's output)."""
    out: list[str] = []
    for family in families:
        name = sample_name(family)
        out.append(f"# HELP {name} {_escape_help(family.help, quotes=False)}\n")
        out.append(f"# TYPE {name} {family.type}\n")
        _samples(family, name, out)
    return "".join(out).encode("utf-8")


def openmetrics_format(families: Iterable[Family]) -> bytes:
    """OpenMetrics 1.0 (prometheus_client.openmetrics.exposition.generate_latest's output)."""
    out: list[str] = []
    for family in families:
        base = _base_name(family)
        out.append(f"# HELP {base} {_escape_help(family.help, quotes=True)}\n")
        out.append(f"# TYPE {base} {family.type}\n")
        _samples(family, base + "_total" if family.type == "counter" else base, out)
    out.append("# EOF\n")
    return "".join(out).encode("utf-8")


class ProcessFamilies:
    """process_* of this process from /proc (the families prometheus_client's ProcessCollector exports, with its
    names, help and units), read at each render; none where /proc cannot be read."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._pagesize = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._boot_time = self._read_boot_time()

    def _read_boot_time(self) -> float:
        try:
            with open(os.path.join(self._proc, "stat"), "rb") as stat:
                for line in stat:
                    if line.startswith(b"btime "):
                        return float(line.split()[1])
        except OSError:
            pass
        return 0.0

    def collect(self) -> list[Family]:
        if not self._boot_time:
            return []
        own = os.path.join(self._proc, "self")
        families: list[Family] = []
        try:
            with open(os.path.join(own, "stat"), "rb") as stat:
                parts = stat.read().split(b")")[-1].split()
            families += [
                _single("process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge", float(parts[20])),
                _single(
                    "process_resident_memory_bytes",
                    "Resident memory size in bytes.",
                    "gauge",
                    float(parts[21]) * self._pagesize,
                ),
                _single(
                    "process_start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    "gauge",
                    float(parts[19]) / self._ticks + self._boot_time,
                ),
                _single(
                    "process_cpu_seconds_total",
                    "Total user and system CPU time spent in seconds.",
                    "counter",
                    (float(parts[11]) + float(parts[12])) / self._ticks,
                ),
            ]
        except (OSError, IndexError, ValueError):
            pass
        try:
            max_fds = None
            with open(os.path.join(own, "limits"), "rb") as limits:
                for line in limits:
                    if line.startswith(b"Max open file"):
                        max_fds = float(line.split()[3])
                        break
            open_fds = len(os.listdir(os.path.join(own, "fd")))
            families.append(_single("process_open_fds", "Number of open file descriptors.", "gauge", open_fds))
            if max_fds is not None:
                families.append(
                    _single("process_max_fds", "Maximum number of open file descriptors.", "gauge", max_fds)
                )
        except (OSError, IndexError, ValueError):
            pass
        return families


def _single(name: str, help_text: str, metric_type: str, value: float) -> Family:
    family = Family(name, help_text, metric_type)
    family.add((), value)
    return family
