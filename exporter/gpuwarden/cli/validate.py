"""`gpuwarden validate`: compare what gpuwarden reads with what nvidia-smi shows, on a real GPU host.

It polls NVML once through the production pipeline, then takes `nvidia-smi -q -x` and `nvidia-smi topo -m` at once,
and prints a table: metric, exporter value, nvidia-smi value, tolerance, match. Exit code 1 on any mismatch,
2 when nvidia-smi or NVML cannot be used. Values that move between the two reads (temperature, power, clocks under
load) get a tolerance; identities, limits and counters must be equal.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuwarden.config.settings import load_settings
from gpuwarden.model.snapshot import GpuSnapshot, Snapshot
from gpuwarden.runtime.pipeline import Pipeline

MIB = 1 << 20


@dataclass
class Row:
    gpu: str
    metric: str
    exporter: str
    nvidia_smi: str
    tolerance: str
    match: bool
    note: str = ""


def _number(text: str | None) -> float | None:
    """'143771 MiB' → 143771.0; 'N/A' → None."""
    if text is None:
        return None
    found = re.search(r"-?\d+(\.\d+)?", text)
    return float(found.group()) if found else None


def _value(gpu: GpuSnapshot, name: str, **labels: str) -> float | None:
    from gpuwarden.model.families import FAMILIES

    wanted = FAMILIES[name].labels
    for sample in gpu.samples:
        if sample.name == name and all(
            dict(zip(wanted, sample.labels, strict=True)).get(k) == v for k, v in labels.items()
        ):
            return sample.value
    return None


class Comparison:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def equal(self, gpu: str, metric: str, ours: object, theirs: object, note: str = "") -> None:
        self.rows.append(Row(gpu, metric, str(ours), str(theirs), "equal", str(ours) == str(theirs), note))

    def near(
        self, gpu: str, metric: str, ours: float | None, theirs: float | None, tolerance: float, note: str = ""
    ) -> None:
        if ours is None or theirs is None:
            match = ours is None and theirs is None
            self.rows.append(
                Row(
                    gpu,
                    metric,
                    _show(ours),
                    _show(theirs),
                    "both absent",
                    match,
                    note or ("not supported on this board" if match else "absent on one side"),
                )
            )
            return
        self.rows.append(
            Row(gpu, metric, _show(ours), _show(theirs), f"±{tolerance:g}", abs(ours - theirs) <= tolerance, note)
        )


def _show(value: float | None) -> str:
    if value is None:
        return "absent"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


@dataclass
class _Reading:
    """One GPU as both sides read it, gpuwarden's snapshot and nvidia-smi's <gpu> element, and the rows it adds."""

    cmp: Comparison
    gpu: GpuSnapshot
    smi: ET.Element

    def text(self, path: str) -> str | None:
        return (self.smi.findtext(path) or "").strip() or None

    def num(self, path: str) -> float | None:
        return _number(self.text(path))

    def ours(self, name: str, scale: float = 1.0, **labels: str) -> float | None:
        """gpuwarden's value of a family (divided by `scale`: bytes to MiB, Hz to MHz); None where it has none."""
        value = _value(self.gpu, name, **labels)
        return None if value is None else value / scale if scale != 1.0 else value

    def equal(self, metric: str, ours: object, theirs: object, note: str = "") -> None:
        self.cmp.equal(str(self.gpu.index), metric, ours, theirs, note)

    def near(self, metric: str, ours: float | None, theirs: float | None, tolerance: float, note: str = "") -> None:
        self.cmp.near(str(self.gpu.index), metric, ours, theirs, tolerance, note)


ENABLED = {1.0: "Enabled", 0.0: "Disabled"}
YES_NO = {1.0: "Yes", 0.0: "No"}
RECOVERY = {None: "absent", 0.0: "None", 1.0: "Reset", 2.0: "Reboot", 3.0: "Drain P2P", 4.0: "Drain and Reset"}
CLOCK_EVENT_REASONS = (
    "gpu_idle",
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "sw_thermal_slowdown",
    "hw_power_brake_slowdown",
)


