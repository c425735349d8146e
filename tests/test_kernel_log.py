"""The kernel log's GPU faults (issues 39 and 48): parsing /dev/kmsg records, what counts (the driver's own records
naming this host's devices) and why the rest is ignored, the bounded tally, the follower thread over real files: a
boot log recorded from /dev/kmsg on a lent 2x H200 (driver 580.159.04, tests/data/kmsg), and records written here in
the formats the driver and the kernel use (the crash reports as this build machine's kernel wrote them, 6.18). The
real /dev/kmsg, with forgeries by an unprivileged user: tests/test_kernel_log_forgery.py."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from gpuwarden.collect.kernel_log import (
    IGNORED_REASONS,
    MAX_KEYS,
    KernelLogTally,
    KnownDevices,
    classify,
    parse_record,
)
from gpuwarden.collect.kernel_log_follower import KernelLogFollower
from gpuwarden.model.pci import normalise_bus_id
from gpuwarden.nvml.nvswitches import read_nvswitches
from tests.helpers.common import parse_exposition, wait_for

H200_BOOT = Path(__file__).parent / "data" / "kmsg" / "h200x2-boot.kmsg"
H200_GPUS = ("0000:00:06.0", "0000:00:07.0")  # the lent H200s, passed through to a VM
# the driver's and the kernel's own formats (gpud's scans of dmesg show the XID lines; the trap is the one issue 39
# recorded on H200 when a misused fabric query crashed a process inside libnvidia-ml)
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_13 = "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"  # noqa: E501
XID_109 = "NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005"  # noqa: E501
SXID = "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
FALLEN = "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."
TRAP = "traps: python3[647] general protection fault ip:7f0a1c2b3d4e sp:7ffc1a2b3c40 error:0 in libnvidia-ml.so.580.159.04[7f0a1c000000+1f4000]"  # noqa: E501
HOST = KnownDevices(gpus=("0000:3b:00.0", "0000:cb:00.0"), switches=("0000:86:00.0",), ready=True)


def kmsg(seq: int, seconds: float, message: str, prio: int = 3, flags: str = "-") -> bytes:
    return f"{prio},{seq},{int(seconds * 1e6)},{flags};{message}\n".encode()


def record(message: str, prio: int = 3, flags: str = "-"):  # noqa: ANN201 - a KmsgRecord
    parsed = parse_record(kmsg(1, 12.5, message, prio, flags).rstrip(b"\n"))
    assert parsed is not None
    return parsed


def test_a_real_boot_log_reads_whole_and_holds_no_gpu_fault():
    tally = KernelLogTally(KnownDevices(gpus=H200_GPUS, ready=True))
    for line in H200_BOOT.read_bytes().split(b"\n"):
        tally.add_line(line)
    assert tally.records == 371  # every record; its 94 continuation lines are not records
    assert tally.counts() == {}  # four NVRM lines (module load, FBHUB, persistence): no fault
    assert tally.ignored() == dict.fromkeys(IGNORED_REASONS, 0)  # the driver's other lines are not "ignored"


SXID_1004 = "nvidia-nvswitch0: SXid (PCI:0000:86:00.0): 01004, Non-fatal, Link 12 RX Short Error Rate"
SXID_SEVERITY = "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Severity 1 Engine instance 30 Sub-engine instance 00"
SXID_DATA = "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Data {0x00000000, 0x00000000, 0x00000000}"
# crash reports as this build machine's kernel (6.18) wrote them for processes of user nobody
GP_IN_LIBCUDA = "traps: python[19416] general protection fault ip:7f01d0fc000a sp:7ffd9fc7e938 error:0 in libcuda.so.1[a,7f01d0fc0000+1000]"  # noqa: E501
IN_A_FILE_NAMED_XID = "python[19406]: segfault at 0 ip 00007f3750fc0000 sp 00007ffeff220308 error 4 in NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus[0,7f3750fc0000+1000] likely on CPU 1 (core 1, socket 0)"  # noqa: E501
NAMED_LIKE_XID = "NVRM: Xid (PCI:[19407]: segfault at 0 ip 00007ff57e985ad8 sp 00007fff31a4e998 error 4 in libc.so.6[167ad8,7ff57e844000+156000] likely on CPU 1 (core 1, socket 0)"  # noqa: E501
NAMED_LIKE_FALLEN = (
    "NVRM: GPU 0000:[7]: segfault at 0 ip 0 sp 0 error 4 in NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.[0+1000]"  # noqa: E501
)
NEWLINE_IN_FILE_NAME = "python[19418]: segfault at 0 ip 00007f9feddc1000 sp 00007ffd31f4e108 error 4 in x\\x0aNVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, DBE[0,7f9feddc1000+1000]"  # noqa: E501
CONTINUATION = " in NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.[0,7f60+1000]"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (XID_79, {("xid", "00000000:3B:00.0", 79), ("fallen_off_bus", "00000000:3B:00.0", 0)}),
        (XID_13, {("xid", "00000000:CB:00.0", 13)}),
        (XID_109, {("xid", "00000000:CB:00.0", 109)}),
        (SXID, {("sxid", "00000000:86:00.0", 20034)}),
        (SXID_1004, {("sxid", "00000000:86:00.0", 1004)}),
        (FALLEN, {("fallen_off_bus", "00000000:3B:00.0", 0)}),
    ],
)
def test_the_drivers_own_records_are_read_with_their_device(message, expected):
    events, reason = classify(record(message))
    assert {(e.kind, e.device, e.code) for e in events} == expected and reason is None
    # the driver prints with KERN_CONT (flag c: tests/data/kmsg), and a kernel with CONFIG_PRINTK_CALLER adds a field
    assert classify(record(message, prio=4, flags="c,caller=T1797828"))[0] == events


@pytest.mark.parametrize(
    ("message", "prio", "reason"),
    [
        # the driver's other lines, and the detail lines the switch driver prints after each SXid: nothing
        ("NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build", 3, None),
        (SXID_SEVERITY, 3, None),
        (SXID_DATA, 3, None),
        ("eth0: link up", 6, None),
        # user space writing to /dev/kmsg: the kernel makes facility 0 into 1 (user), level kept: prio 8 + level
        (XID_79, 8 + 3, "user_facility"),
        (SXID, 3 * 8 + 3, "user_facility"),  # a daemon's
        # crash reports: the process names itself (15 bytes) and the file it crashed in
        (TRAP, 6, "not_driver"),
        (GP_IN_LIBCUDA, 6, "not_driver"),
        (IN_A_FILE_NAMED_XID, 6, "not_driver"),
        (NAMED_LIKE_XID, 6, "not_driver"),
        (NAMED_LIKE_FALLEN, 6, "not_driver"),
        # a file name's newline: /dev/kmsg escapes it inside the one record (dmesg prints it as a line of its own)
        (NEWLINE_IN_FILE_NAME, 6, "not_driver"),
        # a continuation the kernel could not append (another CPU's record came between): its own record, flag c
        (CONTINUATION, 6, "not_driver"),
        ('audit: type=1400 name="NVRM: Xid (PCI:0000:3b:00): 79, "', 5, "not_driver"),
        # the driver's wording, a format this does not know: not guessed, counted for a person to look at
        ("NVRM: Xid (PCI:0000:3B:00): 79, upper-case address", 3, "unparsed"),
        ("NVRM: Xid (PCI:0000:3b:00): 1234, a four-digit XID", 3, "unparsed"),
        ("nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 2034, four digits", 3, "unparsed"),
        ("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus. and more", 3, "unparsed"),
    ],
)
def test_driver_text_anywhere_but_at_the_start_of_a_kernel_record_counts_for_nothing(message, prio, reason):
    assert classify(record(message, prio)) == ((), reason)


def test_lines_that_are_no_kmsg_record_are_unparsed_and_a_dmesg_dump_is_said_once(caplog):
    """dmesg text has no facility and prints a file name's newline as a line of its own: not read."""
    tally = KernelLogTally(HOST)
    for line in (b"[ 3878.917000] " + XID_79.encode(), b"<3>[ 3878.917000] " + XID_13.encode(), b"garbage;", b"3,x"):
        tally.add_line(line)
    assert tally.counts() == {} and tally.ignored()["unparsed"] == 4 and tally.records == 0
    assert len([r for r in caplog.records if "not a /dev/kmsg record" in r.getMessage()]) == 1
    assert parse_record(b" SUBSYSTEM=pci") is None
    assert parse_record(kmsg(7, 3878.917, XID_13).rstrip(b"\n")).seconds == 3878.917
    assert normalise_bus_id("0000:3b:00") == normalise_bus_id("00000000:3B:00.0") == "00000000:3B:00.0"


