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
from collections.abc import Callable
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


def compare_gpu(
    cmp: Comparison,
    gpu: GpuSnapshot,
    smi: ET.Element,
    driver: dict[str, str],
    root: ET.Element,
    nvlinks_active: int | None,
) -> None:
    g = str(gpu.index)
    text: Callable[[str], str | None] = lambda path: (smi.findtext(path) or "").strip() or None  # noqa: E731
    num: Callable[[str], float | None] = lambda path: _number(text(path))  # noqa: E731
    info = gpu.info
    cmp.equal(g, "uuid", gpu.uuid, text("uuid"))
    cmp.equal(g, "name", info.name, text("product_name"))
    cmp.equal(g, "serial", info.serial, text("serial"))
    cmp.equal(g, "pci_bus_id", info.pci_bus_id, text("pci/pci_bus_id"))
    cmp.equal(g, "vbios_version", info.vbios_version, text("vbios_version"))
    cmp.equal(g, "driver_version", driver.get("driver_version"), root.findtext("driver_version"))
    cmp.equal(g, "cuda_driver_version", driver.get("cuda_driver_version"), root.findtext("cuda_version"))
    for field, path in (("total", "fb_memory_usage/total"), ("reserved", "fb_memory_usage/reserved")):
        ours = _value(gpu, f"gpuwarden_memory_{field}_bytes")
        cmp.near(
            g, f"memory_{field}_mib", None if ours is None else ours / MIB, num(path), 1, "nvidia-smi rounds to MiB"
        )
    for field, path in (("used", "fb_memory_usage/used"), ("free", "fb_memory_usage/free")):
        ours = _value(gpu, f"gpuwarden_memory_{field}_bytes")
        cmp.near(
            g,
            f"memory_{field}_mib",
            None if ours is None else ours / MIB,
            num(path),
            64,
            "moves with allocations between the reads",
        )
    cmp.near(g, "temperature_celsius", _value(gpu, "gpuwarden_temperature_celsius"), num("temperature/gpu_temp"), 3)
    cmp.near(
        g,
        "memory_temperature_celsius",
        _value(gpu, "gpuwarden_memory_temperature_celsius"),
        num("temperature/memory_temp"),
        3,
    )
    gpu_max = _value(gpu, "gpuwarden_temperature_threshold_celsius", threshold="gpu_max")
    for ours_name, path in (
        ("shutdown", "temperature/gpu_temp_max_tlimit_threshold"),
        ("slowdown", "temperature/gpu_temp_slow_tlimit_threshold"),
    ):
        ours = _value(gpu, "gpuwarden_temperature_threshold_celsius", threshold=ours_name)
        # nvidia-smi prints thresholds on the T.Limit scale (gpu_max − absolute); gpuwarden exports absolute °C.
        converted = None if ours is None or gpu_max is None else gpu_max - ours
        cmp.near(g, f"temperature_threshold_{ours_name} (T.Limit scale)", converted, num(path), 0)
    power = _value(gpu, "gpuwarden_power_usage_watts")
    smi_power = num("gpu_power_readings/average_power_draw") or num("power_readings/power_draw")
    cmp.near(g, "power_usage_watts", power, smi_power, max(15.0, 0.1 * (smi_power or 0)), "1 s average, moves")
    cmp.near(
        g,
        "power_limit_watts",
        _value(gpu, "gpuwarden_power_limit_watts"),
        num("gpu_power_readings/current_power_limit") or num("power_readings/power_limit"),
        0.5,
    )
    cmp.near(
        g,
        "power_default_limit_watts",
        _value(gpu, "gpuwarden_power_default_limit_watts"),
        num("gpu_power_readings/default_power_limit") or num("power_readings/default_power_limit"),
        0.5,
    )
    pstate = _value(gpu, "gpuwarden_performance_state")
    cmp.equal(g, "performance_state", f"P{pstate:.0f}" if pstate is not None else "absent", text("performance_state"))
    for clock, path in (
        ("sm", "clocks/sm_clock"),
        ("memory", "clocks/mem_clock"),
        ("graphics", "clocks/graphics_clock"),
    ):
        ours = _value(gpu, "gpuwarden_clock_hertz", clock=clock)
        cmp.near(
            g,
            f"clock_{clock}_mhz",
            None if ours is None else ours / 1e6,
            num(path),
            30 if clock != "memory" else 0,
            "moves under load",
        )
        ours_max = _value(gpu, "gpuwarden_clock_max_hertz", clock=clock)
        cmp.near(
            g,
            f"clock_max_{clock}_mhz",
            None if ours_max is None else ours_max / 1e6,
            num(f"max_clocks/{path.split('/')[1]}"),
            0,
        )
    for reason, tag in (
        ("gpu_idle", "gpu_idle"),
        ("sw_power_cap", "sw_power_cap"),
        ("hw_slowdown", "hw_slowdown"),
        ("hw_thermal_slowdown", "hw_thermal_slowdown"),
        ("sw_thermal_slowdown", "sw_thermal_slowdown"),
        ("hw_power_brake_slowdown", "hw_power_brake_slowdown"),
    ):
        ours = _value(gpu, "gpuwarden_clock_event_active", reason=reason)
        theirs = text(f"clocks_event_reasons/clocks_event_reason_{tag}")
        cmp.equal(
            g,
            f"clock_event_{reason}",
            {1.0: "Active", 0.0: "Not Active"}.get(ours, "absent"),
            theirs,
            "point sample on both sides",
        )
    ecc = {1.0: "Enabled", 0.0: "Disabled"}
    cmp.equal(g, "ecc_enabled", ecc.get(_value(gpu, "gpuwarden_ecc_enabled"), "absent"), text("ecc_mode/current_ecc"))
    for kind, family in (
        ("volatile", "gpuwarden_ecc_errors_total"),
        ("aggregate", "gpuwarden_ecc_lifetime_errors_total"),
    ):
        corrected = sum(num(f"ecc_errors/{kind}/{t}") or 0 for t in ("sram_correctable", "dram_correctable"))
        uncorrected = sum(
            num(f"ecc_errors/{kind}/{t}") or 0
            for t in ("sram_uncorrectable_parity", "sram_uncorrectable_secded", "dram_uncorrectable")
        )
        cmp.near(g, f"ecc_{kind}_corrected", _value(gpu, family, type="corrected"), corrected, 0)
        cmp.near(g, f"ecc_{kind}_uncorrected", _value(gpu, family, type="uncorrected"), uncorrected, 0)
    if text("remapped_rows/remapped_row_corr") not in (None, "N/A"):
        cmp.near(
            g,
            "remapped_rows_correctable",
            _value(gpu, "gpuwarden_remapped_rows", cause="correctable"),
            num("remapped_rows/remapped_row_corr"),
            0,
        )
        cmp.near(
            g,
            "remapped_rows_uncorrectable",
            _value(gpu, "gpuwarden_remapped_rows", cause="uncorrectable"),
            num("remapped_rows/remapped_row_unc"),
            0,
        )
        yes_no = {1.0: "Yes", 0.0: "No"}
        cmp.equal(
            g,
            "remapped_rows_pending",
            yes_no.get(_value(gpu, "gpuwarden_remapped_rows_pending"), "absent"),
            text("remapped_rows/remapped_row_pending"),
        )
        cmp.equal(
            g,
            "remapped_rows_failed",
            yes_no.get(_value(gpu, "gpuwarden_remapped_rows_failed"), "absent"),
            text("remapped_rows/remapped_row_failure"),
        )
    enabled = {1.0: "Enabled", 0.0: "Disabled"}
    cmp.equal(
        g,
        "persistence_mode",
        enabled.get(_value(gpu, "gpuwarden_persistence_mode_enabled"), "absent"),
        text("persistence_mode"),
    )
    cmp.equal(
        g,
        "mig_mode",
        enabled.get(_value(gpu, "gpuwarden_mig_mode_enabled"), "absent"),
        text("mig_mode/current_mig") or "absent",
    )
    for kind, gen_path, width_path in (
        ("max", "max_link_gen", "max_link_width"),
        ("current", "current_link_gen", "current_link_width"),
    ):
        cmp.near(
            g,
            f"pcie_link_generation_{kind}",
            _value(gpu, "gpuwarden_pcie_link_generation", kind=kind),
            num(f"pci/pci_gpu_link_info/pcie_gen/{gen_path}"),
            0,
        )
        cmp.near(
            g,
            f"pcie_link_width_{kind}",
            _value(gpu, "gpuwarden_pcie_link_width", kind=kind),
            num(f"pci/pci_gpu_link_info/link_widths/{width_path}"),
            0,
        )
    cmp.near(g, "pcie_replay_errors", _value(gpu, "gpuwarden_pcie_replay_errors_total"), num("pci/replay_counter"), 0)
    fan = _value(gpu, "gpuwarden_fan_speed_ratio")
    cmp.near(g, "fan_speed_percent", None if fan is None else fan * 100, num("fan_speed"), 2)
    smi_processes = smi.find("processes")
    count = 0 if smi_processes is None else len(smi_processes.findall("process_info"))
    cmp.near(g, "processes", _value(gpu, "gpuwarden_processes"), count, 0)
    recovery = {None: "absent", 0.0: "None", 1.0: "Reset", 2.0: "Reboot", 3.0: "Drain P2P", 4.0: "Drain and Reset"}
    cmp.equal(
        g,
        "recovery_action",
        recovery.get(_value(gpu, "gpuwarden_recovery_action"), "other"),
        text("gpu_recovery_action") or "absent",
    )
    if nvlinks_active is not None:
        ours_links = sum(s.value for s in gpu.samples if s.name == "gpuwarden_nvlink_up")
        cmp.near(g, "nvlink_active_links", ours_links, nvlinks_active, 0, "nvidia-smi nvlink -s")


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
