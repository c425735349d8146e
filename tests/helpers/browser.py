"""Headless Chromium for pages, with every request it makes recorded by a loopback proxy: a page that reaches for a
CDN (or anything but the server under test) is seen, not just rendered blank."""

from __future__ import annotations

import shutil
import subprocess
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-client-side-phishing-detection",
    "--disable-domain-reliability",
    "--no-pings",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication,CertificateTransparencyComponentUpdater",
]
# The browser's own services (sign-in, component updates), which it contacts whatever the page: not the page's.
BROWSER_HOSTS = {
    "accounts.google.com:443",
    "clients2.google.com",
    "clients2.google.com:443",
    "update.googleapis.com:443",
}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium missing: the README's test command installs Debian's chromium package")
    return found


class RecordingProxy:
    """An HTTP proxy on loopback: forwards plain-HTTP requests to loopback hosts, refuses everything else, and
    records the host of every request (CONNECT included, which is how a browser asks for an HTTPS CDN)."""

    def __init__(self) -> None:
        self.hosts: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_CONNECT(self) -> None:  # noqa: N802 - http.server's naming
                proxy.hosts.append(self.path)
                self.send_error(502, "no outside connections in this test")

            def do_GET(self) -> None:  # noqa: N802
                target = urlsplit(self.path)
                proxy.hosts.append(target.netloc)
                if target.hostname not in ("127.0.0.1", "localhost"):
                    self.send_error(502, "no outside connections in this test")
                    return
                try:
                    with urllib.request.urlopen(self.path, timeout=30) as answer:
                        body, status, kind = answer.read(), answer.status, answer.headers.get("content-type", "")
                except urllib.error.HTTPError as exc:
                    body, status, kind = exc.read(), exc.code, exc.headers.get("content-type", "")
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def dump_dom(url: str, profile: Path) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, and every host it asked for (through the recording proxy)."""
    proxy = RecordingProxy()
    try:
        result = subprocess.run(
            [
                chromium(),
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--proxy-server=http://127.0.0.1:{proxy.port}",
                "--proxy-bypass-list=<-loopback>",  # loopback through the proxy too: nothing goes unseen
                "--virtual-time-budget=5000",  # let scripts and late loads run before the dump
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout, [host for host in proxy.hosts if host not in BROWSER_HOSTS]
    finally:
        proxy.close()
