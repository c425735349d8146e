"""The kernel log's GPU faults, counted only where the driver wrote them (issues 39 and 48).

NVML reports XIDs only while a process is subscribed; the kernel log keeps every `NVRM: Xid` line since boot (as far
as its ring holds), NVSwitch `SXid` errors and "GPU has fallen off the bus". This module turns /dev/kmsg records
into those events and keeps a bounded tally: counters per (GPU PCI address, XID) and per (switch, SXid), with the
time of the latest. It reads nothing itself; collect/kernel_log_follower.py feeds it.

/dev/kmsg record format (Documentation/ABI/testing/dev-kmsg): `PRIO,SEQ,TIMESTAMP_US,FLAGS[,...];MESSAGE`, PRIO
being facility << 3 | level, then continuation lines that start with a space (` SUBSYSTEM=pci`). The kernel escapes
every control character of MESSAGE (`\\x0a`), so one record is one line whatever text it quotes.

What counts: a record of the kernel's own facility (0) whose message begins with the driver's, in its exact wording,
naming a PCI address of this host's GPUs or NVSwitches (KnownDevices):
- `NVRM: Xid (PCI:dddd:bb:dd): N, ...` (N 1-999; XID 79 is also a GPU fallen off the bus);
- `NVRM: GPU dddd:bb:dd.f: GPU has fallen off the bus.`;
- `nvidia-nvswitchN: SXid (PCI:dddd:bb:dd.f): NNNNN, ...` (the switch driver prints `%05d`); the `Severity ...` and
  `Data {...}` lines it prints after each are that error's detail, not another one.
A record that names the driver (SIGNS) and is not one of those is ignored and counted by reason (IGNORED_REASONS):
- user_facility: not the kernel's: user space cannot write facility 0 to /dev/kmsg (the kernel makes it user);
- not_driver: driver text inside another kernel record. A process's crash report begins with its name and names the
  file it crashed in (`python[42]: segfault at 0 ... in NVRM: Xid (PCI:0000:18:00): 79, ...[0+1000]`), both the
  process's to choose; so a crash inside libnvidia-ml or libcuda (`traps: ... in libcuda.so.1[...]`) is only such a
  report too: any user can crash inside a file of that name, and nothing here counts one;
- unknown_device: the driver's wording naming an address none of this host's GPUs or NVSwitches has;
- unparsed: a line that is not a kmsg record, or the driver's fault wording that does not parse (a new format);
- too_long: a line longer than any kernel record; table_full: an event past MAX_KEYS distinct keys.
The rest of the kernel log names no driver: read, never counted. Text from `dmesg` is not a kmsg record (unparsed):
it prints a file name's newline as a line of its own, which reads as the kernel's (docs/nvml.md, Kernel log).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from gpuwarden.model.pci import normalise_bus_id

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 8192  # a kmsg record is at most ~1 KiB; anything longer is not a kernel record: counted, dropped
MAX_KEYS = 1024  # distinct (kind, device, code): a host's devices x the codes they logged stay far below
KERNEL_FACILITY = 0
IGNORED_REASONS = ("user_facility", "not_driver", "unknown_device", "unparsed", "too_long", "table_full")

_KMSG = re.compile(rb"(\d{1,4}),(\d{1,20}),(\d{1,20}),([^;]*);(.*)", re.DOTALL)
# a record naming the driver: what is counted, or ignored and counted; the rest of the kernel log is neither
SIGNS = re.compile(rb"NVRM|nvswitch|Xid|libnvidia|libcuda|fallen off the bus")
_ADDRESS = rb"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}"  # the drivers print %04x:%02x:%02x, lower case
# NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
_XID = re.compile(rb"NVRM: Xid \(PCI:(" + _ADDRESS + rb")\): ([1-9][0-9]{0,2}), ")
# NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.
_FALLEN = re.compile(rb"NVRM: GPU (" + _ADDRESS + rb"\.[0-7]): GPU has fallen off the bus\.[ \t]*")
# nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Fatal, Link 30 LTSSM Fault Up
_SWITCH = re.compile(rb"nvidia-nvswitch[0-9]{1,3}: ")
_SXID = re.compile(rb"nvidia-nvswitch[0-9]{1,3}: SXid \(PCI:(" + _ADDRESS + rb"\.[0-7])\): ([0-9]{5}), (.*)", re.DOTALL)
_SXID_DETAIL = re.compile(rb"Severity [0-9]+ Engine instance |Data \{")
# the kernel's report of a crashing process begins with its name: at most 15 bytes (60 as the kernel escapes them),
# which may read `NVRM: Xid (PCI:`
_CRASH_REPORT = re.compile(rb"traps: |.{1,60}\[[0-9]{1,10}\]: segfault at ", re.DOTALL)


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One /dev/kmsg record: who logged it (facility 0: the kernel), how loud, and its text as the kernel escaped it."""

    facility: int
    level: int
    seq: int
    seconds: float  # since boot
    message: bytes