def test_only_this_hosts_gpus_and_nvswitches_make_keys():
    tally = KernelLogTally(HOST)
    for seq, message in enumerate(
        (
            XID_79,
            SXID,
            "NVRM: Xid (PCI:0000:f8:00): 79, pid=1, name=x, a GPU this host does not have",
            "nvidia-nvswitch9: SXid (PCI:0000:cb:00.0): 20034, Fatal, a GPU's address for a switch",
            "NVRM: Xid (PCI:0000:86:00): 48, pid=1, name=x, a switch's address for a GPU",
        )
    ):
        tally.add_line(kmsg(seq, seq, message).rstrip(b"\n"))
    assert set(tally.counts()) == {
        ("xid", "00000000:3B:00.0", 79),
        ("fallen_off_bus", "00000000:3B:00.0", 0),
        ("sxid", "00000000:86:00.0", 20034),
    }
    assert tally.ignored()["unknown_device"] == 3


def test_the_table_is_bounded_by_the_hosts_devices_and_a_full_one_counts_its_drops():
    """Keys are this host's devices x codes (XID 1-999, SXid five digits); MAX_KEYS is a last bound, never reached
    on a real host: a host made to name more devices shows what it drops."""
    many = KnownDevices(gpus=[f"0000:{n // 256:02x}:{n % 256:02x}.0" for n in range(MAX_KEYS + 50)], ready=True)
    tally = KernelLogTally(many)
    for n in range(MAX_KEYS + 50):
        tally.add_line(kmsg(n, n, f"NVRM: Xid (PCI:0000:{n // 256:02x}:{n % 256:02x}): 13, pid=1, x").rstrip(b"\n"))
    assert len(tally.counts()) == MAX_KEYS and tally.ignored()["table_full"] == 50


