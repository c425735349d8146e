"""Entry point of `gpuwarden fleet`: settings, logging, the HTTP server."""

from __future__ import annotations

import logging
import sys

from exporter.cliutil import EXIT_CONFIG, ConfigError

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    from exporter.fleet.settings import parse
    from exporter.webconfig import WebConfig, load_web_config

    try:
        settings = parse(argv)
        web = load_web_config(settings.web_config_file) if settings.web_config_file else WebConfig()
    except ConfigError as exc:
        print(f"gpuwarden fleet: {str(exc).removeprefix('gpuwarden fleet: ')}", file=sys.stderr)
        return EXIT_CONFIG
    from exporter import __version__, logs
    from exporter.cliutil import EXIT_LISTEN, bind_listener
    from exporter.fleet.app import create_app
    from exporter.serving import ConnectionGuard, bound_tls_costs, connection_limit
    from exporter.webserver import HttpServer

    logs.setup("info", "logfmt")
    log.info(
        "gpuwarden fleet %s listening on %s, asking %s (%s)",
        __version__,
        settings.listen_address,
        settings.prometheus_url,
        settings.selector,
    )
    guard = ConnectionGuard(max_connections=connection_limit())
    bound_tls_costs(guard.header_timeout_s)
    listener = bind_listener(settings.host, settings.port)
    if listener is None:
        return EXIT_LISTEN
    app = create_app(settings, basic_auth_users=web.basic_auth_users, guard=guard)
    HttpServer(app, guard, ssl_context=web.ssl_context(), graceful_s=5.0).run(listener)
    return 0