@dataclass(frozen=True, slots=True)
class KernelEvent:
    """One GPU fault the driver logged. `seconds` is the record's time since boot."""

    kind: str  # xid | sxid | fallen_off_bus
    device: str  # the GPU's or switch's PCI bus ID in NVML's form (normalise_bus_id)
    code: int  # the XID or SXid number; 0 for a GPU fallen off the bus


def parse_record(line: bytes) -> KmsgRecord | None:
    """One kmsg line as a record; None for anything else (a dmesg line, a continuation, garbage)."""
    kmsg = _KMSG.fullmatch(line)
    if kmsg is None:
        return None
    prio = int(kmsg[1])
    return KmsgRecord(prio >> 3, prio & 7, int(kmsg[2]), int(kmsg[3]) / 1e6, kmsg[5])


def classify(record: KmsgRecord) -> tuple[tuple[KernelEvent, ...], str | None]:
    """The driver's faults in one record, or why a record that names the driver is ignored; ((), None) for the
    driver's other lines and for records that do not name it."""
    text = record.message
    if not SIGNS.search(text):
        return (), None  # the common case, cheap: most of a kernel log is not about GPUs
    if record.facility != KERNEL_FACILITY:
        return (), "user_facility"
    if _CRASH_REPORT.match(text):
        return (), "not_driver"
    if text.startswith(b"NVRM: "):
        return _gpu_driver_line(text)
    if _SWITCH.match(text):
        return _switch_driver_line(text)
    return (), "not_driver"


def _bus(address: bytes) -> str:
    return normalise_bus_id(address.decode("ascii")) or ""  # the patterns admit only what normalises


def _gpu_driver_line(text: bytes) -> tuple[tuple[KernelEvent, ...], str | None]:
    if xid := _XID.match(text):
        device, code = _bus(xid[1]), int(xid[2])
        if code == 79:  # the driver's own word that the GPU fell off the bus (it logs the NVRM: GPU line too)
            return (KernelEvent("xid", device, code), KernelEvent("fallen_off_bus", device, 0)), None
        return (KernelEvent("xid", device, code),), None
    if fallen := _FALLEN.fullmatch(text):
        return (KernelEvent("fallen_off_bus", _bus(fallen[1]), 0),), None
    if text.startswith(b"NVRM: Xid") or b"fallen off the bus" in text:
        return (), "unparsed"  # the driver's fault in a wording this does not know: look at the line
    return (), None  # the driver's other lines: module loaded, persistence mode, ...


def _switch_driver_line(text: bytes) -> tuple[tuple[KernelEvent, ...], str | None]:
    sxid = _SXID.match(text)
    if sxid is None:
        return (), ("unparsed" if b"SXid" in text else None)
    if _SXID_DETAIL.match(sxid[3]):
        return (), None  # the detail lines of the SXid just counted
    return (KernelEvent("sxid", _bus(sxid[1]), int(sxid[2])),), None


class KnownDevices:
    """The PCI addresses that may make keys: this host's GPUs (NVML's and the kernel driver's list) and NVSwitches
    (the PCI bus). Only grows: a GPU that fell off the bus is still the host's. `ready` once the GPUs are known (the
    follower reads nothing before: a line read earlier would be ignored for naming an address not yet known)."""

    def __init__(self, gpus: Iterable[str] = (), switches: Iterable[str] = (), ready: bool = False) -> None:
        self._lock = threading.Lock()
        self._gpus: frozenset[str] = frozenset()
        self._switches: frozenset[str] = frozenset()
        self.ready = threading.Event()
        self.add(gpus, switches, ready)

    def add(self, gpus: Iterable[str] = (), switches: Iterable[str] = (), ready: bool = True) -> None:
        """Add addresses in any spelling NVML, /proc or sysfs use; `ready`: the GPU list is complete."""
        new_gpus = {bus for bus in map(normalise_bus_id, gpus) if bus}
        new_switches = {bus for bus in map(normalise_bus_id, switches) if bus}
        with self._lock:
            if not new_gpus <= self._gpus:
                self._gpus = self._gpus | new_gpus
            if not new_switches <= self._switches:
                self._switches = self._switches | new_switches
        if ready:
            self.ready.set()

    def knows(self, event: KernelEvent) -> bool:
        return event.device in (self._switches if event.kind == "sxid" else self._gpus)


