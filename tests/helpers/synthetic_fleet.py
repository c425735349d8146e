"""A synthetic GPU fleet's history, for the fleet service's scale bench (bench/fleet_scale.py) and its
two-backend test (tests/test_fleet_backends.py): N nodes × 8 GPUs with the series a gpuwarden scrape gives them.

~385 series per node (the simulator's 8-GPU node exports 369), in the families every fleet query and critical
rule reads, labelled as the chart's ServiceMonitor labels them (job, instance, node). Three tiers, so that a
10,000-node fleet fits a build machine while every query sees what it would see in production:
- range-read families (the utilization counters, processes, pod allocation, NVLink active links, bottleneck
  classes), which views and rules read over windows: `hours` of history at `range_step` (120 s: rate() over 5 m keeps two samples);
- every other family, read at an instant (5 m lookback): `instant_minutes` of history at `instant_step` (240 s);
- optionally the recording rules' series (alert_rules/gpuwarden.recording.yaml), exactly as the shipped rules
  evaluate over this data (linear counters: every rate is the GPU's duty), every 60 s over `recorded_minutes`.
All tiers run `ahead_minutes` past the start, so "now" stays inside the data while a benchmark runs.
Every GPU has a bottleneck class (GPM). About 2 % of GPUs are unhealthy, 0.6 % have hardware findings, 5 % are idle, 5 % starved.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpuwarden.fleet import recording
from gpuwarden.health.checks import CHECKS
from gpuwarden.health.thresholds import DEFAULT

GPUS = 8
LINKS = 18
MEMORY = 85520809984
HARDWARE = ("ecc", "nvlink", "lost", "remap", "xid")
DUTY = {"idle": 0.0, "starved": 0.25, "busy": 0.93, "unhealthy": 0.6, "hardware": 0.0}
# the bottleneck class (GPM) each kind of GPU is in
CLASS = {"idle": "idle", "starved": "waiting", "busy": "tensor_bound", "unhealthy": "memory_bound", "hardware": "idle"}


@dataclass
class Fleet:
    nodes: int
    now: int  # the instant the tiers are laid around (Unix seconds)
    hours: float = 6.0
    instant_minutes: int = 30
    recorded_minutes: int = 120
    ahead_minutes: int = 90
    range_step: int = 120
    instant_step: int = 240
    recorded_step: int = recording.INTERVAL_S
    seed: int = 7
    kind: dict[tuple[int, int], str] = field(default_factory=dict)
    hardware: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        for key in self.gpus():
            roll = rng.random()
            self.kind[key] = (
                "hardware" if roll < 0.006 else "unhealthy" if roll < 0.026 else "idle" if roll < 0.076
                else "starved" if roll < 0.126 else "busy"
            )  # fmt: skip
        hardware_gpus = [k for k in self.gpus() if self.kind[k] == "hardware"]
        self.hardware = {key: HARDWARE[i % len(HARDWARE)] for i, key in enumerate(hardware_gpus)}
        self.history_start = self.now - int(self.hours * 3600)
        self.end = self.now + self.ahead_minutes * 60
        self.link_drop = self.now - 3600  # an NVLink finding's link went down an hour before now

    def gpus(self) -> Iterator[tuple[int, int]]:
        return ((n, g) for n in range(self.nodes) for g in range(GPUS))

    def node_name(self, n: int) -> str:
        return f"gpu-node-{n:05d}"

    def labels(self, n: int, g: int | None = None, **extra: str) -> str:
        name = self.node_name(n)
        parts = [f'job="gpuwarden",instance="{name}:10045",node="{name}"']
        if g is not None:
            parts.append(f'gpu="{g}",uuid="GPU-{n:05d}-{g}"')
        parts += [f'{k}="{v}"' for k, v in extra.items()]
        return "{" + ",".join(parts) + "}"

    def duty(self, key: tuple[int, int]) -> float:
        return DUTY[self.kind[key]]

    def processes(self, key: tuple[int, int]) -> int:
        return 0 if self.kind[key] == "idle" else 1

    def health(self, n: int, g: int, check: str) -> int:
        kind = self.kind[(n, g)]
        if kind == "hardware":
            wanted = {"ecc": "ecc", "nvlink": "nvlink", "lost": "gpu_lost", "remap": "row_remap", "xid": "xid"}
            return 2 if check == wanted[self.hardware[(n, g)]] else 0
        if kind == "unhealthy":
            return 1 if check == ("temperature", "power", "pcie")[g % 3] else 0
        if kind == "starved":
            return 1 if check == "utilization" else 0
        return 0

    def namespace(self, n: int) -> str:
        return f"team-{n % 50:02d}"

    # -- the history, as exposition lines -------------------------------------------------------------------------

    def lines(self, ts: Callable[[int], str], recorded: bool = True) -> Iterator[str]:
        """Every series' samples, one series after another (each series' samples in time order), as exposition
        text lines: `ts` formats a Unix time (seconds for OpenMetrics backfill, milliseconds for VictoriaMetrics'
        import). Yields chunks of text, a series at a time."""
        ranged = range(self.history_start, self.end + 1, self.range_step)
        instant = range(self.now - self.instant_minutes * 60, self.end + 1, self.instant_step)
        # the last poll's time is read as an age (stale after 60 s): at the chart's 15 s scrape interval
        scraped = range(self.now - self.instant_minutes * 60, self.end + 1, 15)
        fixed_instant = [ts(t) for t in instant]
        nodes, gpus = range(self.nodes), list(self.gpus())

        def constant(family: str, type_: str, rows: Iterator[tuple[str, object]]) -> Iterator[str]:
            yield f"# TYPE {family} {type_}\n"
            for head, value in rows:
                yield "".join(f"{head} {value} {t}\n" for t in fixed_instant)

        def moving(family: str, type_: str, rows: Iterator[tuple[str, Callable[[int], object]]], times: range):
            yield f"# TYPE {family} {type_}\n"
            for head, value in rows:
                yield "".join(f"{head} {value(t)} {ts(t)}\n" for t in times)

        lab = self.labels
        yield from constant("up", "gauge", ((f"up{lab(n)}", 1) for n in nodes))
        yield from constant(
            "gpuwarden_build_info", "gauge",
            ((f"gpuwarden_build_info{lab(n, version='0.1.0', nvml_python_version='13.580.82')}", 1) for n in nodes),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_driver_info", "gauge",
            ((f"gpuwarden_driver_info{lab(n, driver_version='580.159.04' if n % 10 else '570.172.08', cuda_driver_version='13.0', nvml_version='13.580.159.04')}", 1) for n in nodes),
        )  # fmt: skip
        yield from constant("gpuwarden_nvml_up", "gauge", ((f"gpuwarden_nvml_up{lab(n)}", 1) for n in nodes))
        yield from constant("gpuwarden_gpus", "gauge", ((f"gpuwarden_gpus{lab(n)}", GPUS) for n in nodes))
        yield from moving(
            "gpuwarden_last_collect_timestamp_seconds", "gauge",
            ((f"gpuwarden_last_collect_timestamp_seconds{lab(n, tier=tier)}", lambda t: t - 1)
             for n in nodes for tier in ("fast", "slow")),
            scraped,
        )  # fmt: skip
        yield from constant(
            "gpuwarden_gpu_info", "gauge",
            ((f"gpuwarden_gpu_info{lab(n, g, name=self.model(n), serial=f'{n}{g}', pci_bus_id=f'00000000:{g:02X}:00.0', vbios_version='96.00.99.00.01', compute_capability='9.0')}", 1)
             for n, g in gpus),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_memory_total_bytes", "gauge",
            ((f"gpuwarden_memory_total_bytes{lab(n, g)}", self.memory(n)) for n, g in gpus),
        )  # fmt: skip
        start = self.history_start
        yield from moving(
            "gpuwarden_busy_seconds", "counter",
            ((f"gpuwarden_busy_seconds_total{lab(n, g)}", _busy(start, self.duty((n, g)))) for n, g in gpus),
            ranged,
        )  # fmt: skip
        yield from moving(
            "gpuwarden_utilization_sampled_seconds", "counter",
            ((f"gpuwarden_utilization_sampled_seconds_total{lab(n, g)}", lambda t: f"{t - start:.1f}") for n, g in gpus),
            ranged,
        )  # fmt: skip
        yield from moving(
            "gpuwarden_processes", "gauge",
            ((f"gpuwarden_processes{lab(n, g)}", _constant(self.processes((n, g)))) for n, g in gpus),
            ranged,
        )  # fmt: skip
        yield from moving(
            "gpuwarden_gpu_allocation", "gauge",
            ((f"gpuwarden_gpu_allocation{lab(n, g, namespace=self.namespace(n), pod=f'job-{n}', container='main')}", lambda t: 1)
             for n, g in gpus if self.kind[(n, g)] != "idle"),
            ranged,
        )  # fmt: skip

        def active(key: tuple[int, int]) -> Callable[[int], int]:
            down = self.hardware.get(key) == "nvlink"
            return lambda t: LINKS - 1 if down and t >= self.link_drop else LINKS

        yield from moving(
            "gpuwarden_nvlink_active_links", "gauge",
            ((f"gpuwarden_nvlink_active_links{lab(n, g)}", active((n, g))) for n, g in gpus),
            ranged,
        )  # fmt: skip
        yield from constant(
            "gpuwarden_nvlink_links", "gauge", ((f"gpuwarden_nvlink_links{lab(n, g)}", LINKS) for n, g in gpus)
        )
        yield from constant(
            "gpuwarden_nvlink_up", "gauge",
            ((f"gpuwarden_nvlink_up{lab(n, g, link=str(link))}", 0 if self.hardware.get((n, g)) == "nvlink" and link == 7 else 1)
             for n, g in gpus for link in range(LINKS)),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_health", "gauge",
            ((f"gpuwarden_health{lab(n, g, check=c)}", self.health(n, g, c)) for n, g in gpus for c in CHECKS),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_health_since_timestamp_seconds", "gauge",
            ((f"gpuwarden_health_since_timestamp_seconds{lab(n, g, check=c)}", self.now - 1800)
             for n, g in gpus for c in CHECKS if self.health(n, g, c)),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_gpu_up", "gauge",
            ((f"gpuwarden_gpu_up{lab(n, g)}", 0 if self.hardware.get((n, g)) == "lost" else 1) for n, g in gpus),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_ecc_errors", "counter",
            ((f"gpuwarden_ecc_errors_total{lab(n, g, type=t)}", 3 if t == "uncorrected" and self.hardware.get((n, g)) == "ecc" else 0)
             for n, g in gpus for t in ("corrected", "uncorrected")),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_remapped_rows_failed", "gauge",
            ((f"gpuwarden_remapped_rows_failed{lab(n, g)}", 1 if self.hardware.get((n, g)) == "remap" else 0) for n, g in gpus),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_remapped_rows_pending",
            "gauge",
            ((f"gpuwarden_remapped_rows_pending{lab(n, g)}", 0) for n, g in gpus),
        )
        yield from constant(
            "gpuwarden_recovery_action", "gauge", ((f"gpuwarden_recovery_action{lab(n, g)}", 0) for n, g in gpus)
        )
        yield from constant(
            "gpuwarden_temperature_celsius", "gauge",
            ((f"gpuwarden_temperature_celsius{lab(n, g)}", 84 if self.kind[(n, g)] == "unhealthy" and g % 3 == 0 else 55) for n, g in gpus),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_throttle_seconds", "counter",
            ((f"gpuwarden_throttle_seconds_total{lab(n, g, reason=r)}", 0) for n, g in gpus for r in ("hw_thermal_slowdown", "sw_thermal_slowdown")),
        )  # fmt: skip
        yield from constant(
            "gpuwarden_xid_last_timestamp_seconds", "gauge",
            ((f"gpuwarden_xid_last_timestamp_seconds{lab(n, g, xid='79')}", self.now - 3600)
             for n, g in gpus if self.hardware.get((n, g)) == "xid"),
        )  # fmt: skip
        yield from moving(  # the recording rules join it every minute: read over windows
            "gpuwarden_bottleneck_info", "gauge",
            ((f"gpuwarden_bottleneck_info{lab(n, g, **{'class': CLASS[self.kind[(n, g)]]})}", _constant(1)) for n, g in gpus),
            ranged,
        )  # fmt: skip
        if recorded:
            yield from self.recorded_lines(ts)

    def recorded_lines(self, ts: Callable[[int], str], names: set[str] | None = None) -> Iterator[str]:
        """The recording rules' series as the shipped rules evaluate them over this history (checked against the
        rules' own expressions by the bench: bench/fleet_scale.py, recorded_vs_rules); `names` keeps only those."""
        instants = range(self.now - self.recorded_minutes * 60, self.end + 1, self.recorded_step)
        times = [ts(t) for t in instants]
        ratio = DEFAULT.utilization_low_ratio

        def series(name: str, labels: str, value: object) -> str:
            if names is not None and name not in names:
                return ""
            if callable(value):
                return "".join(f"{name}{labels} {value(t)} {ts(t)}\n" for t in instants)
            return "".join(f"{name}{labels} {value} {t}\n" for t in times)

        def finding(n: int, g: int, alert: str, value: object, **extra: str) -> str:
            return series(recording.CORDON, self.labels(n, g, **extra, alertname=alert), value)

        for n in range(self.nodes):
            keys = [(n, g) for g in range(GPUS)]
            yield series(recording.SAMPLED, self.labels(n), GPUS)
            yield series(recording.BUSY, self.labels(n), f"{sum(self.duty(k) for k in keys):g}")
            yield series(recording.GPUS, self.labels(n), GPUS)
            yield series(recording.NODE_MODELS, self.labels(n, name=self.model(n)), GPUS)
            yield series(recording.NODE_MEMORY, self.labels(n, name=self.model(n)), self.memory(n))
            classes: dict[str, int] = {}
            for k in keys:
                classes[CLASS[self.kind[k]]] = classes.get(CLASS[self.kind[k]], 0) + 1
                if self.duty(k) < ratio:
                    name = recording.GPU_IDLE if self.processes(k) == 0 else recording.GPU_STARVED
                    yield series(name, self.labels(*k), f"{self.duty(k):g}")
                hardware = self.hardware.get(k)
                if hardware == "lost":
                    yield finding(*k, "GpuwardenGpuLost", 0)
                elif hardware == "ecc":
                    yield finding(*k, "GpuwardenEccUncorrectable", 3, type="uncorrected")
                elif hardware == "remap":
                    yield finding(*k, "GpuwardenRowRemapFailure", 1)
                elif hardware == "xid":  # time() - the last critical XID's time, while under a day
                    yield finding(*k, "GpuwardenXidCritical", lambda t: t - (self.now - 3600), xid="79")
                for check in CHECKS:
                    if level := self.health(*k, check):
                        yield series(recording.HEALTH, self.labels(*k, check=check, health_rule=check), level)
            for name, count in sorted(classes.items()):
                yield series(recording.NODE_CLASSES, self.labels(n, **{"class": name}), count)
        sampled: dict[str, float] = {}
        idle: dict[str, float] = {}
        ns_classes: dict[tuple[str, str], int] = {}
        for key in self.gpus():
            if self.kind[key] == "idle":
                continue  # no pod holds it: no allocation series
            ns = self.namespace(key[0])
            sampled[ns] = sampled.get(ns, 0.0) + 1.0
            idle[ns] = idle.get(ns, 0.0) + 1.0 - self.duty(key)
            ns_classes[(ns, CLASS[self.kind[key]])] = ns_classes.get((ns, CLASS[self.kind[key]]), 0) + 1
        by_class: dict[str, float] = {}
        for key in self.gpus():
            by_class[CLASS[self.kind[key]]] = by_class.get(CLASS[self.kind[key]], 0.0) + 1.0 - self.duty(key)
        for name, idle_rate in sorted(by_class.items()):
            yield series(recording.CLASS_IDLE, f'{{job="gpuwarden",class="{name}"}}', f"{idle_rate:g}")
        for ns in sorted(sampled):
            yield series(recording.NS_SAMPLED, f'{{job="gpuwarden",namespace="{ns}"}}', f"{sampled[ns]:g}")
            yield series(recording.NS_IDLE, f'{{job="gpuwarden",namespace="{ns}"}}', f"{idle[ns]:g}")
        for (ns, name), count in sorted(ns_classes.items()):
            yield series(recording.NS_CLASSES, f'{{job="gpuwarden",namespace="{ns}",class="{name}"}}', count)

    def model(self, n: int) -> str:
        return "NVIDIA H100 80GB HBM3" if n % 4 else "NVIDIA H200"

    def memory(self, n: int) -> int:
        return MEMORY if n % 4 else 150754820096

    def truth(self) -> dict[str, int]:
        kinds = list(self.kind.values())
        return {
            "gpus": len(kinds),
            "hardware_gpus": len(self.hardware),
            "hardware_by_kind": {h: sum(1 for v in self.hardware.values() if v == h) for h in HARDWARE},
            "unhealthy_gpus": kinds.count("unhealthy"),
            "idle_gpus": kinds.count("idle"),
            "starved_gpus": kinds.count("starved") + kinds.count("hardware"),  # a job holds them, at duty 0
            "gpus_by_class": {c: sum(1 for k in kinds if CLASS[k] == c) for c in sorted(set(CLASS.values()))},
        }


def _busy(start: int, duty: float) -> Callable[[int], str]:
    return lambda t: f"{(t - start) * duty:.1f}"


def _constant(value: int) -> Callable[[int], int]:
    return lambda t: value
