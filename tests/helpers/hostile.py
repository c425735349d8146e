"""Clients as on a real network that never read their answers (the exporter's and the fleet's tests,
bench/fleet_hostile.py)."""

from __future__ import annotations

import ctypes
import os
import socket
import ssl
from pathlib import Path

# the fleet service under never-reading clients (tests/test_fleet_hostile.py, bench/fleet_hostile.py)
FLEET_LIMIT_MIB = 384  # deploy/helm/gpuwarden/values.yaml: fleet.resources.limits.memory
FLEET_CLIENTS = 1100
FLEET_ENDPOINTS = (
    "/api/v1/fleet",
    "/api/v1/fleet/health",
    "/api/v1/fleet/cordon-candidates",
    "/api/v1/fleet/utilization",
    "/api/v1/fleet/jobs",
    "/",
)


def never_reading_client(port: int, path: str) -> socket.socket | None:
    """One `Connection: close` GET of `path`, never read (never_reading_request)."""
    return never_reading_request(port, f"GET {path} HTTP/1.1\r\nHost: fleet\r\nConnection: close\r\n\r\n".encode())


def never_reading_request(port: int, request: bytes, tls: ssl.SSLContext | None = None) -> socket.socket | None:
    """`request` sent (over TLS where `tls` is given) from a client with MSS 1,400 (TCP_MAXSEG) and a 4 KiB receive
    buffer, so the kernel cannot hide an unread answer in loopback's large segments and buffers; never read. None
    where the connection was refused."""
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname="localhost")
        sock.sendall(request)
    except OSError:
        sock.close()
        return None
    return sock


def sockets_on(port: int) -> dict[int, int]:
    """The sockets on loopback `port` (/proc/net/tcp): remote port → socket inode (remote port 0: the listening
    socket), inode 0 where no descriptor holds it (still in the accept queue, or closed by the server and flushing
    as an orphan)."""
    sockets = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            sockets[int(fields[2].rsplit(":", 1)[1], 16)] = int(fields[9])
    return sockets


SYS_PIDFD_GETFD = 438  # the same number on x86_64 and arm64 (Linux 5.6+)


def shrink_send_buffer(pid: int, port: int, size: int) -> None:
    """Set SO_SNDBUF on process `pid`'s listening socket on loopback `port`: the connections it accepts inherit
    it, with the kernel's autotuning off. Loopback autotunes a server's send buffer far past an answer of 100-250 KB
    (179-368 KB seen on Linux 6.18), so a never-reading client's whole answer vanishes into the kernel and the server
    closes at once; a larger answer than the kernel's buffer stays in the server's own. The socket is
    reached through pidfd_getfd, as a debugger would (the test's own child, so ptrace rules allow it)."""
    inode = sockets_on(port)[0]  # the listening socket: no remote end
    target = next(int(fd.name) for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd) == f"socket:[{inode}]")
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        copy = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if copy < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd of the server's listening socket")
    finally:
        os.close(pidfd)
    with socket.socket(fileno=copy) as listening:  # closes the copy only: the server's socket stays open
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
