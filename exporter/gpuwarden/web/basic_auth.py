"""HTTP basic auth against the web-config file's bcrypt hashes (exporter-toolkit's `basic_auth_users`), as ASGI
middleware for both apps. Every endpoint is guarded except the probes (/healthz, /readyz), so kubelet probes keep
working without credentials; they reveal only "alive" and "ready"."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from typing import Any

import anyio
import bcrypt

from gpuwarden.web.limits import PROBES, ConnectionGuard

BCRYPT_MAX_BYTES = 72  # bcrypt's input limit: longer passwords raise ValueError in bcrypt 5

# bcrypt costs ~50-100 ms of one core by design. Checks run on their own small pool, never on the event loop or the
# pool that renders scrapes, and a flood of failing checks is refused once this many are running or queued.
CHECK_THREADS = 1
CHECK_BACKLOG = 8
# A refused request is answered after this delay (it costs the server nothing while it waits): a client retrying
# wrong passwords in a tight loop then sends one request a second per connection, not thousands.
REFUSAL_DELAY_S = 1.0


def _cost(hashed: bytes) -> int:
    """The work factor of a bcrypt hash ($2y$10$… → 10)."""
    try:
        return int(hashed.split(b"$")[2])
    except (IndexError, ValueError):
        return 12


class BasicAuth:
    """ASGI middleware: HTTP basic auth against bcrypt hashes, probes exempt; verified credentials are cached.

    An unknown user costs the same as a wrong password (a dummy hash of the users' cost), so timing does not tell
    which users exist. Password checks have their own pool of CHECK_THREADS; past CHECK_BACKLOG waiting checks a
    request is answered 503 at once: a wrong-password flood cannot starve cached (authorised) scrapes.
    """

    def __init__(self, app: Any, users: dict[str, str], guard: ConnectionGuard | None = None) -> None:
        self.app = app
        self.users = {user: hashed.encode() for user, hashed in users.items()}
        cost = max((_cost(hashed) for hashed in self.users.values()), default=10)
        self._dummy = bcrypt.hashpw(b"not a password", bcrypt.gensalt(rounds=max(4, min(cost, 31))))
        self._verified: set[bytes] = set()
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(CHECK_THREADS)
        self._checks = 0  # running or waiting (read and written on the event loop only)
        self._guard = guard or ConnectionGuard()

    def _check(self, header: bytes) -> bool:
        if not header.startswith(b"Basic "):
            return False
        digest = hashlib.sha256(header).digest()  # cache key: never the credentials themselves
        if digest in self._verified:
            return True
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        secret = password.encode()
        hashed = self.users.get(user)
        if hashed is None or len(secret) > BCRYPT_MAX_BYTES:
            # An unknown user, or a password bcrypt cannot hash (bcrypt 5 raises for over 72 bytes; no hash can
            # match it): a wrong password, at the same cost as a known user's.
            bcrypt.checkpw(secret[:BCRYPT_MAX_BYTES], self._dummy)
            return False
        if not bcrypt.checkpw(secret, hashed):
            return False
        with self._lock:
            if len(self._verified) > 1024:
                self._verified.clear()
            self._verified.add(digest)
        return True

    async def _allowed(self, header: bytes) -> bool | None:
        """True or False, or None when the check was refused because too many are already waiting."""
        if hashlib.sha256(header).digest() in self._verified:
            return True
        if not header.startswith(b"Basic "):
            return False
        if self._checks >= CHECK_THREADS + CHECK_BACKLOG:
            return None
        self._checks += 1
        try:
            return await anyio.to_thread.run_sync(self._check, header, limiter=self._limiter)
        finally:
            self._checks -= 1

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        allowed = await self._allowed(header)
        if allowed:
            await self.app(scope, receive, send)
            return
        await self._guard.refuse_later(REFUSAL_DELAY_S)
        if allowed is None:
            self._guard.reject("auth_shed")
            await _answer(send, 503, {"error": "too many password checks in progress; retry"}, [(b"retry-after", b"1")])
            return
        self._guard.reject("auth_failed")
        await _answer(send, 401, {"error": "unauthorized"}, [(b"www-authenticate", b'Basic realm="gpuwarden"')])


async def _answer(send: Any, status: int, body: dict[str, str], headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": data})