def compare_gpu(
    cmp: Comparison,
    gpu: GpuSnapshot,
    smi: ET.Element,
    driver: dict[str, str],
    root: ET.Element,
    nvlinks_active: int | None,
) -> None:
    """One GPU's rows, in the table's order: identity, memory, temperatures, power, clocks, ECC and row remapping,
    modes, PCIe, fan, processes, recovery, NVLink."""
    r = _Reading(cmp, gpu, smi)
    info = gpu.info
    r.equal("uuid", gpu.uuid, r.text("uuid"))
    r.equal("name", info.name, r.text("product_name"))
    r.equal("serial", info.serial, r.text("serial"))
    r.equal("pci_bus_id", info.pci_bus_id, r.text("pci/pci_bus_id"))
    r.equal("vbios_version", info.vbios_version, r.text("vbios_version"))
    r.equal("driver_version", driver.get("driver_version"), root.findtext("driver_version"))
    r.equal("cuda_driver_version", driver.get("cuda_driver_version"), root.findtext("cuda_version"))
    _compare_memory_and_heat(r)
    _compare_power_and_clocks(r)
    _compare_errors(r)
    _compare_modes_and_links(r, nvlinks_active)


def _compare_memory_and_heat(r: _Reading) -> None:
    for field, tolerance, note in (
        ("total", 1, "nvidia-smi rounds to MiB"),
        ("reserved", 1, "nvidia-smi rounds to MiB"),
        ("used", 64, "moves with allocations between the reads"),
        ("free", 64, "moves with allocations between the reads"),
    ):
        ours = r.ours(f"gpuwarden_memory_{field}_bytes", MIB)
        r.near(f"memory_{field}_mib", ours, r.num(f"fb_memory_usage/{field}"), tolerance, note)
    r.near("temperature_celsius", r.ours("gpuwarden_temperature_celsius"), r.num("temperature/gpu_temp"), 3)
    ours = r.ours("gpuwarden_memory_temperature_celsius")
    r.near("memory_temperature_celsius", ours, r.num("temperature/memory_temp"), 3)
    gpu_max = r.ours("gpuwarden_temperature_threshold_celsius", threshold="gpu_max")
    for threshold, tag in (("shutdown", "max"), ("slowdown", "slow")):
        ours = r.ours("gpuwarden_temperature_threshold_celsius", threshold=threshold)
        # nvidia-smi prints thresholds on the T.Limit scale (gpu_max − absolute); gpuwarden exports absolute °C.
        converted = None if ours is None or gpu_max is None else gpu_max - ours
        theirs = r.num(f"temperature/gpu_temp_{tag}_tlimit_threshold")
        r.near(f"temperature_threshold_{threshold} (T.Limit scale)", converted, theirs, 0)


def _compare_power_and_clocks(r: _Reading) -> None:
    smi_power = r.num("gpu_power_readings/average_power_draw") or r.num("power_readings/power_draw")
    tolerance = max(15.0, 0.1 * (smi_power or 0))
    r.near("power_usage_watts", r.ours("gpuwarden_power_usage_watts"), smi_power, tolerance, "1 s average, moves")
    for family, path, older_path in (  # the older drivers' element names last
        ("power_limit", "gpu_power_readings/current_power_limit", "power_readings/power_limit"),
        ("power_default_limit", "gpu_power_readings/default_power_limit", "power_readings/default_power_limit"),
    ):
        r.near(f"{family}_watts", r.ours(f"gpuwarden_{family}_watts"), r.num(path) or r.num(older_path), 0.5)
    pstate = r.ours("gpuwarden_performance_state")
    r.equal("performance_state", f"P{pstate:.0f}" if pstate is not None else "absent", r.text("performance_state"))
    for clock, tag in (("sm", "sm_clock"), ("memory", "mem_clock"), ("graphics", "graphics_clock")):
        ours = r.ours("gpuwarden_clock_hertz", 1e6, clock=clock)
        r.near(f"clock_{clock}_mhz", ours, r.num(f"clocks/{tag}"), 30 if clock != "memory" else 0, "moves under load")
        ours_max = r.ours("gpuwarden_clock_max_hertz", 1e6, clock=clock)
        r.near(f"clock_max_{clock}_mhz", ours_max, r.num(f"max_clocks/{tag}"), 0)
    for reason in CLOCK_EVENT_REASONS:
        ours = {1.0: "Active", 0.0: "Not Active"}.get(r.ours("gpuwarden_clock_event_active", reason=reason), "absent")
        theirs = r.text(f"clocks_event_reasons/clocks_event_reason_{reason}")
        r.equal(f"clock_event_{reason}", ours, theirs, "point sample on both sides")


