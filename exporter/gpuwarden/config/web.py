"""TLS and basic auth from a Prometheus exporter-toolkit web-config file (`--web.config.file`).

The same YAML operators already use for node_exporter and friends:

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, VerifyClientCertIfGiven
      client_ca_file: ca.crt
    basic_auth_users:
      prometheus: $2y$10$...                          # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':')

A bad file stops the daemon with one line (exit code 2). The basic-auth middleware that uses the users is
gpuwarden.web.basic_auth (this module reads and checks the file; it serves nothing).
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpuwarden.config.settings import ConfigError, read_yaml
from gpuwarden.config.typed import SettingError, build

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
