"""Positive evidence that a job makes no progress: every path its data may take carried nearly nothing.

Positive evidence that a job makes no progress: every path its data may take carried (nearly) nothing over the
window. Silence on one path is no evidence where the data may take another: a job without NVLink moves its
all-reduce over PCIe, and ranks on other nodes reach it over the host's RDMA ports.

The paths, for each GPU of the job on this node:
- NVLink, where the GPU has NVLink (its counters read over the whole window);
- PCIe, always (every GPU has it; its counters must have been read over the whole window);
- the host's RDMA ports, where the host has them (jobs/rdma.py); a job with ranks on other nodes needs them read
  (without them, the network it uses is not watched: no evidence).
Each below `collective_hang_bytes_per_second`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.jobs.rdma import RdmaRate


@dataclass(frozen=True)
class Progress:
    stopped: bool  # positive evidence: every path read, each quiet
    detail: str  # what each path carried, or which could not be read


def evidence(
    limits: Thresholds,
    gpus: Iterable[tuple[WindowActivity, bool]],
    rdma: RdmaRate,
    across_nodes: bool,
) -> Progress:
    """`gpus`: each GPU's window and whether it has NVLink to a peer; `across_nodes`: the job has ranks on other
    nodes."""
    gpus = list(gpus)
    rates = {"PCIe": max((a.pcie_bytes_per_second for a, _ in gpus), default=0.0)}
    unread = {"PCIe"} if any("pcie" not in a.paths for a, _ in gpus) else set()
    linked = [a for a, has_nvlink in gpus if has_nvlink]
    if linked:
        rates["NVLink"] = max(a.nvlink_bytes_per_second for a in linked)
        unread |= {"NVLink"} if any("nvlink" not in a.paths for a in linked) else set()
    if rdma.ports or across_nodes:
        if rdma.bytes_per_second is None:
            unread.add("RDMA (no port)" if not rdma.ports else "RDMA")
        else:
            rates["RDMA"] = rdma.bytes_per_second
    if unread:
        return Progress(False, "not read over the window: " + ", ".join(sorted(unread)))
    carried = ", ".join(f"{path} {rate / 1e6:.1f} MB/s" for path, rate in rates.items())
    quiet = limits.collective_hang_bytes_per_second
    return Progress(all(rate < quiet for rate in rates.values()), f"{carried} at most on any of its paths")
