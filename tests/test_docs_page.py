"""/docs in a headless browser makes no request outside the exporter (air-gapped clusters), and still documents
every endpoint; the proxy that records the requests is shown to catch a page that reaches for a CDN."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gpuwarden.web.apidocs import render_docs
from tests.helpers.browser import dump_dom


def test_docs_make_no_request_outside_the_exporter(live_server, tmp_path: Path) -> None:
    server = live_server("healthy")
    dom, hosts = dump_dom(server.url + "/docs", tmp_path / "profile")
    for path in ("/api/v1/gpus", "/api/v1/processes", "/api/v1/diagnosis", "/metrics", "/openapi.json"):
        assert path in dom, path
    assert hosts and set(hosts) == {f"127.0.0.1:{server.port}"}, hosts


def test_the_recording_proxy_catches_a_page_that_loads_from_a_cdn(tmp_path: Path) -> None:
    page = b"<!doctype html><html><head><script src='https://cdn.jsdelivr.net/npm/x.js'></script></head></html>"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        _, hosts = dump_dom(f"http://127.0.0.1:{httpd.server_address[1]}/", tmp_path / "profile")
    finally:
        httpd.shutdown()
    assert "cdn.jsdelivr.net:443" in hosts, hosts


def test_the_fleet_service_docs_are_offline_too() -> None:
    from gpuwarden.fleet.app import create_app
    from gpuwarden.fleet.settings import FleetSettings

    app = create_app(FleetSettings(prometheus_url="http://127.0.0.1:9"))
    assert app.docs_url is None and app.redoc_url is None
    text = render_docs(app.openapi())
    assert "/api/v1/fleet/health" in text and "http://" not in text and "https://" not in text and "<script" not in text
