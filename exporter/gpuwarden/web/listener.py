"""The listen address, bound before anything starts; the probe listener's kernel-side wait for a request."""

from __future__ import annotations

import socket
import sys


def bind_listener(host: str, port: int, flag: str = "--web.listen-address") -> socket.socket | None:
    """Bind the listen address before anything starts, so that a port in use is one line and its own exit code
    (not "listening on …" followed by the server's error and the NVML exit code)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        print(
            f"gpuwarden: cannot listen on {where}: {exc.strerror.lower() if exc.strerror else exc}; "
            f"choose another {flag} or stop what holds it",
            file=sys.stderr,
        )
        return None
    sock.set_inheritable(True)
    return sock


def accept_only_with_data(sock: socket.socket, seconds: float) -> bool:
    """Have the kernel hand this listener a connection only once its first bytes arrive (Linux's
    TCP_DEFER_ACCEPT), or after `seconds` without any. A connection that sends nothing then waits in the kernel
    (a request socket, no file descriptor, nothing of this process's), not in the server, which meanwhile answers
    whoever sends a request at once, as the kubelet's probes do. The kernel counts `seconds` in SYN-ACK
    retransmissions (1, 2, 4, ... s), so the wait is the first such total at or above it. False where the platform
    has no such option (the server then meets idle connections with its own limits only)."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(seconds)))
    except OSError:
        return False
    return True
