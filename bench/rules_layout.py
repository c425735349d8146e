"""A day of gpuwarden's rule inputs laid out as Prometheus holds one, for bench/rules_cost.py: a fleet of N copies
of a scraped node with noisy values (counters by each scrape's own interval, utilization that wanders, throttling
on some GPUs, rare errors, exporter restarts that reset counters; walking temperatures and memory), the alert rules'
history records over the day, and the remote-write wire format (protobuf in an uncompressed snappy stream, by hand:
no dependency) that fills the head in time order and feeds it live."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.health.rules import HISTORY_INTERVAL_S, NODE_GPUS_MAX, NVLINK_ACTIVE_MAX

STEP = 15
BLOCK_S, DAY_S = 7200, 86400
BLOCKS_SPAN_S = DAY_S + 2 * 3600  # before the head: a day and the windows' slack
SLICE_S = 1800  # a backfill request's time span (the head takes samples up to 1 h behind its newest)
SERIES_PER_REQUEST = 4000
RESTARTED_SHARE = 0.01

# how each family moves (every other one holds its value)
WALKING_INTEGERS = {"gpuwarden_temperature_celsius": (45, 85), "gpuwarden_memory_temperature_celsius": (50, 90)}
RARE_COUNTERS = {
    "gpuwarden_ecc_errors_total",
    "gpuwarden_pcie_replay_errors_total",
    "gpuwarden_nvlink_gpu_errors_total",
}
# The GPUs whose error counters move at all: 0.5 %. Meta's Llama 3 405B run (16,384 H100, 54 days) lost 419 jobs
# to unexpected failures, 148 to faulty GPUs and 72 to HBM3: about 2.5e-4 GPU faults per GPU and day. 0.5 % of the
# fleet erring at once is some twenty days of that, a fleet that repairs slowly: the rule manager's cost grows with
# the alerts it holds (each active alert's annotations are rendered at every evaluation), and an error increment on
# every GPU's counters over a day (as this bench had it, 2e-4 a scrape on every series: 9 % of GPUs with
# uncorrectable ECC errors, 1 in 12 GPUs paging) is a fleet on fire, not one to size the rules for.
FAULTY_GPU_SHARE = 0.005
FAULTY_ERROR_CHANCE = 2e-3  # a faulty GPU's error counter moves in one scrape of 500 (about every 2 h)


def head_start(now: int) -> int:
    """The 2 h boundary Prometheus' head starts at: its span is 1-3 h."""
    boundary = now - now % BLOCK_S
    return boundary if now - boundary >= 3600 else boundary - BLOCK_S


# --- the remote-write wire format, by hand: protobuf WriteRequest in an uncompressed snappy stream -----------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + varint(len(payload)) + payload


def labels_bytes(labels: dict[str, str]) -> bytes:
    return b"".join(field(0x0A, field(0x0A, k.encode()) + field(0x12, v.encode())) for k, v in sorted(labels.items()))


def snappy_literal(data: bytes) -> bytes:
    """A valid snappy block holding `data` as literals (Prometheus' decoder reads any valid stream)."""
    out, chunk = [varint(len(data))], 1 << 20
    for start in range(0, len(data), chunk):
        part = data[start : start + chunk]
        out.append(bytes([62 << 2]) + (len(part) - 1).to_bytes(3, "little") + part)
    return b"".join(out)


PACK_DOUBLE = struct.Struct("<d").pack


def sample_parts(t: int) -> tuple[bytes, bytes]:
    """A Sample's bytes around its value at `t` (seconds): the field's tag and length, then the timestamp (ms)."""
    stamp = b"\x10" + varint(t * 1000)
    return bytes([0x12, 9 + len(stamp), 0x09]), stamp


