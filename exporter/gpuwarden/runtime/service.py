"""The exporter process around the pipeline: listeners, renderer, HTTP server, probes and one supervisor.

The exporter process around the pipeline: listeners bound first, the pipeline started, the renderer, the HTTP
server and its probe listener, and one supervisor thread (memory settled after start-up and after bursts of
connections, SIGHUP reloads in order, the exit once NVML is unusable for good). Built here, not in cli/: the command
line only parses and hands over."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuwarden import __version__, logs
from gpuwarden.commandline import EXIT_FATAL, EXIT_LISTEN, EXPORTER_ENV_PREFIX, log_service_links
from gpuwarden.config.settings import ConfigError, Settings, options
from gpuwarden.config.typed import as_dict
from gpuwarden.runtime.memory import MemorySettler
from gpuwarden.web.listener import bind_listener

if TYPE_CHECKING:  # imported where they are built: the HTTP stack loads while NVML initialises
    from gpuwarden.exposition.render import Renderer
    from gpuwarden.runtime.pipeline import Pipeline

log = logging.getLogger("gpuwarden")

Reread = Callable[[], Settings]

RESTART_ONLY = ("web", "nvml.backend", "nvml.scenario", "log.format", "health.state_file", "health.state_max_gap")


def reload_settings(reread: Reread, current: Settings, pipeline: Pipeline, renderer: Renderer) -> Settings:
    """SIGHUP: re-read file, environment and the original flags; apply what can change live, atomically.

    An invalid configuration is rejected with one log line and the running one stays in force.
    """
    try:
        new = reread()
        pipeline.reload(new)  # reads the thresholds file before it changes anything
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


MALLOC_ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(environ: Mapping[str, str]) -> bool:
    """At most MALLOC_ARENAS glibc malloc arenas for the whole process, unless MALLOC_ARENA_MAX already says how many
    (glibc reads it itself). glibc gives threads that allocate arenas of their own, up to 8 per core, and each keeps
    what its threads freed: the JSON API's request threads left the pod 3.2 MiB larger on an H200 (docs/validation/
    2026-11-28-h200-pod-memory). Called before any thread starts; True when the limit was set."""
    if "MALLOC_ARENA_MAX" in environ:
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator, its own rules
        return False


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


def serve(settings: Settings, reread: Reread) -> int:
    """Run the exporter until it is stopped or NVML is unusable for good; `reread` loads the settings again (the
    file, the environment and the original flags) for a SIGHUP."""
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
    started_init = start_init(pool)  # NVML starts while the pipeline and the HTTP stack are imported
    from gpuwarden.runtime.pipeline import Pipeline

    pipeline = Pipeline(settings, pool=pool, started_init=started_init)
    # NVML's init and the first poll run while the HTTP stack is imported: first metrics sooner after start
    pipeline.start()
    try:
        return _serve_http(settings, reread, web, listener, pipeline, probe_listener)
    finally:
        pipeline.stop()


def _serve_http(
    settings: Settings,
    reread: Reread,
    web: Any,
    listener: socket.socket,
    pipeline: Pipeline,
    probe_listener: socket.socket | None = None,
) -> int:
    from gpuwarden.exposition.render import Renderer
    from gpuwarden.model.families import CONFIG_RELOADS_TOTAL, GPUS_EXPECTED, HTTP_REJECTED_TOTAL
    from gpuwarden.web.front import FIRST_SNAPSHOT_WAIT_MAX_S, create_front
    from gpuwarden.web.limits import PROBES, ConnectionGuard, bound_tls_costs, connection_limit
    from gpuwarden.web.readiness import readiness_under
    from gpuwarden.web.server import HttpServer

    guard = ConnectionGuard(
        header_timeout_s=settings.web.header_timeout,
        max_connections=connection_limit(settings.web.max_connections),
        unshed_paths=PROBES | {settings.web.telemetry_path},
    )
    bound_tls_costs(settings.web.header_timeout)
    reloads: Counter[str] = Counter()

    def own_counters() -> dict[str, list[tuple[list[str], float]]]:
        """The process's own series, read at each render: HTTP refusals, reloads, and the node's expected GPU count
        (a setting, so it follows a reload)."""
        expected = pipeline.settings.nvml.expected_gpus
        return {
            HTTP_REJECTED_TOTAL.name: [([reason], count) for reason, count in guard.counts().items()],
            CONFIG_RELOADS_TOTAL.name: [([result], reloads[result]) for result in ("applied", "rejected")],
            GPUS_EXPECTED.name: [([], expected)] if expected else [],
        }

    renderer = Renderer(settings.metrics.selection(), own_counters)
    ready = readiness_under(lambda: pipeline.settings)  # the fast interval in force now: a reload may change it
    app = create_front(
        lambda: pipeline.snapshot,
        ready,
        renderer,
        settings.web.telemetry_path,
        web.basic_auth_users,
        guard=guard,
        # the first fast cycle publishes within the call deadline whatever NVML does (a hung init included)
        first_snapshot_wait_s=min(settings.poll.call_deadline, FIRST_SNAPSHOT_WAIT_MAX_S),
        expected_gpus=lambda: pipeline.settings.nvml.expected_gpus,
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
        settler = MemorySettler()
        while not stopped.wait(0.2):
            if settle_by is not None and (pipeline.ready_once.is_set() or time.monotonic() >= settle_by):
                settle_memory()  # once, when start-up is over (a first snapshot, or no GPU to wait for)
                settle_by = None
            elif settle_by is None:
                settler.tick()  # what a burst of connections freed, handed back (runtime/memory.py)
            if reload_requested.is_set():
                reload_requested.clear()
                try:
                    new = reload_settings(reread, settings, pipeline, renderer)
                except Exception:  # a bug in one reload must not end reloading for the life of the process
                    log.exception("reload failed, keeping the running configuration")
                    new = settings
                reloads["applied" if new is not settings else "rejected"] += 1
                settings = new
            if pipeline.fatal and exit_at is None:
                grace = 0 if pipeline.fatal == "library_not_found" else settings.nvml.version_mismatch_grace
                exit_at = time.monotonic() + grace
            if exit_at is not None and time.monotonic() >= exit_at:
                exit_code = EXIT_FATAL
                server.stop()
                return

    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: reload_requested.set())
    threading.Thread(target=supervise, name="gpuwarden-supervisor", daemon=True).start()
    backend = settings.nvml.backend
    if backend == "sim":  # which simulated node this is: the start-up log named no scenario (issue 36)
        from gpuwarden.sim import DEFAULT_SCENARIO

        backend = f"sim, scenario {settings.nvml.scenario or DEFAULT_SCENARIO}"
    log.info("gpuwarden %s listening on %s (backend %s)", __version__, settings.web.listen_address, backend)
    probes = None
    if probe_listener is not None:
        from gpuwarden.web.probes import ProbeApp, ProbeListener

        probes = ProbeListener(
            ProbeApp(lambda: pipeline.snapshot, ready, server.last_turn), settings.web.header_timeout
        )
        probes.start(probe_listener)
        log.info("probes (/healthz, /readyz) also on %s", settings.web.probe_listen_address)
    try:
        server.run(listener)
    finally:
        stopped.set()
        if probes is not None:
            probes.stop()
    if exit_code:
        log.error("exiting with code %d: %s", exit_code, pipeline.fatal)
    return exit_code