def test_a_long_log_keeps_memory_bounded_and_counts_every_fault():
    """200,000 lines, a fault every 100th: the counters count them all with the latest's time, and the tally's
    memory after the second 100,000 is what it was after the first."""

    def lines(first: int) -> list[bytes]:
        return [
            kmsg(n, n / 100, XID_13 if n % 200 == 0 else SXID) if n % 100 == 0 else kmsg(n, n / 100, f"eth0: up {n}")
            for n in range(first, first + 100_000)
        ]

    tally = KernelLogTally(HOST)
    tracemalloc.start()
    for line in lines(0):
        tally.add_line(line.rstrip(b"\n"))
    first, _ = tracemalloc.get_traced_memory()
    for line in lines(100_000):
        tally.add_line(line.rstrip(b"\n"))
    second, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert tally.records == 200_000
    counts = tally.counts()
    assert counts[("xid", "00000000:CB:00.0", 13)][0] == 1000 and counts[("sxid", "00000000:86:00.0", 20034)][0] == 1000
    assert counts[("xid", "00000000:CB:00.0", 13)][1] == pytest.approx(1998.0)  # the latest's time since boot
    assert second - first < 64 * 1024  # nothing grows with the log's length


def test_nvswitches_are_the_nvidia_bridges_on_the_pci_bus(tmp_path):
    """sysfs as the kernel lays it out: a GPU, its audio function, an NVSwitch, another vendor's bridge."""
    devices = tmp_path / "devices"
    for address, vendor, klass in (
        ("0000:18:00.0", "0x10de", "0x030200"),
        ("0000:18:00.1", "0x10de", "0x040300"),
        ("0000:86:00.0", "0x10de", "0x068000"),
        ("0000:00:1f.0", "0x8086", "0x068000"),
    ):
        (devices / address).mkdir(parents=True)
        (devices / address / "vendor").write_text(vendor + "\n")
        (devices / address / "class").write_text(klass + "\n")
    (devices / "0000:99:00.0").mkdir()  # a device whose files cannot be read
    assert read_nvswitches(devices) == ["0000:86:00.0"]
    assert read_nvswitches(tmp_path / "missing") == []


def follower(path: Path, devices: KnownDevices = HOST) -> tuple[KernelLogFollower, KernelLogTally]:
    tally = KernelLogTally(devices)
    reader = KernelLogFollower(path, tally)
    reader.start()
    return reader, tally


