"""Entry point: parse flags, load settings, wire NVML (real or simulated) → poller → renderer → HTTP, run."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from gpuwarden import __version__
from gpuwarden.commandline import (
    EXIT_CONFIG,
    EXIT_FATAL,
    EXIT_LISTEN,
    EXPORTER_ENV_PREFIX,
    OneLineParser,
    log_service_links,
)
from gpuwarden.config.settings import ConfigError, Settings, load_settings, options
from gpuwarden.config.typed import as_dict, choices
from gpuwarden.web.listener import bind_listener

log = logging.getLogger("gpuwarden")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        hint="; see gpuwarden --help",
        prog="gpuwarden",
        description="NVIDIA GPU exporter for Prometheus. Subcommands: `gpuwarden check-config FILE` validates a "
        "config file; `gpuwarden scenarios` lists the simulator's scenarios; `gpuwarden validate` "
        "compares its readings with nvidia-smi on a GPU host; `gpuwarden fleet --prometheus-url URL` "
        "serves the fleet view from Prometheus; `gpuwarden npd-plugin` and `gpuwarden slurm-healthcheck` tell "
        "node-problem-detector and Slurm what the exporter found.",
        epilog="Precedence: defaults < --config file < GPUWARDEN_* environment < flags.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML configuration file.")
    parser.add_argument("--sim", action="store_true", help="Shorthand for --nvml.backend=sim.")
    add_setting_flags(parser)
    return parser


def _help_text(opt: Any) -> str:
    """Description, the allowed values of a choice, the default (or that there is none), the environment name."""
    default = opt.default
    shown = ",".join(default) if isinstance(default, tuple) else default
    allowed_values = choices(opt.annotation)
    allowed = f" One of: {', '.join(map(str, allowed_values))}." if allowed_values else ""
    default_text = "none" if shown in (None, "", ()) else str(shown)
    return f"{opt.description}{allowed} Default: {default_text}. Env: {opt.env}."


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, named and documented from the settings model."""
    for opt in options():
        help_text = _help_text(opt)
        if opt.annotation is bool:
            parser.add_argument(
                opt.flag, dest=opt.key, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif opt.is_list:
            parser.add_argument(
                opt.flag,
                dest=opt.key,
                default=None,
                metavar="GLOBS",
                type=lambda raw: [item.strip() for item in raw.split(",") if item.strip()],
                help=help_text,
            )
        else:
            parser.add_argument(opt.flag, dest=opt.key, default=None, metavar=opt.name.upper(), help=help_text)


def check_config(args: list[str]) -> int:
    if len(args) != 1:
        print("gpuwarden: usage: gpuwarden check-config FILE", file=sys.stderr)
        return EXIT_CONFIG
    try:
        settings = load_settings(Path(args[0]), environ={})
        if settings.nvml.backend == "sim":
            from gpuwarden.sim.scenario import load_scenario

            load_scenario(settings.nvml.scenario or "training")
    except ConfigError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{args[0]}: ok")
    return 0


def list_scenarios() -> int:
    from gpuwarden.sim.scenario import load_scenario, shipped_scenarios

    names = sorted(shipped_scenarios())
    lines = [f"{name:24} {load_scenario(name).description.strip().split('. ')[0]}" for name in names]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `gpuwarden scenarios | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
    return 0


def settings_from_argv(argv: list[str]) -> Settings:
    args = build_parser().parse_args(argv)
    flags: dict[str, Any] = {key: value for key, value in vars(args).items() if "." in key and value is not None}
    if args.sim:
        flags.setdefault("nvml.backend", "sim")
    return load_settings(args.config, os.environ, flags)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check-config"]:
        return check_config(argv[1:])
    if argv[:1] == ["scenarios"]:
        return list_scenarios()
    if argv[:1] == ["validate"]:
        from gpuwarden.cli.validate import main as validate

        return validate(argv[1:])
    if argv[:1] == ["fleet"]:
        from gpuwarden.fleet.main import main as fleet

        return fleet(argv[1:])
    if argv[:1] == ["npd-plugin"]:
        from gpuwarden.remediation.npd import main as npd_plugin

        return npd_plugin(argv[1:])
    if argv[:1] == ["slurm-healthcheck"]:
        from gpuwarden.remediation.slurm import main as slurm_healthcheck

        return slurm_healthcheck(argv[1:])
    # Start-up allocates ~100,000 objects that nearly all live for good: the cyclic GC's collections during it
    # (about a tenth of the import time) find nothing to free. settle_memory() turns it back on after the first
    # snapshot, with one full collection; whatever ends start-up early turns it back on here.
    gc.disable()
    try:
        return _load_and_serve(argv)
    finally:
        gc.enable()


def _load_and_serve(argv: list[str]) -> int:
    try:
        settings = settings_from_argv(argv)
        from gpuwarden.health.thresholds import load_thresholds

        load_thresholds(settings.health.thresholds_file)  # one line and exit 2 now, not a traceback in the poller
        if settings.web.config_file is not None:
            from gpuwarden.config.web import load_web_config

            load_web_config(settings.web.config_file)
        if settings.nvml.backend == "sim":
            from gpuwarden.sim import install_simulator

            install_simulator(settings.nvml.scenario)
    except ConfigError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return serve(settings, argv)


RESTART_ONLY = ("web", "nvml.backend", "nvml.scenario", "log.format")


def reload_settings(argv: list[str], current: Settings, poller: Any, renderer: Any) -> Settings:
    """SIGHUP: re-read file, environment and the original flags; apply what can change live, atomically.

    An invalid configuration is rejected with one log line and the running one stays in force.
    """
    from gpuwarden import logs
    from gpuwarden.health.thresholds import load_thresholds

    try:
        new = settings_from_argv(argv)
        load_thresholds(new.health.thresholds_file)  # validate before anything changes
    except (ConfigError, SystemExit) as exc:
        log.error("reload rejected, keeping the running configuration: %s", exc)
        return current
    old, fresh = as_dict(current), as_dict(new)
    for key in RESTART_ONLY:
        section, _, name = key.partition(".")
        before = old[section].get(name) if name else old[section]
        after = fresh[section].get(name) if name else fresh[section]
        if before != after:
            log.warning("reload: %s changed; it takes effect only after a restart", key)
    poller.reconfigure(new)
    renderer.refilter(new.metrics.selection())
    logs.set_level(new.log.level)
    log.info("configuration reloaded")
    return new


class _NoWebConfig:
    """No web-config file: no TLS, no users (and no bcrypt or web-config models imported)."""

    basic_auth_users: dict[str, str] = {}

    @staticmethod
    def ssl_context() -> None:
        return None


def _web_config(settings: Settings) -> Any:
    if settings.web.config_file is None:
        return _NoWebConfig()
    from gpuwarden.config.web import load_web_config

    return load_web_config(settings.web.config_file)


def settle_memory() -> None:
    """Once start-up is over: the cyclic GC on again (main() turned it off)
    and what start-up allocated kept out of its full collections (they would walk every imported module's objects
    and show as scrape-latency spikes); the heap it freed handed back to the system (glibc keeps freed memory
    mapped until asked; ~1 MiB here, more where modules were compiled from source)."""
    gc.enable()
    gc.collect()
    gc.freeze()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
        pass


def serve(settings: Settings, argv: list[str] | None = None) -> int:
    from gpuwarden import logs

    logs.setup(settings.log.level, settings.log.format)
    log_service_links(os.environ, EXPORTER_ENV_PREFIX, {opt.env for opt in options()})
    web = _web_config(settings)
    listener = bind_listener(settings.web.host, settings.web.port)
    if listener is None:
        return EXIT_LISTEN
    probe_listener = None
    if settings.web.probe_listen_address:
        probe_listener = bind_listener(
            settings.web.probe_host, settings.web.probe_port, flag="--web.probe-listen-address"
        )
        if probe_listener is None:
            listener.close()
            return EXIT_LISTEN
    from gpuwarden.nvml.session import start_init
    from gpuwarden.workers import WorkerPool

    pool = WorkerPool()
    started_init = start_init(pool)  # NVML starts while the poller and the HTTP stack are imported
    from gpuwarden.collect.poller import Poller

    poller = Poller(settings, pool=pool, started_init=started_init)
    # NVML's init and the first poll run while the HTTP stack is imported: first metrics sooner after start
    poller.start()
    try:
        return _serve_http(settings, argv, web, listener, poller, probe_listener)
    finally:
        poller.stop()


def _serve_http(
    settings: Settings,
    argv: list[str] | None,
    web: Any,
    listener: socket.socket,
    poller: Any,
    probe_listener: socket.socket | None = None,
) -> int:
    from gpuwarden.exposition.render import Renderer
    from gpuwarden.model.families import CONFIG_RELOADS_TOTAL, GPUS_EXPECTED, HTTP_REJECTED_TOTAL
    from gpuwarden.web.front import FIRST_SNAPSHOT_WAIT_MAX_S, create_front
    from gpuwarden.web.limits import ConnectionGuard, bound_tls_costs, connection_limit
    from gpuwarden.web.readiness import readiness_under
    from gpuwarden.web.server import HttpServer

    guard = ConnectionGuard(
        header_timeout_s=settings.web.header_timeout, max_connections=connection_limit(settings.web.max_connections)
    )
    bound_tls_costs(settings.web.header_timeout)
    reloads: Counter[str] = Counter()

    def own_counters() -> dict[str, list[tuple[list[str], float]]]:
        """The process's own series, read at each render: HTTP refusals, reloads, and the node's expected GPU count
        (a setting, so it follows a reload)."""
        expected = poller.settings.nvml.expected_gpus
        return {
            HTTP_REJECTED_TOTAL.name: [([reason], count) for reason, count in guard.counts().items()],
            CONFIG_RELOADS_TOTAL.name: [([result], reloads[result]) for result in ("applied", "rejected")],
            GPUS_EXPECTED.name: [([], expected)] if expected else [],
        }

    renderer = Renderer(settings.metrics.selection(), own_counters)
    ready = readiness_under(lambda: poller.settings)  # the fast interval in force now: a reload may change it
    app = create_front(
        lambda: poller.snapshot,
        ready,
        renderer,
        settings.web.telemetry_path,
        web.basic_auth_users,
        guard=guard,
        # the first fast cycle publishes within the call deadline whatever NVML does (a hung init included)
        first_snapshot_wait_s=min(settings.poll.call_deadline, FIRST_SNAPSHOT_WAIT_MAX_S),
        expected_gpus=lambda: poller.settings.nvml.expected_gpus,
    )
    # header deadline and size limit, admission, shedding (exporter/gpuwarden/web/limits.py); in-flight requests get 5 s
    # at exit
    server = HttpServer(app, guard, ssl_context=web.ssl_context(), graceful_s=5.0)
    exit_code = 0
    stopped = threading.Event()
    reload_requested = threading.Event()

    def supervise() -> None:
        """One thread for what happens beside serving: memory settled after the first snapshot, SIGHUP reloads
        applied in order, and the exit (after the grace) once NVML is unusable for good."""
        nonlocal settings, exit_code
        settle_by: float | None = time.monotonic() + settings.poll.call_deadline * 2
        exit_at: float | None = None
        while not stopped.wait(0.2):
            if settle_by is not None and (poller.ready_once.is_set() or time.monotonic() >= settle_by):
                settle_memory()  # once, when start-up is over (a first snapshot, or no GPU to wait for)
                settle_by = None
            if reload_requested.is_set():
                reload_requested.clear()
                try:
                    new = reload_settings(argv or [], settings, poller, renderer)
                except Exception:  # a bug in one reload must not end reloading for the life of the process
                    log.exception("reload failed, keeping the running configuration")
                    new = settings
                reloads["applied" if new is not settings else "rejected"] += 1
                settings = new
            if poller.fatal and exit_at is None:
                grace = 0 if poller.fatal == "library_not_found" else settings.nvml.version_mismatch_grace
                exit_at = time.monotonic() + grace
            if exit_at is not None and time.monotonic() >= exit_at:
                exit_code = EXIT_FATAL
                server.stop()
                return

    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: reload_requested.set())
    threading.Thread(target=supervise, name="gpuwarden-supervisor", daemon=True).start()
    log.info(
        "gpuwarden %s listening on %s (backend %s)", __version__, settings.web.listen_address, settings.nvml.backend
    )
    probes = None
    if probe_listener is not None:
        from gpuwarden.web.probes import ProbeApp, ProbeListener

        probes = ProbeListener(ProbeApp(lambda: poller.snapshot, ready, server.last_turn), settings.web.header_timeout)
        probes.start(probe_listener)
        log.info("probes (/healthz, /readyz) also on %s", settings.web.probe_listen_address)
    try:
        server.run(listener)
    finally:
        stopped.set()
        if probes is not None:
            probes.stop()
    if exit_code:
        log.error("exiting with code %d: %s", exit_code, poller.fatal)
    return exit_code
