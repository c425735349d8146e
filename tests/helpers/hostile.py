"""Clients as on a real network that never read their answers (the fleet's tests and bench/fleet_hostile.py)."""

from __future__ import annotations

import socket


def never_reading_client(port: int, path: str) -> socket.socket | None:
    """One `Connection: close` request from a client with MSS 1,400 (TCP_MAXSEG) and a 4 KiB receive buffer, so
    the kernel cannot hide an unread answer in loopback's large segments and buffers; never read. None where the
    connection was refused."""
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: fleet\r\nConnection: close\r\n\r\n".encode())
    except OSError:
        sock.close()
        return None
    return sock