class Series:
    """One series of the fleet: its encoded labels, its value, and how the value moves."""

    __slots__ = ("head", "value", "kind", "gpu_index", "rate", "reset_at")

    def __init__(self, labels: dict[str, str], value: float, kind: str, gpu_index: int) -> None:
        self.head, self.value, self.kind, self.gpu_index = labels_bytes(labels), value, kind, gpu_index
        self.rate, self.reset_at = 0.0, None

    def next(self, rng: random.Random, t: int, busy: float) -> float:
        kind = self.kind
        if self.reset_at is not None and self.reset_at <= t and kind.startswith("counter"):
            self.value, self.reset_at = 0.0, None
        if kind == "counter_sampled":
            self.value += STEP + rng.uniform(-0.3, 0.3)
        elif kind == "counter_busy":
            self.value += (STEP + rng.uniform(-0.3, 0.3)) * busy
        elif kind == "counter_throttle":
            if self.rate:
                self.value += STEP * min(1.0, max(0.0, self.rate + rng.uniform(-0.1, 0.1)))
        elif kind == "counter_rare":
            if rng.random() < self.rate:
                self.value += rng.randint(1, 5)
        elif kind in WALKING_INTEGERS:
            low, high = WALKING_INTEGERS[kind]
            self.value = min(high, max(low, self.value + rng.choice((-1, 0, 0, 1))))
        elif kind == "memory_used":
            self.value = min(self.rate, max(0.0, self.value + rng.randint(-64, 64) * 2**21))
        elif kind == "timestamp":
            return t - rng.uniform(0.0, 5.0)
        return self.value


