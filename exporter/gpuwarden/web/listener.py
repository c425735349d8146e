"""The listen address, bound before anything starts."""

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
