"""The host's RDMA ports' data counters: one of the paths a job's data takes between nodes (InfiniBand, RoCE).

Read from `<sys_root>/class/infiniband/<device>/ports/<port>/counters/port_{xmit,rcv}_data`, which count in units
of four octets (the IB spec's PortXmitData/PortRcvData; the kernel's sysfs ABI). World-readable, so an unprivileged
exporter reads them too. The rate over a window is the evidence the hang rule needs where such ports exist: data
moving over them means some job still progresses across nodes. The ports are listed again every RESCAN_S.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

RESCAN_S = 60.0
OCTETS_PER_UNIT = 4
COUNTERS = ("port_xmit_data", "port_rcv_data")
MAX_PORTS = 64


@dataclass(frozen=True)
class RdmaRate:
    """What the host's RDMA ports carried over a window: `ports` 0 where the host has none (no such path),
    `bytes_per_second` None where they exist but were not read over the whole window (no evidence)."""

    ports: int
    bytes_per_second: float | None

    def describe(self) -> str:
        if not self.ports:
            return "no RDMA port"
        if self.bytes_per_second is None:
            return f"{self.ports} RDMA ports not read"
        return f"RDMA {self.bytes_per_second / 1e6:.1f} MB/s over {self.ports} ports"


NO_PORTS = RdmaRate(0, None)


class RdmaCounters:
    """Samples the ports' counters each poll; keeps the points of the last `keep_s` seconds."""

    def __init__(self, sys_root: Path | None) -> None:
        self._root = None if sys_root is None else sys_root / "class" / "infiniband"
        self._files: list[Path] = []
        self._listed_at = float("-inf")
        self._points: deque[tuple[float, int | None]] = deque()

    def _list(self, now: float) -> None:
        if now - self._listed_at < RESCAN_S or self._root is None:
            return
        self._listed_at = now
        try:
            ports = sorted(self._root.glob("*/ports/*/counters"))[:MAX_PORTS]
        except OSError:
            ports = []
        self._files = [port / name for port in ports for name in COUNTERS]

    def sample(self, now: float, keep_s: float) -> None:
        self._list(now)
        if not self._files:
            self._points.clear()
            return
        total: int | None = 0
        for path in self._files:
            try:
                total += int(path.read_text().strip())  # type: ignore[operator]
            except (OSError, ValueError):
                total = None
                break
        self._points.append((now, total))
        while len(self._points) > 1 and self._points[1][0] <= now - keep_s:
            self._points.popleft()

    def rate(self, now: float, window: float) -> RdmaRate:
        """Bytes per second over the last `window` seconds (at least), both directions of every port."""
        if not self._files:
            return NO_PORTS
        ports = len(self._files) // len(COUNTERS)
        first = self._points[0] if self._points else None
        last = self._points[-1] if self._points else None
        if first is None or last is None or now - first[0] < window or first[1] is None or last[1] is None:
            return RdmaRate(ports, None)
        if any(total is None for _, total in self._points) or last[0] <= first[0]:
            return RdmaRate(ports, None)
        return RdmaRate(ports, max(last[1] - first[1], 0) * OCTETS_PER_UNIT / (last[0] - first[0]))
