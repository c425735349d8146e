"""NVSwitch fabric state of each GPU (slow tier): whether Fabric Manager has set the fabric up, and its health.

NVSwitch fabric state of each GPU (slow tier): on HGX and NVL systems Fabric Manager sets up the fabric, and until
it has, CUDA cannot start on the GPU while every other reading looks healthy (one operator's Fabric Manager stayed
down for 20 days unnoticed: docs/runbooks.md, GpuwardenFabricNotReady). A GPU without NVSwitch answers state 0,
not supported: no series, and never an alert.

Measured on a lent 2x H200 (driver 580.159.04, 2026-11-27): state 3 (completed), status success, clique 0, health
mask 0, summary not supported, as `nvidia-smi -q` shows it; the structure must be passed by pointer
(gpuwarden.nvml.calls.nvmlDeviceGetGpuFabricInfoV).
"""

from __future__ import annotations

from typing import Any

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import FABRIC_HEALTH, FABRIC_INFO, FABRIC_STATE
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

STATES = {1: "not_started", 2: "in_progress", 3: "completed"}  # 0: not supported (no fabric)
SUMMARIES = {0: "not_supported", 1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
NOT_READY = 27  # NVML_ERROR_NOT_READY: the status while the fabric is being set up, not a failure
# the health mask's fields (nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*): name, shift, width, and which values are bad;
# a field at 0 is not supported by the driver or the system and gives no row
HEALTH_FIELDS: tuple[tuple[str, int, int, frozenset[int]], ...] = (
    ("degraded_bandwidth", 0, 0x3, frozenset({1})),
    ("route_recovery", 2, 0x3, frozenset({1})),
    ("route_unhealthy", 4, 0x3, frozenset({1})),
    ("access_timeout_recovery", 6, 0x3, frozenset({1})),
    ("incorrect_configuration", 8, 0xF, frozenset(range(2, 16))),  # 1: none; 2-8: the reason (API: its number)
    ("gfm_disconnected", 14, 0x3, frozenset({2})),  # 1 connected, 2 disconnected
)


def health_conditions(mask: int) -> dict[str, tuple[bool, int]]:
    """Each supported field of the health mask → (whether it is bad, its raw value)."""
    out = {}
    for name, shift, width, bad in HEALTH_FIELDS:
        value = (mask >> shift) & width
        if value:
            out[name] = (value in bad, value)
    return out


def _uuid_text(raw: Any) -> str:
    data = bytes(raw)
    if not any(data):
        return ""
    hex_ = data.hex()
    return f"{hex_[:8]}-{hex_[8:12]}-{hex_[12:16]}-{hex_[16:20]}-{hex_[20:32]}"


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    info = dev.call(nvml.nvmlDeviceGetGpuFabricInfoV)
    if info is None:
        return
    state = STATES.get(int(info.state))
    if state is None:
        out.set_info(fabric={"state": "not_supported"})
        return
    for name in STATES.values():
        out.add(FABRIC_STATE, 1.0 if name == state else 0.0, name)
    status = int(info.status)
    conditions = health_conditions(int(info.healthMask))
    for name, (bad, _) in conditions.items():
        out.add(FABRIC_HEALTH, 1.0 if bad else 0.0, name)
    failed = status not in (0, NOT_READY)
    out.add(FABRIC_HEALTH, 1.0 if failed else 0.0, "registration_failed")
    summary = SUMMARIES.get(int(getattr(info, "healthSummary", 0)), "not_supported")
    cluster = _uuid_text(info.clusterUuid)
    out.add(FABRIC_INFO, 1.0, str(int(info.cliqueId)), cluster, summary)
    out.set_info(
        fabric={
            "state": state,
            "status": status,
            "clique_id": int(info.cliqueId),
            "cluster_uuid": cluster,
            "health_summary": summary,
            "conditions": {name: raw for name, (_, raw) in conditions.items()},
        }
    )


SLOW = Reader("fabric", Tier.SLOW, (FABRIC_STATE, FABRIC_HEALTH, FABRIC_INFO), read_slow)
