"""Clients as on a real network that never read their answers (the exporter's and the fleet's tests,
bench/fleet_hostile.py)."""

from __future__ import annotations

import socket
import ssl

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
