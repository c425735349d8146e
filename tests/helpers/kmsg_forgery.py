"""Forged kernel-log lines (issue 48): what an unprivileged process can make the real kernel write (a crash inside a
file it named, or under a name it chose), and kmsg-format files of forgeries for the exporter to read. Used by
tests/test_kernel_log_forgery.py and bench/kernel_log_forgery_rss.py."""

from __future__ import annotations

import os
import platform
import pwd
import subprocess
import sys
from collections import Counter
from pathlib import Path

NOBODY = "nobody"

# The child drops to nobody before it makes the file or crashes: everything it imports is loaded first (the
# interpreter may sit where nobody cannot read). Then, as nobody with no capability left: write x86-64 code into a
# file of the given name, map it executable and jump into it, so that the kernel's report names that file; or name
# the process (prctl PR_SET_NAME, 15 bytes) and crash in libc.
_CHILD = r"""
import ctypes, os, sys
kind, folder, name, uid, gid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
jump = ctypes.CFUNCTYPE(None)
os.setgroups([]); os.setgid(gid); os.setuid(uid)
status = open("/proc/self/status").read()
if os.getuid() != uid or os.geteuid() != uid or "CapEff:\t0000000000000000" not in status:
    sys.exit(3)
if kind == "comm":
    libc.prctl(15, name.encode()[:15], 0, 0, 0)
    ctypes.string_at(0)
code = {"segfault": "488b042500000000", "general_protection": "48b80000000000000080488b00"}[kind]
path = os.path.join(folder, name)
with open(path, "wb") as out:
    out.write(bytes.fromhex(code).ljust(4096, b"\xcc"))
fd = os.open(path, os.O_RDONLY)
address = libc.mmap(None, 4096, 5, 2, fd, 0)  # PROT_READ | PROT_EXEC, MAP_PRIVATE
jump(address)()
"""


def why_no_real_forgery() -> str | None:
    """Why crashes of an unprivileged process cannot be made and read here, or None."""
    if platform.machine() != "x86_64":
        return f"the crashing code is x86-64 ({platform.machine()} here)"
    if os.geteuid() != 0:
        return "needs root: to read /dev/kmsg as the chart's relay does, and to start a process that drops to nobody"
    if not os.access("/dev/kmsg", os.R_OK):
        return "no readable /dev/kmsg"
    try:
        pwd.getpwnam(NOBODY)
    except KeyError:
        return "no user nobody"
    try:
        if Path("/proc/sys/debug/exception-trace").read_text().strip() != "1":
            return "debug.exception-trace is 0: the kernel reports no crash"
    except OSError:
        return "no debug.exception-trace: the kernel reports no crash"
    return None


def crash_as_nobody(kind: str, folder: Path, name: str) -> int:
    """Start a process that drops to user nobody and crashes (`segfault` or `general_protection` inside a file
    called `name` in `folder`, or `comm`: named `name`); its PID, once it died of SIGSEGV."""
    user = pwd.getpwnam(NOBODY)
    child = subprocess.Popen(
        [sys.executable, "-I", "-c", _CHILD, kind, str(folder), name, str(user.pw_uid), str(user.pw_gid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_no_core,
    )
    _, err = child.communicate(timeout=30)
    if child.returncode != -11:
        raise AssertionError(f"the {kind} child ended with {child.returncode}: {err.decode()[-400:]}")
    return child.pid


def _no_core() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def kernel_records() -> list[bytes]:
    """Every record /dev/kmsg holds now (root), without their continuation lines."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    records = []
    try:
        while True:
            try:
                records.append(os.read(fd, 16384).split(b"\n", 1)[0])
            except BlockingIOError:
                return records
            except BrokenPipeError:  # the ring moved on under the reader: go on from the oldest left
                continue
    finally:
        os.close(fd)


def write_user_record(text: str) -> None:
    """What a root process writing /dev/kmsg gets: the record's facility is user whatever prefix it asks for."""
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, f"<3>{text}\n".encode())  # asks for facility 0 (kern), level 3 (err)
    finally:
        os.close(fd)


def kmsg_line(seq: int, seconds: float, message: str, prio: int = 3, flags: str = "-") -> bytes:
    return f"{prio},{seq},{int(seconds * 1e6)},{flags};{message}\n".encode()


# (the reason the exporter ignores it, the record's PRIO or None for a line that is no record, the text)
SHAPES = (
    ("user_facility", 8 + 3, "NVRM: Xid (PCI:{gpu}): 79, pid={n}, name=x, GPU has fallen off the bus."),
    ("user_facility", 8 + 3, "nvidia-nvswitch0: SXid (PCI:{switch}): 20034, Fatal, Link {link}"),
    ("not_driver", 6, "python[{n}]: segfault at 0 ip 0 sp 0 error 4 in NVRM: Xid (PCI:{gpu}): 79, x[0+1000]"),
    ("not_driver", 6, "NVRM: Xid (PCI:[{n}]: segfault at 0 ip 0 sp 0 error 4 in libc.so.6[0+1000]"),
    ("not_driver", 6, "traps: python[{n}] general protection fault ip:a sp:b error:0 in libcuda.so.1[a+1000]"),
    ("not_driver", 6, "python[{n}]: segfault at 0 ip 0 sp 0 error 4 in x\\x0anvidia-nvswitch0: SXid (PCI:{switch}): 1"),
    ("unknown_device", 3, "NVRM: Xid (PCI:{hi:04x}:{lo:02x}:01): 48, pid=1, name=x, DBE"),
    ("unknown_device", 3, "nvidia-nvswitch9: SXid (PCI:{hi:04x}:{lo:02x}:02.0): 20034, Fatal, x"),
    ("unparsed", 3, "NVRM: Xid (PCI:{gpu}): {code}, a four-digit XID"),
    ("unparsed", None, "[    1.000000] NVRM: Xid (PCI:{gpu}): 79, pid={n}, name=x, dmesg text"),
)


def forged_lines(count: int, gpu: str, switch: str, first_seq: int = 1) -> tuple[list[bytes], Counter[str]]:
    """`count` forged lines of SHAPES, in turn, each naming this host's `gpu` (`0000:18:00`) or `switch`
    (`0000:86:00.0`) where it can, else an address of its own (one per line); with how many the exporter must ignore
    per reason. Timestamps 1 s after boot: they are old, the real lines that follow are not."""
    lines, expected = [], Counter[str]()
    for n in range(count):
        reason, prio, text = SHAPES[n % len(SHAPES)]
        message = text.format(n=n, gpu=gpu, switch=switch, link=n % 64, hi=n // 256, lo=n % 256, code=1000 + n % 9000)
        lines.append(kmsg_line(first_seq + n, 1.0, message, prio) if prio is not None else f"{message}\n".encode())
        expected[reason] += 1
    return lines, expected