def test_the_follower_waits_for_the_hosts_gpus_then_reads_from_boot_then_what_is_appended(tmp_path):
    log = tmp_path / "kmsg"
    log.write_bytes(H200_BOOT.read_bytes() + kmsg(900, 4000.0, XID_79))
    devices = KnownDevices(switches=("0000:86:00.0",))
    reader, tally = follower(log, devices)
    try:
        assert not reader.reading and tally.records == 0  # NVML's discovery is under way: nothing read yet
        devices.add(gpus=("00000000:3B:00.0",))  # as the poller adds NVML's bus IDs after discovery
        wait_for(lambda: reader.caught_up.is_set() and tally.records == 372, timeout=30)
        assert reader.reading and tally.counts()[("xid", "00000000:3B:00.0", 79)] == (1, 4000.0)  # from before
        with log.open("ab") as handle:
            handle.write(kmsg(901, 4100.0, TRAP, prio=6) + b" SUBSYSTEM=pci\n" + kmsg(902, 4101.0, SXID))
        wait_for(lambda: ("sxid", "00000000:86:00.0", 20034) in tally.counts(), timeout=30)
        assert tally.ignored() == {**dict.fromkeys(IGNORED_REASONS, 0), "not_driver": 1}
        assert reader.unavailable is None
    finally:
        reader.stop()
        reader.join(10)


