"""NVLink: link count and remote ends (static), per-link state (slow) and error counters (slow, less often).

Per-link getters cost ~0.7 ms each (46 ms per H100 for 18 links), so everything is read in field batches. The
state batch is cheap (0.17 ms for 18 links on H200); the three DL error counters cost 13-16 ms each for 18 links,
all of it CPU time in the driver, so they run every poll.nvlink_errors_interval (60 s), not every slow poll.
"""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import (
    NVLINK_ACTIVE_LINKS,
    NVLINK_ERRORS_TOTAL,
    NVLINK_GPU_ERRORS_TOTAL,
    NVLINK_LINKS,
    NVLINK_UP,
)
from gpuwarden.model.snapshot import NvlinkFacts, SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_SCOPED_ERRORS = {
    nvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC: "crc_flit",
    nvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY: "replay",
    nvml.NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY: "recovery",
}
# Unscoped per-link fields exist for links 0-11 only.
_CRC_DATA = [39, 40, 41, 42, 43, 44, 102, 103, 104, 105, 106, 107]
_ECC_DATA = list(
    range(nvml.NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L0, nvml.NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_L11 + 1)
)
NVSWITCH_REMOTE_BUS_ID = "FFFFFFFF:FF:FF.0"


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    count = dev.fields([nvml.NVML_FI_DEV_NVLINK_LINK_COUNT]).get((nvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0))
    links = int(count or 0)
    remote: dict[int, str] = {}
    for link in range(links):
        pci = dev.call(nvml.nvmlDeviceGetNvLinkRemotePciInfo, link, key=f"nvlink_remote_{link}")
        if pci is not None:
            bus = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
            remote[link] = bus.upper()
    switch = dev.fields([nvml.NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT]).get(
        (nvml.NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT, 0)
    )
    dev.state["nvlink_links"] = links  # this reader's own: how many links the slow tier reads
    facts = NvlinkFacts(links, tuple(sorted(remote.items())), int(switch) if switch else 0)
    out.set_info(nvlink_links=links, nvlink=facts)
    if links:
        out.add(NVLINK_LINKS, links)


def read_state(dev: GpuDevice, out: SampleWriter) -> None:
    """Link state: one field per link, ~0.2 ms for 18 links (measured on H200)."""
    links = dev.state.get("nvlink_links", 0)
    values = dev.fields([(nvml.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in range(links)])
    active, known = 0, 0
    for link in range(links):
        state = values.get((nvml.NVML_FI_DEV_NVLINK_GET_STATE, link))
        out.add(NVLINK_UP, None if state is None else (1 if state else 0), str(link))
        if state is not None:
            known += 1
            active += 1 if state else 0
    out.add(NVLINK_ACTIVE_LINKS, active if known else None)


def read_errors(dev: GpuDevice, out: SampleWriter) -> None:
    """Per-link error counters: ~14 ms of driver CPU time per counter type for 18 links (measured on H200)."""
    links = dev.state.get("nvlink_links", 0)
    if not links:
        return
    wanted = [(field_id, link) for field_id in _SCOPED_ERRORS for link in range(links)]
    wanted += [(field_id, 0) for field_id in _CRC_DATA[:links] + _ECC_DATA[:links]]
    values = dev.fields(wanted)
    per_type: dict[str, float] = {}

    def add(value: float | None, link: int, kind: str) -> None:
        out.add(NVLINK_ERRORS_TOTAL, value, str(link), kind)
        if value is not None:
            per_type[kind] = per_type.get(kind, 0.0) + value

    for link in range(links):
        for field_id, label in _SCOPED_ERRORS.items():
            add(values.get((field_id, link)), link, label)
        if link < len(_CRC_DATA):
            add(values.get((_CRC_DATA[link], 0)), link, "crc_data")
            add(values.get((_ECC_DATA[link], 0)), link, "ecc")
    for kind, total in per_type.items():  # the links' counters summed: a counter while the link set is fixed
        out.add(NVLINK_GPU_ERRORS_TOTAL, total, kind)


STATIC = Reader("nvlink_links", Tier.STATIC, (NVLINK_LINKS,), read_static)
SLOW = Reader("nvlink", Tier.SLOW, (NVLINK_UP, NVLINK_ACTIVE_LINKS), read_state)
ERRORS = Reader(
    "nvlink_errors",
    Tier.SLOW,
    (NVLINK_ERRORS_TOTAL, NVLINK_GPU_ERRORS_TOTAL),
    read_errors,
    every="nvlink_errors_interval",
)