def _compare_errors(r: _Reading) -> None:
    r.equal("ecc_enabled", ENABLED.get(r.ours("gpuwarden_ecc_enabled"), "absent"), r.text("ecc_mode/current_ecc"))
    for kind, family in (
        ("volatile", "gpuwarden_ecc_errors_total"),
        ("aggregate", "gpuwarden_ecc_lifetime_errors_total"),
    ):
        corrected = sum(r.num(f"ecc_errors/{kind}/{t}") or 0 for t in ("sram_correctable", "dram_correctable"))
        uncorrected = sum(
            r.num(f"ecc_errors/{kind}/{t}") or 0
            for t in ("sram_uncorrectable_parity", "sram_uncorrectable_secded", "dram_uncorrectable")
        )
        r.near(f"ecc_{kind}_corrected", r.ours(family, type="corrected"), corrected, 0)
        r.near(f"ecc_{kind}_uncorrected", r.ours(family, type="uncorrected"), uncorrected, 0)
    if r.text("remapped_rows/remapped_row_corr") in (None, "N/A"):
        return
    for cause, tag in (("correctable", "corr"), ("uncorrectable", "unc")):
        ours = r.ours("gpuwarden_remapped_rows", cause=cause)
        r.near(f"remapped_rows_{cause}", ours, r.num(f"remapped_rows/remapped_row_{tag}"), 0)
    for state, tag in (("pending", "pending"), ("failed", "failure")):
        ours = YES_NO.get(r.ours(f"gpuwarden_remapped_rows_{state}"), "absent")
        r.equal(f"remapped_rows_{state}", ours, r.text(f"remapped_rows/remapped_row_{tag}"))