def test_a_10_mb_line_is_dropped_and_counted_once_and_reading_goes_on(tmp_path):
    log = tmp_path / "kmsg"
    log.write_bytes(kmsg(1, 1.0, XID_13) + b"x" * (10 * 1024 * 1024) + b"\n" + kmsg(2, 2.0, SXID))
    reader, tally = follower(log)
    try:
        wait_for(lambda: reader.caught_up.is_set() and tally.records == 2, timeout=30)
        assert tally.ignored()["too_long"] == 1 and set(tally.counts()) == {
            ("xid", "00000000:CB:00.0", 13),
            ("sxid", "00000000:86:00.0", 20034),
        }
    finally:
        reader.stop()
        reader.join(10)


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_unreadable_log_is_said_once_and_the_reader_stays(tmp_path, kind, caplog):
    path = tmp_path / "kmsg"
    if kind == "directory":
        path.mkdir()
    reader, tally = follower(path)
    try:
        wait_for(lambda: reader.unavailable is not None, timeout=30)
        assert str(path) in reader.unavailable and tally.records == 0 and not reader.reading
        assert reader._thread.is_alive()  # it tries again later; the exporter serves the rest meanwhile
        warnings = [r for r in caplog.records if "kernel log not read" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        reader.stop()
        reader.join(10)


def test_xids_the_kernel_logged_count_on_the_gpu_they_name_once_each_and_from_before_the_start(live_server, tmp_path):
    """Through the exporter (the simulator beneath the real pynvml, the kernel log a file): an XID 79 logged 5 s
    ago, which NVML's events never report, is GPU 1's (PCI 0000:28:00) and makes its verdict critical; an XID 13 from
    boot counts but is not recent; one appended while it runs counts at once; a GPU the node does not have and a
    process's crash report are ignored and counted; the reader says it reads."""
    log = tmp_path / "kmsg"
    now, wall = time.monotonic(), time.time()
    log.write_bytes(
        H200_BOOT.read_bytes()
        + kmsg(900, 10.0, "NVRM: Xid (PCI:0000:28:00): 13, pid=77, name=python, Graphics Exception")
        + kmsg(
            901, now - 5, "NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
        )
        + kmsg(902, now - 4, "NVRM: Xid (PCI:0000:f8:00): 79, pid=1, name=x, a GPU this node does not have")
        + kmsg(903, now - 3, SXID)
        + kmsg(904, now - 2, TRAP, prio=6)
    )
    server = live_server({"node": {"count": 2}}, nvml={"kernel_log": str(log)})

    def xids() -> dict:
        series = parse_exposition(server.get("/metrics").text)
        return {(lab["gpu"], lab["xid"]): v for (_, lab), v in _labelled(series, "gpuwarden_xid_errors_total")}

    wait_for(lambda: xids() == {("1", "13"): 1, ("1", "79"): 1}, timeout=30)
    series = parse_exposition(server.get("/metrics").text)
    kernel = {
        (name, tuple(sorted(labels.items()))): v for (name, labels), v in _labelled_any(series, "gpuwarden_kernel_")
    }
    ignored = {"unknown_device": 1, "not_driver": 1}  # the other reasons: no series until a line is ignored
    assert kernel == {
        ("gpuwarden_kernel_fallen_off_bus_total", (("gpu", "1"), ("uuid", gpus_uuid(server, 1)))): 1,
        ("gpuwarden_kernel_sxid_errors_total", (("switch", "00000000:86:00.0"), ("sxid", "20034"))): 1,
        # the records' wall times: now less their age on the monotonic clock the kernel stamps with
        ("gpuwarden_kernel_sxid_last_timestamp_seconds", (("switch", "00000000:86:00.0"), ("sxid", "20034"))): (
            pytest.approx(wall - 3, abs=2)
        ),
        ("gpuwarden_kernel_log_up", ()): 1,
        **{("gpuwarden_kernel_log_lines_ignored_total", (("reason", r),)): n for r, n in ignored.items()},
    }, kernel
    gpus = {gpu["index"]: gpu for gpu in server.get("/api/v1/health").json()["gpus"]}
    xid = gpus[1]["checks"]["xid"]
    assert xid["severity"] == "critical" and "79" in xid["observed"], xid  # XID 13 (at boot) is outside the window
    assert gpus[0]["checks"]["xid"]["severity"] == "ok"
    with log.open("ab") as handle:
        handle.write(kmsg(905, time.monotonic(), "NVRM: Xid (PCI:0000:28:00): 13, pid=78, name=python, again"))
    wait_for(lambda: xids() == {("1", "13"): 2, ("1", "79"): 1}, timeout=30)


def test_the_reader_says_when_it_does_not_read_and_nothing_when_no_log_is_read(live_server, tmp_path):
    unreadable = tmp_path / "kmsg"
    unreadable.mkdir()
    server = live_server({"node": {"count": 1}}, nvml={"kernel_log": str(unreadable)})
    reader = server.pipeline.poller.kernel_reader
    wait_for(lambda: reader.unavailable is not None, timeout=30)
    wait_for(lambda: _up(server) == 0, timeout=30)
    off = live_server({"node": {"count": 1}}, nvml={"kernel_log": "off"})
    wait_for(lambda: off.get("/metrics").status_code == 200 and "gpuwarden_gpu_up" in off.get("/metrics").text)
    assert _up(off) is None and "gpuwarden_kernel_log_lines_ignored_total" not in off.get("/metrics").text


def test_a_host_whose_driver_lists_no_gpu_reads_its_log_after_nvmls_discovery(live_server, tmp_path):
    """/proc/driver/nvidia not mounted (the driver lists nothing here): the reader starts once NVML named the GPUs,
    and the XID logged before the start counts."""
    log = tmp_path / "kmsg"
    log.write_bytes(kmsg(900, 10.0, "NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=python, DBE"))
    server = live_server({"node": {"count": 1}, "driver": {"lists_gpus": False}}, nvml={"kernel_log": str(log)})
    wait_for(lambda: _up(server) == 1, timeout=30)
    wait_for(lambda: 'gpuwarden_xid_errors_total{gpu="0"' in server.get("/metrics").text, timeout=30)


def _up(server) -> float | None:  # noqa: ANN001 - the live server
    series = parse_exposition(server.get("/metrics").text)
    return series.get(("gpuwarden_kernel_log_up", frozenset()))


def _labelled(series: dict, name: str) -> list:
    return [((key[0], dict(key[1])), value) for key, value in series.items() if key[0] == name]


def _labelled_any(series: dict, prefix: str) -> list:
    return [((key[0], dict(key[1])), value) for key, value in series.items() if key[0].startswith(prefix)]


def gpus_uuid(server, index: int) -> str:  # noqa: ANN001 - the live server
    return server.get(f"/api/v1/gpus/{index}").json()["uuid"]


def test_a_log_read_again_from_boot_counts_each_record_once():
    """A reader that reopens /dev/kmsg (after an error) or a relay that restarts reads the log from boot again:
    records whose kmsg sequence number was already counted are skipped."""
    tally = KernelLogTally(HOST)
    log = kmsg(10, 5.0, XID_13) + kmsg(11, 6.0, SXID)
    for line in (log + log + kmsg(12, 7.0, XID_13)).splitlines():
        tally.add_line(line)
    counts = {key: count for key, (count, _) in tally.counts().items()}
    assert counts == {("xid", "00000000:CB:00.0", 13): 2, ("sxid", "00000000:86:00.0", 20034): 1}
    assert tally.replayed == 2 and tally.records == 3
