"""The simulated host's kernel log: a scenario's records written as /dev/kmsg records, as the driver writes them.

The simulated host's kernel log: a scenario's `kernel_log` records written as /dev/kmsg records, the way the
driver writes them (the formats tests/data/kmsg and collect/kernel_log.py parse: the kernel's facility, the driver's
wording at the start of the message), into a file the exporter reads as it would read /dev/kmsg; a `trap` is the
kernel's report of a process crashing inside a driver library, which the exporter ignores (any process can crash
inside a file of that name). Each record's time is seconds since the simulated host booted, `booted_before` the
scenario's time zero; library.uptime() answers on the same clock, so a record's wall time is what the scenario
says. The simulated baseboard's NVSwitches sit on its PCI bus (`nvswitch_addresses`), where the exporter looks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from gpuwarden.sim.scenario import KernelRecord, Scenario

ERR = 3  # kmsg priority of the driver's error lines (facility kern, level err)
INFO = 6  # the kernel's crash reports (facility kern, level info)
SWITCH_BUS_BASE = 0x86  # NVSwitch n sits at 0000:(86+n):00.0, as on an HGX baseboard
BASEBOARD_SWITCHES = 4  # as on HGX H100 and H200


def nvswitch_addresses(scenario: Scenario) -> list[str]:
    """The PCI addresses of the node's NVSwitches, as sysfs names them: four on an NVSwitch node, or as many as the
    highest switch its kernel log names; none without NVSwitch."""
    if scenario.node.nvlink != "nvswitch":
        return []
    named = [record.switch for record in scenario.kernel_log if record.kind == "sxid" and record.switch is not None]
    return [switch_address(n) for n in range(max([BASEBOARD_SWITCHES - 1, *named]) + 1)]


def switch_address(switch: int) -> str:
    return f"0000:{SWITCH_BUS_BASE + switch:02x}:00.0"


def message(record: KernelRecord, bus_id: Callable[[int], str], driver_version: str) -> str:
    """The line the driver (or the kernel, for a trap) writes for `record`."""
    if record.kind == "xid":
        bus = _pci(bus_id(record.gpu or 0))[:-2]  # the Xid line names the device without its function
        tail = "GPU has fallen off the bus." if record.xid == 79 else "simulated"
        return f"NVRM: Xid (PCI:{bus}): {record.xid}, pid='<unknown>', name=<unknown>, {tail}"
    if record.kind == "fallen_off_bus":
        return f"NVRM: GPU {_pci(bus_id(record.gpu or 0))}: GPU has fallen off the bus."
    if record.kind == "sxid":
        switch = record.switch or 0
        address = switch_address(switch)
        return f"nvidia-nvswitch{switch}: SXid (PCI:{address}): {record.sxid:05d}, Non-fatal, Link 30 simulated"
    return (
        "traps: python3[647] general protection fault ip:7f3a2c1b2e4f sp:7ffd5c9e1a30 error:0 in "
        f"{record.library}.so.{driver_version}[7f3a2c000000+1e5000]"
    )


def _pci(nvml_bus_id: str) -> str:
    """NVML's `00000000:18:00.0` as the kernel writes it: `0000:18:00.0`, lower case."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


class SimulatedKernelLog:
    """The scenario's records as a kmsg file, written on first use (a GPM child never asks) and removed at exit."""

    def __init__(self, scenario: Scenario, bus_id: Callable[[int], str], booted_before: float) -> None:
        self.scenario, self.bus_id, self.booted_before = scenario, bus_id, booted_before
        self._path: Path | None = None
        self._lock = threading.Lock()

    def path(self) -> str:
        """The file's path; "" when the scenario logged nothing (the exporter then reads no kernel log)."""
        if not self.scenario.kernel_log:
            return ""
        with self._lock:
            if self._path is None:
                self._path = self._write()
        return str(self._path)

    def _write(self) -> Path:
        records = sorted(self.scenario.kernel_log, key=lambda record: record.at)
        lines = [
            f"{INFO if record.kind == 'trap' else ERR},{seq},{round(max(self.booted_before + record.at, 0.0) * 1e6)},-;"
            f"{message(record, self.bus_id, self.scenario.driver.version)}\n"
            for seq, record in enumerate(records)
        ]
        fd, name = tempfile.mkstemp(prefix="gpuwarden-sim-kmsg-", suffix=".kmsg")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.writelines(lines)
        path = Path(name)
        atexit.register(self._remove, path)
        return path

    @staticmethod
    def _remove(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