def _compare_modes_and_links(r: _Reading, nvlinks_active: int | None) -> None:
    ours = ENABLED.get(r.ours("gpuwarden_persistence_mode_enabled"), "absent")
    r.equal("persistence_mode", ours, r.text("persistence_mode"))
    r.equal(
        "mig_mode",
        ENABLED.get(r.ours("gpuwarden_mig_mode_enabled"), "absent"),
        r.text("mig_mode/current_mig") or "absent",
    )
    for kind in ("max", "current"):
        link = "pci/pci_gpu_link_info"
        ours = r.ours("gpuwarden_pcie_link_generation", kind=kind)
        r.near(f"pcie_link_generation_{kind}", ours, r.num(f"{link}/pcie_gen/{kind}_link_gen"), 0)
        ours = r.ours("gpuwarden_pcie_link_width", kind=kind)
        r.near(f"pcie_link_width_{kind}", ours, r.num(f"{link}/link_widths/{kind}_link_width"), 0)
    r.near("pcie_replay_errors", r.ours("gpuwarden_pcie_replay_errors_total"), r.num("pci/replay_counter"), 0)
    fan = r.ours("gpuwarden_fan_speed_ratio")
    r.near("fan_speed_percent", None if fan is None else fan * 100, r.num("fan_speed"), 2)
    smi_processes = r.smi.find("processes")
    count = 0 if smi_processes is None else len(smi_processes.findall("process_info"))
    r.near("processes", r.ours("gpuwarden_processes"), count, 0)
    ours_action = RECOVERY.get(r.ours("gpuwarden_recovery_action"), "other")
    r.equal("recovery_action", ours_action, r.text("gpu_recovery_action") or "absent")
    if nvlinks_active is not None:
        ours_links = sum(s.value for s in r.gpu.samples if s.name == "gpuwarden_nvlink_up")
        r.near("nvlink_active_links", ours_links, nvlinks_active, 0, "nvidia-smi nvlink -s")


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m` → {(row gpu, column gpu): level}."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()]
    header = next((line.split() for line in lines if line.strip().startswith("GPU0")), [])
    columns = [int(name[3:]) for name in header if re.fullmatch(r"GPU\d+", name)]
    matrix: dict[tuple[int, int], str] = {}
    for line in lines:
        parts = line.split()
        if parts and re.fullmatch(r"GPU\d+", parts[0]) and len(parts) > len(columns):
            row = int(parts[0][3:])
            for column, level in zip(columns, parts[1 : 1 + len(columns)], strict=True):
                matrix[(row, column)] = level
    return matrix


def active_nvlinks(text: str) -> dict[int, int]:
    """`nvidia-smi nvlink -s` → GPU index → links showing a speed."""
    counts: dict[int, int] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"GPU (\d+):", line)
        if head:
            current = int(head.group(1))
            counts[current] = 0
        elif current is not None and re.search(r"Link \d+: [\d.]+ GB/s", line):
            counts[current] += 1
    return counts


def compare(snapshot: Snapshot, smi_xml: str, topo_text: str, nvlink_text: str) -> Comparison:
    root = ET.fromstring(smi_xml)
    cmp = Comparison()
    smi_gpus = {(g.findtext("uuid") or "").strip(): g for g in root.findall("gpu")}
    links = active_nvlinks(nvlink_text) if nvlink_text.strip() else {}
    for gpu in snapshot.gpus:
        smi = smi_gpus.get(gpu.uuid)
        if smi is None:
            cmp.equal(str(gpu.index), "present in nvidia-smi", True, False)
            continue
        compare_gpu(cmp, gpu, smi, snapshot.driver, root, links.get(gpu.index))
    cmp.near("all", "gpu_count", len(snapshot.gpus), len(smi_gpus), 0)
    theirs = parse_topology(topo_text)
    for gpu in snapshot.gpus:
        for peer in snapshot.topology.get(gpu.uuid, ()):
            cmp.equal(
                f"{gpu.index}→{peer.peer_index}",
                "topology",
                peer.level,
                theirs.get((gpu.index, peer.peer_index), "absent"),
                "nvidia-smi topo -m",
            )
    return cmp


def markdown(cmp: Comparison, header: str) -> str:
    lines = [
        header,
        "",
        "| gpu | metric | gpuwarden | nvidia-smi | tolerance | match | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in cmp.rows:
        lines.append(
            f"| {r.gpu} | {r.metric} | {r.exporter} | {r.nvidia_smi} | {r.tolerance} | "
            f"{'yes' if r.match else '**NO**'} | {r.note} |"
        )
    bad = sum(not r.match for r in cmp.rows)
    lines += ["", f"{len(cmp.rows)} comparisons, {bad} mismatches."]
    return "\n".join(lines) + "\n"


def _smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=True).stdout


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuwarden validate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown report here too")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    settings = load_settings(None, environ={}, flags={"nvml.xid_events": False, "poll.call_deadline": 10})
    pipeline = Pipeline(settings)
    pipeline.poll_once()
    time.sleep(1.2)  # a second fast poll sees fresh utilization samples
    snapshot = pipeline.poll_once()
    if not snapshot.nvml_up:
        print(f"gpuwarden validate: NVML is down ({snapshot.nvml_error})", file=sys.stderr)
        return 2
    try:
        smi_xml, topo, nvlink = _smi("-q", "-x"), _smi("topo", "-m"), _smi("nvlink", "-s")
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"gpuwarden validate: nvidia-smi failed ({exc})", file=sys.stderr)
        return 2
    pipeline.stop()
    names = sorted({g.info.name or "?" for g in snapshot.gpus})
    header = (
        f"# gpuwarden vs nvidia-smi: {len(snapshot.gpus)}× {', '.join(names)}, driver "
        f"{snapshot.driver.get('driver_version')}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    cmp = compare(snapshot, smi_xml, topo, nvlink)
    report = markdown(cmp, header)
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in cmp.rows], indent=1))
    return 1 if any(not r.match for r in cmp.rows) else 0
