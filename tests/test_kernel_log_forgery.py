"""Issue 48: kernel-log forgeries move no counter and no verdict, and cannot hide a real fault.

The first test forges on the real kernel: processes of user nobody (no capability left) crash inside files named
like the driver's lines (an XID 79, an SXid, a GPU fallen off the bus, a file name with a newline in it) and under a
15-byte name that reads `NVRM: Xid (PCI:`, and one traps inside a file called libcuda.so.1; root writes two driver
lines to /dev/kmsg (they become facility user). The exporter reads the real /dev/kmsg, as the Helm chart's relay
does (root here), over the simulator's 8 GPUs, GPU 0 at the PCI address the forgeries name: no counter or verdict
moves, the ignored counter shows each forgery, and `npd-plugin` and `slurm-healthcheck` (a real Slurm on loopback)
find nothing. The second: 10,000 forged lines in a kmsg-format file, then real driver lines, which still count."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from gpuwarden.collect.kernel_log import IGNORED_REASONS, MAX_KEYS
from tests.helpers.common import parse_exposition, wait_for
from tests.helpers.kmsg_forgery import (
    crash_as_nobody,
    forged_lines,
    kernel_records,
    kmsg_line,
    why_no_real_forgery,
    write_user_record,
)
from tests.helpers.slurm import SlurmCluster, missing
from tests.test_npd_plugin import FAMILIES, plugin
from tests.test_slurm_healthcheck import healthcheck

GPU0 = "0000:18:00"  # the simulator's GPU 0, as the driver names it
SWITCH0 = "0000:86:00.0"  # the simulator's NVSwitch 0
FAULT_FAMILIES = (
    "gpuwarden_xid_errors_total",
    "gpuwarden_xid_last_timestamp_seconds",
    "gpuwarden_kernel_sxid_errors_total",
    "gpuwarden_kernel_sxid_last_timestamp_seconds",
    "gpuwarden_kernel_fallen_off_bus_total",
)
# (how the process crashes, the file it crashes in or its own name, the text the kernel's record then holds)
CRASHES = (
    ("segfault", f"NVRM: Xid (PCI:{GPU0}): 79, GPU has fallen off the bus", f"in NVRM: Xid (PCI:{GPU0}): 79,"),
    ("comm", "NVRM: Xid (PCI:0000:18:00): 79", "NVRM: Xid (PCI:["),  # the name is cut to 15 bytes
    ("general_protection", "libcuda.so.1", "general protection fault"),
    ("segfault", f"nvidia-nvswitch0: SXid (PCI:{SWITCH0}): 20034, Fatal, Link 30", "in nvidia-nvswitch0: SXid"),
    ("segfault", f"NVRM: GPU {GPU0}.0: GPU has fallen off the bus.", f"in NVRM: GPU {GPU0}.0: GPU has fallen"),
    ("segfault", f"x\nNVRM: Xid (PCI:{GPU0}): 48, pid=1, name=x, DBE", f"in x\\x0aNVRM: Xid (PCI:{GPU0}): 48"),
)
USER_RECORDS = (
    f"NVRM: Xid (PCI:{GPU0}): 79, pid=1, name=x, GPU has fallen off the bus.",
    f"nvidia-nvswitch0: SXid (PCI:{SWITCH0}): 20034, Fatal, Link 30 LTSSM Fault Up",
)


def series(server) -> dict:  # noqa: ANN001 - the live server
    return parse_exposition(server.get("/metrics").text)


def ignored(server) -> dict[str, float]:  # noqa: ANN001
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in series(server).items()
        if name == "gpuwarden_kernel_log_lines_ignored_total"
    }


def faults(server) -> dict:  # noqa: ANN001
    return {key: value for key, value in series(server).items() if key[0] in FAULT_FAMILIES}


def verdicts(server) -> dict[tuple[int, str], str]:  # noqa: ANN001
    return {
        (gpu["index"], check): verdict["severity"]
        for gpu in server.get("/api/v1/health").json()["gpus"]
        for check, verdict in gpu["checks"].items()
    }


def forge_on_the_real_kernel(folder: Path) -> dict[int, str]:
    """Each crash of CRASHES by user nobody, until the kernel logged it (printk's rate limit may drop a report:
    tried again, at most once a second, for 60 s); PID → the record's text."""
    logged = {}
    for kind, name, sign in CRASHES:
        deadline = time.monotonic() + 60
        while True:
            pid = crash_as_nobody(kind, folder, name)
            found = [r for r in kernel_records() if f"[{pid}]".encode() in r and sign.encode() in r]
            if found:
                logged[pid] = found[0].decode(errors="replace")
                break
            assert time.monotonic() < deadline, f"the kernel logged no report of the {kind} crash ({name!r})"
            time.sleep(1.0)  # printk_ratelimit: 10 reports per 5 s, shared by the whole kernel
    return logged


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.skipif(why_no_real_forgery() is not None, reason=why_no_real_forgery() or "")
@pytest.mark.skipif(bool(missing()), reason=f"Slurm not installed ({', '.join(missing())}; the test command does)")
def test_an_unprivileged_users_crashes_move_no_counter_no_verdict_and_no_remediation(live_server, tmp_path):
    server = live_server("healthy", nvml={"kernel_log": "/dev/kmsg"})
    reader = server.pipeline.poller.kernel_reader
    wait_for(lambda: reader is not None and reader.caught_up.is_set(), timeout=60)
    wait_for(lambda: series(server).get(("gpuwarden_kernel_log_up", frozenset())) == 1, timeout=30)
    wait_for(lambda: len(verdicts(server)) > 0, timeout=30)
    before_faults, before_verdicts = faults(server), verdicts(server)
    before = {**dict.fromkeys(IGNORED_REASONS, 0), **ignored(server)}  # what earlier runs left in the ring
    with tempfile.TemporaryDirectory(prefix="gpuwarden-forge-") as folder:
        Path(folder).chmod(0o1777)  # nobody's to write in, as /tmp is
        logged = forge_on_the_real_kernel(Path(folder))
    for text in USER_RECORDS:
        write_user_record(f"{text} gpuwarden-test")
    expected = {"not_driver": len(CRASHES), "user_facility": len(USER_RECORDS)}
    wait_for(lambda: all(ignored(server).get(r, 0) - before[r] >= n for r, n in expected.items()), timeout=30)
    published = server.pipeline.snapshot.id
    wait_for(lambda: server.pipeline.snapshot.id > published + 1, timeout=30)  # a publication after the reading
    after = {**dict.fromkeys(IGNORED_REASONS, 0), **ignored(server)}
    assert faults(server) == before_faults == {}, faults(server)
    for severity in (before_verdicts, verdicts(server)):  # nothing at fault, before or after (pending: a window)
        assert set(severity.values()) <= {"ok", "pending"}, severity
    assert after["unknown_device"] == before["unknown_device"] and after["table_full"] == 0
    state = tmp_path / "npd"
    for family in FAMILIES:
        code, out, err, _ = plugin(server.url, family, state, "--debounce", "1")
        assert code == 0 and err == "", (family, code, out, err)
    cluster = SlurmCluster(tmp_path / "slurm").start()
    try:
        code, out = healthcheck(cluster, server.url, tmp_path / "slurm-state")
        assert code == 0 and "drain" not in cluster.node("gpu-1")[0], out
    finally:
        cluster.stop()
    print(f"forged on the real kernel ({len(logged)} crash reports by nobody, {len(USER_RECORDS)} user records):")
    for pid, text in logged.items():
        print(f"  [{pid}] {text[:160]}")
    print(f"ignored by reason, before {before}, after {after}; npd-plugin rc 0 for {', '.join(FAMILIES)}; "
          f"slurm-healthcheck rc 0, gpu-1 not drained")  # fmt: skip


