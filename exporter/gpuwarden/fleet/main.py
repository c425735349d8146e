"""Entry point of `gpuwarden fleet`: settings, logging, the HTTP server."""

from __future__ import annotations

import logging
import os
import signal
import sys

from gpuwarden.commandline import EXIT_CONFIG, ConfigError

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    from gpuwarden.config.web import WebConfig, load_web_config
    from gpuwarden.fleet.settings import ENV_PREFIX, environment_names, parse

    try:
        settings = parse(argv)
        web = load_web_config(settings.web_config_file) if settings.web_config_file else WebConfig()
    except ConfigError as exc:
        print(f"gpuwarden fleet: {str(exc).removeprefix('gpuwarden fleet: ')}", file=sys.stderr)
        return EXIT_CONFIG
    from gpuwarden import __version__, logs
    from gpuwarden.commandline import EXIT_LISTEN, log_service_links
    from gpuwarden.fleet.app import create_app
    from gpuwarden.web.limits import ConnectionGuard, bound_tls_costs, connection_limit
    from gpuwarden.web.listener import bind_listener
    from gpuwarden.web.server import HttpServer

    logs.setup("info", "logfmt")
    log_service_links(os.environ, ENV_PREFIX, environment_names())
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
    if hasattr(signal, "SIGHUP"):  # its default ends the process: a config-management tool's reload must not
        signal.signal(  # (the fleet service reads its settings at start; a restart applies new ones)
            signal.SIGHUP, lambda *_: log.warning("SIGHUP: gpuwarden fleet reads its settings at start; restart it")
        )
    app = create_app(settings, basic_auth_users=web.basic_auth_users, guard=guard)
    HttpServer(app, guard, ssl_context=web.ssl_context(), graceful_s=5.0).run(listener)
    return 0
