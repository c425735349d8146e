"""TLS and basic auth from a Prometheus exporter-toolkit web-config file (`--web.config.file`).

The same YAML operators already use for node_exporter and friends:

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, VerifyClientCertIfGiven
      client_ca_file: ca.crt
    basic_auth_users:
      prometheus: $2y$10$...                          # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':')

Basic auth guards every endpoint except the probes (/healthz, /readyz), so kubelet probes keep working without
credentials; they reveal only "alive" and "ready". A bad file stops the daemon with one line (exit code 2).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import bcrypt

from gpuwarden.config.settings import ConfigError, read_yaml
from gpuwarden.config.typed import SettingError, build
from gpuwarden.web.limits import PROBES, ConnectionGuard

_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


@dataclass(frozen=True)
class TlsServerConfig:
    """The `tls_server_config` section: certificate, key and client verification."""

    cert_file: Path
    key_file: Path
    client_auth_type: Literal["NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"] = "NoClientCert"
    client_ca_file: Path | None = None

    def validate(self) -> None:
        """The files exist; client verification has its CA (typedconfig.build runs it)."""
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {path} does not exist or is not a file")
        if self.client_auth_type != "NoClientCert" and self.client_ca_file is None:
            raise ValueError(f"client_auth_type {self.client_auth_type} needs client_ca_file")


_BCRYPT = re.compile(r"\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{53}")
BCRYPT_MIN_COST, BCRYPT_MAX_COST = 4, 16


@dataclass(frozen=True)
class WebConfig:
    """A web-config file: TLS and the basic-auth users (bcrypt hashes)."""

    tls_server_config: TlsServerConfig | None = None
    basic_auth_users: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        for user, hashed in self.basic_auth_users.items():
            if not hashed.startswith(("$2a$", "$2b$", "$2y$")):
                raise ValueError(f"basic_auth_users.{user} must be a bcrypt hash ($2y$...), not a plain password")
            found = _BCRYPT.fullmatch(hashed)
            if found is None:
                raise ValueError(
                    f"basic_auth_users.{user} is not a well-formed bcrypt hash ($2y$NN$ and 53 characters of bcrypt's "
                    'base64); make one with: htpasswd -nBC 10 "" | tr -d ":"'
                )
            cost = int(found.group(1))
            if not BCRYPT_MIN_COST <= cost <= BCRYPT_MAX_COST:
                raise ValueError(
                    f"basic_auth_users.{user} has bcrypt cost {cost}: give {BCRYPT_MIN_COST} to {BCRYPT_MAX_COST} "
                    f"(each step doubles the CPU of every login; cost {BCRYPT_MAX_COST} is ~4 s of a core); "
                    'hash it again with: htpasswd -nBC 10 "" | tr -d ":"'
                )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context for this setup (None without TLS): TLS 1.2 or newer, client certificates as
        client_auth_type says."""
        tls = self.tls_server_config
        if tls is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
        context.verify_mode = _CLIENT_AUTH[tls.client_auth_type]
        if tls.client_ca_file is not None:
            context.load_verify_locations(str(tls.client_ca_file))
        return context


def load_web_config(path: Path) -> WebConfig:
    try:
        config = build(WebConfig, read_yaml(path, "web config", "--web.config.file"))
    except SettingError as exc:
        raise ConfigError(exc.line(f"web config {path}")) from None
    tls = config.tls_server_config
    if tls is not None:  # load once now, so a bad certificate or key is a start-up error, not a runtime one
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tls.cert_file, tls.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"web config {path}: tls_server_config: cannot load cert_file/key_file ({exc}); "
                "check that they are a matching PEM certificate and key"
            ) from None
        if tls.client_ca_file is not None:
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(str(tls.client_ca_file))
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise ConfigError(
                    f"web config {path}: tls_server_config: cannot load client_ca_file ({exc}); "
                    "give the PEM certificate(s) of the CA that issues the clients' certificates"
                ) from None
    return config


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
