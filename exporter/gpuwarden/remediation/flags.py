"""The flags both remediation commands share: how to reach the node's exporter."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpuwarden.remediation.verdicts import FAMILIES, LEVELS, Endpoint, endpoint_from


def add_endpoint_flags(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    parser.add_argument(
        "--exporter-url",
        default=None,
        help="the node's exporter (default http://127.0.0.1:10045, https:// when the web-config serves TLS)",
    )
    parser.add_argument(
        "--web.config.file",
        dest="web_config",
        type=Path,
        default=None,
        help="the exporter's web-config: TLS (its certificate is trusted) and whether basic auth is on",
    )
    parser.add_argument("--tls.ca-file", dest="ca_file", type=Path, default=None, help="CA to trust instead")
    parser.add_argument("--tls.cert-file", dest="cert_file", type=Path, default=None, help="client certificate")
    parser.add_argument("--tls.key-file", dest="key_file", type=Path, default=None, help="client certificate's key")
    parser.add_argument("--auth.username", dest="username", default="", help="basic-auth user")
    parser.add_argument(
        "--auth.password-file",
        dest="password_file",
        type=Path,
        default=None,
        help="file holding the basic-auth password (never a flag: flags show in ps)",
    )
    parser.add_argument(
        "--timeout", type=float, default=timeout_s, help=f"seconds to wait for the exporter (default {timeout_s:g})"
    )
    parser.add_argument(
        "--level",
        choices=sorted(LEVELS),
        default="critical",
        help="the verdict level that counts as a fault (default critical)",
    )


def endpoint(args: argparse.Namespace) -> Endpoint:
    """The endpoint the parsed flags describe (ValueError with one line on a bad combination)."""
    if not 0 < args.timeout <= 50:
        raise ValueError(f"--timeout {args.timeout:g}: give seconds between 0 and 50")
    return endpoint_from(
        args.exporter_url,
        args.web_config,
        args.ca_file,
        args.cert_file,
        args.key_file,
        args.username,
        args.password_file,
        args.timeout,
    )


def family_names() -> list[str]:
    return sorted(FAMILIES)