def test_after_10000_forged_lines_real_driver_lines_still_count(live_server, tmp_path):
    """A kmsg-format file: 10,000 forgeries (driver lines of facility user, crash reports naming the driver, driver
    lines naming 2,000 addresses this host does not have, driver wording that does not parse, dmesg text), then an
    XID 79, an XID 48 and an SXid 20034 by the driver, just logged: the three count, with their verdicts; the ignored
    counter holds every forgery by reason; the table holds four keys."""
    log = tmp_path / "kmsg"
    lines, expected = forged_lines(10_000, GPU0, SWITCH0)
    now = time.monotonic()
    real = (
        kmsg_line(20_001, now - 3, "NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", flags="c")  # noqa: E501
        + kmsg_line(20_002, now - 2, "NVRM: Xid (PCI:0000:38:00): 48, pid=4242, name=python, Ch 00000010, An uncorrectable double bit error", flags="c")  # noqa: E501
        + kmsg_line(20_003, now - 1, "nvidia-nvswitch3: SXid (PCI:0000:89:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    )  # fmt: skip
    log.write_bytes(b"".join(lines) + real)
    server = live_server({"node": {"count": 8}}, nvml={"kernel_log": str(log)})
    wait_for(lambda: ignored(server) == expected, timeout=60)
    wait_for(lambda: len(faults(server)) == 7, timeout=30)
    found = {(name, tuple(sorted(labels))): value for (name, labels), value in faults(server).items()}
    uuid = {gpu["index"]: gpu["uuid"] for gpu in server.get("/api/v1/health").json()["gpus"]}
    assert {key: value for key, value in found.items() if not key[0].endswith("_timestamp_seconds")} == {
        ("gpuwarden_xid_errors_total", (("gpu", "1"), ("uuid", uuid[1]), ("xid", "79"))): 1,
        ("gpuwarden_xid_errors_total", (("gpu", "2"), ("uuid", uuid[2]), ("xid", "48"))): 1,
        ("gpuwarden_kernel_fallen_off_bus_total", (("gpu", "1"), ("uuid", uuid[1]))): 1,
        ("gpuwarden_kernel_sxid_errors_total", (("switch", "00000000:89:00.0"), ("sxid", "20034"))): 1,
    }
    severity = verdicts(server)
    assert severity[(1, "xid")] == severity[(2, "xid")] == "critical"
    assert {severity[(gpu, "fabric")] for gpu in range(8)} == {"warning"}  # the SXid, on every GPU of the board
    assert {severity[(gpu, "xid")] for gpu in (0, 3, 4, 5, 6, 7)} == {"ok"}  # the forgeries named GPU 0
    assert len(server.pipeline.poller.kernel.counts()) == 4 < MAX_KEYS
    print(f"10,000 forged lines ignored by reason: {dict(expected)}; real XID 79, XID 48, SXid 20034 counted")