class RulesFleet:
    """N copies of the scraped node as Series, their history records, and the feed."""

    def __init__(self, nodes: int, scrape: str, wanted: set[str], seed: int = 51) -> None:
        """`wanted`: the families the rules read, cut from the scrape."""
        self.nodes, self.rng = nodes, random.Random(seed)
        node_series: list[tuple[str, dict[str, str], float, str]] = []
        for family in text_string_to_metric_families(scrape):
            for sample in family.samples:
                if sample.name in wanted:
                    node_series.append((sample.name, dict(sample.labels), sample.value, family.type))
        gpus = sorted({(s[1]["gpu"], s[1]["uuid"]) for s in node_series if "uuid" in s[1]})
        for gpu, uuid in gpus:  # pod attribution's and GPM's, which the scrape has only with a kubelet or after 5 m
            node_series.append(("gpuwarden_gpu_allocation", {"gpu": gpu, "uuid": uuid, "namespace": "team-a",
                                "pod": "trainer-0", "container": "main"}, 1.0, "gauge"))  # fmt: skip
            node_series.append(("gpuwarden_bottleneck_info", {"gpu": gpu, "uuid": uuid, "class": "tensor_bound"},
                                1.0, "gauge"))  # fmt: skip
        self.per_node = len(node_series)
        self.gpus = len(gpus)
        self.series: list[Series] = []
        self.busy = [self.rng.uniform(0.2, 1.0) for _ in range(nodes * len(gpus))]
        self.faulty = set(
            self.rng.sample(range(nodes * len(gpus)), max(1, round(nodes * len(gpus) * FAULTY_GPU_SHARE)))
        )
        for n in range(nodes):
            for name, labels, value, _ in node_series:
                own = {**labels, "__name__": name, "job": "gpuwarden", "instance": f"{self.node(n)}:10045",
                       "node": self.node(n)}  # fmt: skip
                if "uuid" in own:
                    own["uuid"] = self.uuid(n, own["gpu"])
                self.series.append(self.make(name, own, value, n))

    def make(self, name: str, labels: dict[str, str], value: float, n: int) -> Series:
        rng = self.rng
        kind = {
            "gpuwarden_utilization_sampled_seconds_total": "counter_sampled",
            "gpuwarden_busy_seconds_total": "counter_busy",
            "gpuwarden_throttle_seconds_total": "counter_throttle",
            "gpuwarden_memory_used_bytes": "memory_used",
            "gpuwarden_last_collect_timestamp_seconds": "timestamp",
        }.get(name, "counter_rare" if name in RARE_COUNTERS else name if name in WALKING_INTEGERS else "gauge")
        series = Series(labels, value, kind, n * self.gpus + int(labels.get("gpu", 0)))
        if kind.startswith("counter"):
            series.value = rng.uniform(0, 3 * DAY_S) if kind in ("counter_sampled", "counter_busy") else 0.0
        if kind == "counter_rare":
            series.rate = FAULTY_ERROR_CHANCE if series.gpu_index in self.faulty else 0.0
        if kind == "counter_throttle":
            reason = labels.get("reason", "")
            share = {"sw_power_cap": 0.3, "sw_thermal_slowdown": 0.03, "hw_thermal_slowdown": 0.01}.get(reason, 0)
            series.rate = rng.uniform(0.05, 0.9) if rng.random() < share else 0.0
        if kind == "memory_used":
            series.rate, series.value = 85520809984.0, float(rng.randint(0, 40000) * 2**21)
        if kind in WALKING_INTEGERS:
            series.value = float(rng.randint(*WALKING_INTEGERS[kind]))
        return series

    @staticmethod
    def node(n: int) -> str:
        return f"gpu-node-{n:05d}"

    @staticmethod
    def uuid(n: int, gpu: str) -> str:
        return f"GPU-{n:05d}-{gpu}"

    def restart_some(self, start: int, end: int) -> None:
        """1 % of the nodes restart their exporter once between `start` and `end`: their counters go back to 0."""
        for n in self.rng.sample(range(self.nodes), max(1, int(self.nodes * RESTARTED_SHARE))):
            at = self.rng.randrange(start, end)
            for series in self.series[n * self.per_node : (n + 1) * self.per_node]:
                series.reset_at = at

    def history(self, n: int) -> list[tuple[dict[str, str], float]]:
        """What the gpuwarden-history group records for node n: the most active links per GPU, the node's GPUs."""
        rows = [({"__name__": NVLINK_ACTIVE_MAX, "uuid": self.uuid(n, str(g))}, 18.0) for g in range(self.gpus)]
        return [*rows, ({"__name__": NODE_GPUS_MAX, "node": self.node(n)}, float(self.gpus))]

    def history_openmetrics(self, start: int, end: int) -> Iterator[str]:
        times = range(start - start % HISTORY_INTERVAL_S, end, HISTORY_INTERVAL_S)
        for name in (NVLINK_ACTIVE_MAX, NODE_GPUS_MAX):
            yield f"# TYPE {name} gauge\n"
            for n in range(self.nodes):
                for labels, value in self.history(n):
                    if labels["__name__"] == name:
                        head = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items() if k != "__name__") + "}"
                        yield "".join(f"{head} {value:g} {t}\n" for t in times if t >= start)
        # a sample 1 ms before each 2 h boundary: promtool's blocks then span their 2 h exactly, as head blocks do,
        # and Prometheus compacts them as it does its own (to 6 h, then 18 h)
        yield "# TYPE gpuwarden_bench_block_edge gauge\n"
        yield "".join(
            f"gpuwarden_bench_block_edge 1 {t - 0.001:.3f}\n" for t in range(start + BLOCK_S, end + 1, BLOCK_S)
        )
        yield "# EOF\n"

    def requests(self, start: int, end: int, history_until: int) -> Iterator[bytes]:
        """Remote-write bodies for every series over [start, end), each at most SLICE_S of samples; the history
        records too where t < history_until."""
        rng = self.rng
        for slice_start in range(start, end, SLICE_S):
            times = list(range(slice_start, min(end, slice_start + SLICE_S), STEP))
            stamps = [sample_parts(t) for t in times]
            for first in range(0, len(self.series), SERIES_PER_REQUEST):
                parts = []
                for series in self.series[first : first + SERIES_PER_REQUEST]:
                    if series.kind == "gauge":  # most: one value throughout
                        value = PACK_DOUBLE(series.value)
                        samples = b"".join(head + value + stamp for head, stamp in stamps)
                    else:
                        busy = self.busy[series.gpu_index]
                        samples = b"".join(
                            head + PACK_DOUBLE(series.next(rng, t, busy)) + stamp
                            for t, (head, stamp) in zip(times, stamps, strict=True)
                        )
                    parts.append(field(0x0A, series.head + samples))
                yield snappy_literal(b"".join(parts))
            self.busy = [min(1.0, max(0.05, b + rng.uniform(-0.05, 0.05))) for b in self.busy]
            records = [t for t in times if t % HISTORY_INTERVAL_S == 0 and t < history_until]
            if records:
                parts = [
                    field(0x0A, labels_bytes(labels) + b"".join(
                        field(0x12, b"\x09" + PACK_DOUBLE(value) + b"\x10" + varint(t * 1000)) for t in records))
                    for n in range(self.nodes) for labels, value in self.history(n)
                ]  # fmt: skip
                yield snappy_literal(b"".join(parts))
