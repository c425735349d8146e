"""The GPU-to-GPU matrix as `nvidia-smi topo -m` prints it: NV# where NVLink joins a pair, else the PCIe level.

The PCIe common ancestor reads PHB (or NODE/SYS) even for NVLink-joined H100s, so NV# comes from NVLink:
direct links are counted by remote bus id; behind NVSwitch every link reports remote bus FFFFFFFF:FF:FF.0,
so P2P-over-NVLink status plus the active link counts give it (docs/nvml.md, Topology).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.collect.readers.nvlink import NVSWITCH_REMOTE_BUS_ID
from gpuwarden.model.snapshot import GpuSnapshot, NvlinkFacts, PeerLink
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

PCIE_LEVELS = {
    nvml.NVML_TOPOLOGY_INTERNAL: "PIX",
    nvml.NVML_TOPOLOGY_SINGLE: "PIX",
    nvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
    nvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
    nvml.NVML_TOPOLOGY_NODE: "NODE",
    nvml.NVML_TOPOLOGY_SYSTEM: "SYS",
}


@dataclass(frozen=True)
class PairFacts:
    """What is static about a GPU pair: its PCIe level and whether P2P over NVLink works."""

    pcie_level: str
    nvlink_p2p: bool


def probe_pairs(devices: list[GpuDevice]) -> dict[tuple[str, str], PairFacts]:
    """Read the static pair facts (a few µs per call; once per discovery)."""
    facts: dict[tuple[str, str], PairFacts] = {}
    for a in devices:
        for b in devices:
            if a.uuid == b.uuid:
                continue
            level = a.call(nvml.nvmlDeviceGetTopologyCommonAncestor, b.handle, key=f"topology_{b.uuid}")
            p2p = a.call(
                nvml.nvmlDeviceGetP2PStatus, b.handle, nvml.NVML_P2P_CAPS_INDEX_NVLINK, key=f"p2p_nvlink_{b.uuid}"
            )
            facts[(a.uuid, b.uuid)] = PairFacts(
                PCIE_LEVELS.get(level, "SYS") if level is not None else "SYS", p2p == nvml.NVML_P2P_STATUS_OK
            )
    return facts


def peer_links(a: GpuSnapshot, b: GpuSnapshot, facts: PairFacts, active: dict[str, set[int]]) -> int | None:
    """Active NVLinks from a to b; None when the pair has no NVLink path at all."""
    a_links = a.info.nvlink or NvlinkFacts()
    b_links = b.info.nvlink or NvlinkFacts()
    remote = dict(a_links.remote_bus_ids)
    links_a = active.get(a.uuid, set(range(a_links.links)))
    direct = [link for link, bus in remote.items() if bus == (b.info.pci_bus_id or "").upper()]
    if direct:
        return sum(1 for link in direct if link in links_a)
    behind_switch = remote and all(bus == NVSWITCH_REMOTE_BUS_ID for bus in remote.values())
    if facts.nvlink_p2p and behind_switch:
        links_b = active.get(b.uuid, set(range(b_links.links)))
        switch_links = a_links.nvswitch_links or len(remote)
        return min(len(links_a), len(links_b), switch_links)
    return None


def build_matrix(
    gpus: list[GpuSnapshot], facts: dict[tuple[str, str], PairFacts], active: dict[str, set[int]]
) -> dict[str, tuple[PeerLink, ...]]:
    """uuid → its peers, with the level nvidia-smi topo -m would print (from the GPUs' discovered facts)."""
    matrix: dict[str, tuple[PeerLink, ...]] = {}
    for a in gpus:
        peers = []
        for b in gpus:
            pair = facts.get((a.uuid, b.uuid))
            if a.uuid == b.uuid or pair is None:
                continue
            links = peer_links(a, b, pair, active)
            level = f"NV{links}" if links else pair.pcie_level
            peers.append(PeerLink(b.index, b.uuid, level, -1 if links is None else links))
        matrix[a.uuid] = tuple(peers)
    return matrix