class KernelLogTally:
    """Counters of every event seen, with the time of the latest, and of every line ignored, by reason; bounded
    whatever the log holds (thread-safe: the follower writes, the poller reads)."""

    def __init__(self, devices: KnownDevices) -> None:
        self.devices = devices
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, int], int] = {}  # (kind, device, code) → count
        self._last: dict[tuple[str, str, int], float] = {}  # → seconds since boot of the latest
        self._ignored = dict.fromkeys(IGNORED_REASONS, 0)
        self.records = 0  # records read
        self.replayed = 0  # kmsg records seen before (a reader that reopened the log reads it from boot again)
        self._last_seq = -1  # the highest kmsg sequence number counted
        self._said_not_kmsg = False

    def add_line(self, line: bytes) -> None:
        if len(line) > MAX_LINE_BYTES:
            self._ignore("too_long")
            return
        if line.startswith(b" ") or not line.strip():
            return  # a record's continuation (SUBSYSTEM=, DEVICE=) or a blank line
        record = parse_record(line)
        if record is None:
            self._not_kmsg(line)
            return
        with self._lock:
            if record.seq <= self._last_seq:  # the log read again from boot (a reopened /dev/kmsg, a relay restarted)
                self.replayed += 1
                return
            self._last_seq = record.seq
            self.records += 1
        events, reason = classify(record)
        if reason is not None:
            self._ignore(reason)
        elif events and not self.devices.knows(events[0]):  # the events of one line name one device
            self._ignore("unknown_device")
        elif events:
            self._count(events, record.seconds)

    def _count(self, events: tuple[KernelEvent, ...], seconds: float) -> None:
        with self._lock:
            for event in events:
                key = (event.kind, event.device, event.code)
                if key not in self._counts and len(self._counts) >= MAX_KEYS:
                    self._ignored["table_full"] += 1
                    continue
                self._counts[key] = self._counts.get(key, 0) + 1
                self._last[key] = seconds

    def _ignore(self, reason: str) -> None:
        with self._lock:
            self._ignored[reason] += 1

    def _not_kmsg(self, line: bytes) -> None:
        self._ignore("unparsed")
        if not self._said_not_kmsg and SIGNS.search(line):
            self._said_not_kmsg = True
            log.warning(
                "kernel log: a line naming the driver is not a /dev/kmsg record (dmesg text?), not counted: only "
                "/dev/kmsg's records say who logged them; hand over a copy of /dev/kmsg (dd if=/dev/kmsg "
                "iflag=nonblock) or the device itself"
            )

    def counts(self) -> dict[tuple[str, str, int], tuple[int, float]]:
        """(kind, device, code) → (count, seconds since boot of the latest)."""
        with self._lock:
            return {key: (count, self._last[key]) for key, count in self._counts.items()}

    def ignored(self) -> dict[str, int]:
        """Lines ignored since the reading began, per reason (every reason, zeros included)."""
        with self._lock:
            return dict(self._ignored)


def on_wall_clock(
    counts: dict[tuple[str, str, int], tuple[int, float]], boot_wall: float
) -> dict[tuple[str, str, int], tuple[int, float]]:
    """`counts` with each latest time as wall time: `boot_wall` is when the host booted (the kernel log's times are
    seconds since then)."""
    return {key: (count, boot_wall + seconds) for key, (count, seconds) in counts.items()}


def with_kernel_xids(
    nvml: dict[tuple[str, int], tuple[int, float]],
    kernel: dict[tuple[str, str, int], tuple[int, float]],
    bus_ids: dict[str, str],
) -> dict[tuple[str, int], tuple[int, float]]:
    """NVML's XID counts (since the exporter started) merged with the kernel log's (since boot, wall times): per
    (UUID, XID) the larger count and the later time, so one XID that both reported counts once, one NVML never
    reported (79 and others, or one from before the start) counts, and a restart neither loses nor repeats them.
    `bus_ids`: NVML's PCI bus ID → UUID."""
    if not kernel:
        return nvml
    by_key = {normalise_bus_id(bus_id): uuid for bus_id, uuid in bus_ids.items()}
    merged = dict(nvml)
    for (kind, device, code), (count, last) in kernel.items():
        uuid = by_key.get(device)
        if kind != "xid" or uuid is None:
            continue
        known_count, known_last = merged.get((uuid, code), (0, 0.0))
        merged[(uuid, code)] = (max(known_count, count), max(known_last, last))
    return merged
