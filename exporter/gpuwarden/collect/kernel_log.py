"""The kernel log's GPU faults: what NVML's event API never saw (issue 39).

NVML reports XIDs only while a process is subscribed; the kernel log keeps every `NVRM: Xid` line since boot (as far
as its ring holds), NVSwitch `SXid` errors, "GPU has fallen off the bus", and the traps of processes that crash
inside libnvidia-ml or libcuda. This module turns /dev/kmsg records into those events and keeps a bounded tally:
counters per (GPU PCI address, XID), per (switch, SXid), per library, with the time of the latest. It reads
nothing itself; collect/kernel_log_follower.py feeds it.

/dev/kmsg record format (Documentation/ABI/testing/dev-kmsg): `PRIO,SEQ,TIMESTAMP_US,FLAGS[,...];MESSAGE`, then
continuation lines that start with a space (` SUBSYSTEM=pci`, ` DEVICE=+pci:0000:3b:00.0`). Lines written by
`dmesg` (`[  123.456789] MESSAGE`) are accepted too, for a log handed over as a file.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from gpuwarden.model.pci import normalise_bus_id

MAX_LINE_BYTES = 8192  # a kmsg record is at most ~1 KiB; anything longer is not a kernel record: counted, dropped
MAX_KEYS = 1024  # distinct (kind, device, code) counted; a log naming more devices than a node has is not trusted

_KMSG = re.compile(rb"^(\d+),(\d+),(\d+),[^;]*;(.*)$")
_DMESG = re.compile(rb"^\[\s*(\d+)\.(\d+)\]\s?(.*)$")
# NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\): (\d{1,4})\b")
# nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Fatal, Link 30 LTSSM Fault Up
_SXID = re.compile(r"nvidia-nvswitch(\d+): SXid \(PCI:([0-9a-fA-F:.]{7,16})\): (\d{1,6})\b")
# NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.  (also the tail of Xid 79's line)
_FALLEN = re.compile(
    r"NVRM: GPU ([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?: GPU has fallen off the bus"
)
# traps: python3[647] general protection fault ip:... in libnvidia-ml.so.580.159.04[7f..+..]
# python3[1234]: segfault at 0 ip ... error 4 in libcuda.so.580.159.04[7f..+..]
_TRAP = re.compile(
    r"(?:traps: )?(\S{1,64})\[(\d+)\]:? (general protection fault|segfault at|trap [^ ]+)"
    r".* in (libnvidia-ml|libcuda)\.so"
)


@dataclass(frozen=True, slots=True)
class KernelEvent:
    """One GPU fault the kernel logged. `seconds` is the record's time since boot."""

    kind: str  # xid | sxid | fallen_off_bus | trap
    device: str  # the GPU's or switch's PCI bus ID in NVML's form (normalise_bus_id), or a trap's library
    code: int  # the XID or SXid number; 0 otherwise (not a trap's PID: PIDs would grow the counters without bound)
    seconds: float


def parse_record(line: bytes) -> tuple[float, str, int | None] | None:
    """(seconds since boot, message, kmsg sequence number or None for a dmesg line) of one line; None for a
    continuation line or one that does not parse (the caller counts those)."""
    if line.startswith(b" "):
        return None
    kmsg = _KMSG.match(line)
    if kmsg:
        return int(kmsg.group(3)) / 1e6, kmsg.group(4).decode("utf-8", "replace"), int(kmsg.group(2))
    dmesg = _DMESG.match(line)
    if dmesg:
        whole, fraction = dmesg.group(1), dmesg.group(2)
        return int(whole) + int(fraction) / 10 ** len(fraction), dmesg.group(3).decode("utf-8", "replace"), None
    return None


def classify(seconds: float, message: str) -> list[KernelEvent]:
    """The GPU faults in one message (Xid 79's line is both an XID and a GPU fallen off the bus)."""
    if "NVRM" not in message and "nvswitch" not in message and " in lib" not in message:
        return []  # the common case, cheap: most of a kernel log is not about GPUs
    events = []
    if xid := _XID.search(message):
        events.append(KernelEvent("xid", normalise_bus_id(xid.group(1)) or "", int(xid.group(2)), seconds))
        if "fallen off the bus" in message:
            events.append(KernelEvent("fallen_off_bus", events[0].device, 0, seconds))
    elif fallen := _FALLEN.search(message):
        events.append(KernelEvent("fallen_off_bus", normalise_bus_id(fallen.group(1)) or "", 0, seconds))
    if sxid := _SXID.search(message):
        events.append(KernelEvent("sxid", normalise_bus_id(sxid.group(2)) or "", int(sxid.group(3)), seconds))
    if trap := _TRAP.search(message):
        events.append(KernelEvent("trap", trap.group(4), 0, seconds))
    return [event for event in events if event.device]  # an address that is not one names no device


class KernelLogTally:
    """Counters of every event seen, with the time of the latest; bounded whatever the log's length (thread-safe:
    the follower writes, the poller reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, int], int] = {}  # (kind, device, code) → count
        self._last: dict[tuple[str, str, int], float] = {}  # → seconds since boot of the latest
        self.records = 0  # records read
        self.unparsed = 0  # lines that were neither a record nor a continuation, or too long
        self.overflow = 0  # events past MAX_KEYS distinct keys: counted here only
        self.replayed = 0  # kmsg records seen before (a reader that reopened the log reads it from boot again)
        self._last_seq = -1  # the highest kmsg sequence number counted

    def add_line(self, line: bytes) -> None:
        if len(line) > MAX_LINE_BYTES:
            with self._lock:
                self.unparsed += 1
            return
        if line.startswith(b" ") or not line.strip():
            return  # a record's continuation (SUBSYSTEM=, DEVICE=) or a blank line
        parsed = parse_record(line)
        with self._lock:
            if parsed is None:
                self.unparsed += 1
                return
            seconds, message, seq = parsed
            if seq is not None:
                if seq <= self._last_seq:  # the log read again from boot (a reopened /dev/kmsg, a relay restarted)
                    self.replayed += 1
                    return
                self._last_seq = seq
            self.records += 1
            for event in classify(seconds, message):
                key = (event.kind, event.device, event.code)
                if key not in self._counts and len(self._counts) >= MAX_KEYS:
                    self.overflow += 1
                    continue
                self._counts[key] = self._counts.get(key, 0) + 1
                self._last[key] = event.seconds

    def counts(self) -> dict[tuple[str, str, int], tuple[int, float]]:
        """(kind, device, code) → (count, seconds since boot of the latest)."""
        with self._lock:
            return {key: (count, self._last[key]) for key, count in self._counts.items()}


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
