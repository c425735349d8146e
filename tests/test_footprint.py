"""What the serving process loads: the real CLI (the real NVML backend, which finds no GPU on the build machine and
stays up), asked for /metrics, /healthz and /readyz, must not have imported the libraries kept out of it for its
footprint (docs/benchmarks.md, Footprint) — and the JSON API, once asked, loads them and answers.
Seen through `python -X importtime`, which lists every module the process imports, as it imports it."""

from __future__ import annotations

import gc
import subprocess
import sys

import httpx

from gpuwarden.cli.main import main
from gpuwarden.runtime.service import settle_memory
from tests.helpers.common import free_port
from tests.helpers.daemon import running_cli

KEPT_OUT = {
    "pydantic": "settings are exporter/gpuwarden/config/typed.py dataclasses",
    "prometheus_client": "the exposition is exporter/gpuwarden/exposition/text.py",
    "fastapi": "the JSON API loads on its first request",
    "starlette": "the JSON API loads on its first request",
    "anyio": "the front uses asyncio's executor",
    "yaml": "read only where a file is given",
    "statistics": "0.6 MiB for one median",
    "importlib.metadata": "the binding's version comes from its dist-info folder name",
    "grpc": "the pod-resources client loads only where the kubelet socket exists",
}


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_scrapes_and_probes_load_none_of_the_libraries_kept_out_and_the_api_loads_them_when_asked():
    with running_cli(python_flags=("-X", "importtime")) as (url, proc):
        metrics = httpx.get(url + "/metrics")
        assert metrics.status_code == 200 and b"gpuwarden_build_info" in metrics.content
        assert httpx.get(url + "/readyz").status_code == 503  # no GPU here: not ready, and says so
    loaded = _imported(proc.stderr.read())
    assert "gpuwarden.web.server" in loaded and "gpuwarden.exposition.text" in loaded, "the listing itself is broken"
    offenders = {name: why for name, why in KEPT_OUT.items() if name in loaded}
    assert not offenders, offenders


def test_the_api_loads_fastapi_on_its_first_request_and_answers():
    with running_cli(python_flags=("-X", "importtime")) as (url, proc):
        answer = httpx.get(url + "/api/v1/gpus", timeout=30)
        assert answer.status_code == 200 and answer.json()["nvml_up"] is False
    assert {"fastapi", "pydantic"} <= _imported(proc.stderr.read())


def test_npd_style_health_requests_load_no_framework_and_equal_the_api_routes_body():
    """node-problem-detector asks /api/v1/health every 30 s on every node: the front serves it from the snapshot,
    cached per snapshot, without FastAPI or pydantic (+10.8 MiB on the simulator before). Its body equals the JSON
    API's own route for the same snapshot (the schema's home, in the OpenAPI document)."""
    import asyncio

    from gpuwarden.web.api import create_app

    with running_cli(python_flags=("-X", "importtime")) as (url, proc):  # the real NVML backend (the simulator
        with httpx.Client() as client:  # itself loads pydantic for its scenario files)
            bodies = [client.get(url + "/api/v1/health") for _ in range(50)]
        assert all(b.status_code == 200 and b.headers["content-type"] == "application/json" for b in bodies)
        document = bodies[-1].json()
        assert document["nvml_up"] is False and document["gpus"] == []  # no GPU on the build machine
    loaded = _imported(proc.stderr.read())
    assert "gpuwarden.web.health_document" in loaded, "the listing itself is broken"
    assert not {"fastapi", "pydantic", "starlette"} & loaded

    # the same snapshot through the JSON API's route gives the same document
    from gpuwarden.sim import install_simulator
    from gpuwarden.web.front import create_front
    from tests.helpers.common import ManualClock, settings

    clock = ManualClock()
    install_simulator("ecc-uncorrectable", clock=clock)
    from gpuwarden.exposition.render import Renderer
    from gpuwarden.runtime.pipeline import Pipeline

    pipeline = Pipeline(settings(), wall_clock=clock)
    clock.advance(10.0)  # past the scenario's faults (t=5 s, t=8 s)
    try:
        for _ in range(3):
            pipeline.poll_once()
            clock.advance(1.0)
        snapshot = pipeline.snapshot
        front = create_front(
            lambda: snapshot, lambda snap, now: None, Renderer(lambda n: True), expected_gpus=lambda: 8
        )
        api = create_app(lambda: snapshot, lambda snap, now: None, "/metrics", lambda: 8)

        async def both() -> tuple[httpx.Response, httpx.Response]:
            answers = []
            for app in (front, api):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                    answers.append(await client.get("/api/v1/health"))
            return answers[0], answers[1]

        served, routed = asyncio.run(both())
        assert served.status_code == routed.status_code == 200
        levels = [c["level"] for g in served.json()["gpus"] for c in g["checks"].values()]
        assert served.json() == routed.json() and 2 in levels  # a critical verdict, with its `since`
        assert served.content == routed.content  # byte for byte, as the JSON API encodes
    finally:
        pipeline.stop()
        from gpuwarden.nvml import library

        library.install(None)


# The real CLI on the simulator, with a thread started where serving begins that reports, once /readyz says ready,
# whether the cyclic GC was off during start-up and is on again (and start-up's objects frozen) afterwards.
WATCH_GC = """
import gc, os, sys, threading, time, urllib.request
import gpuwarden.cli.main as cli
import gpuwarden.runtime.service as service

def watch(url, disabled_at_start):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.05)
    while not (gc.isenabled() and gc.get_freeze_count()) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(disabled_at_start, gc.isenabled(), gc.get_freeze_count() > 0, flush=True)
    os._exit(0)

serve = service.serve
def watched_serve(settings, reread):
    url = "http://" + settings.web.listen_address
    threading.Thread(target=watch, args=(url, not gc.isenabled()), daemon=True).start()
    return serve(settings, reread)

service.serve = watched_serve
cli.main(["--sim", "--nvml.scenario=healthy", "--web.listen-address=127.0.0.1:" + sys.argv[1]])
"""


def test_the_cyclic_gc_is_off_during_start_up_and_on_again_once_the_first_snapshot_is_out():
    done = subprocess.run(
        [sys.executable, "-c", WATCH_GC, str(free_port())], capture_output=True, text=True, timeout=90
    )
    assert done.stdout.split() == ["True", "True", "True"], done.stdout + done.stderr[-2000:]


def test_settle_memory_and_an_early_exit_leave_the_gc_on():
    gc.disable()
    try:
        settle_memory()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
    assert main(["--poll.fast-interval=often"]) == 2  # a config error ends start-up: the GC is not left off
    assert gc.isenabled()


ARENA_PROBE = """
import ctypes, sys, threading
from gpuwarden.runtime.service import limit_malloc_arenas

limited = limit_malloc_arenas({} if sys.argv[1] == "limit" else {"MALLOC_ARENA_MAX": "8"})
start = threading.Barrier(8)
kept = []
def allocate():
    start.wait()  # every thread allocating at once: each would get an arena of its own
    kept.append([bytearray(2000) for _ in range(2000)])  # above pymalloc's 512 bytes: glibc's malloc
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
stream = libc.fopen(sys.argv[2].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(stream))
libc.fclose(ctypes.c_void_p(stream))
print(limited, open(sys.argv[2]).read().count("<heap nr="))
"""


def test_the_daemon_limits_glibc_to_two_malloc_arenas_unless_told_otherwise(tmp_path):
    """Threads that allocate at once get arenas of their own, each keeping what its thread freed; the daemon asks
    glibc for two (runtime.service.limit_malloc_arenas), and leaves an operator's MALLOC_ARENA_MAX alone."""
    import subprocess

    def heaps(mode: str) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", ARENA_PROBE, mode, str(tmp_path / f"{mode}.xml")],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split()  # fmt: skip
        return out[0], int(out[1])

    limited, with_limit = heaps("limit")
    left_alone, without = heaps("operator")
    assert (limited, left_alone) == ("True", "False")
    assert with_limit <= 2 < without, (with_limit, without)  # the probe tells them apart: more than two unlimited


SETTLE_PROBE = """
import gc, sys
from gpuwarden.runtime.memory import MemorySettler

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

class Connection:  # what a flood leaves: objects in reference cycles, each holding a buffer from glibc's malloc
    def __init__(self):
        self.me, self.buffer = self, bytearray(4000)

gc.disable()  # as in the daemon between full collections: nothing collects the cycles by itself here
now = [0.0]
settler = MemorySettler(every_s=30, clock=lambda: now[0])
before = rss_mib()
flood = [Connection() for _ in range(20_000)]
keep = [bytearray(4000) for _ in range(200)]  # live allocations between the freed ones: the heap cannot shrink
del flood
held = rss_mib()
now[0] = 29.0
early = settler.tick()
now[0] = 30.0
settled = settler.tick()
print(early, settled.collected, settled.trimmed, round(held - before), round(rss_mib() - before))
"""


def test_memory_a_burst_freed_goes_back_at_the_next_settle():
    """Objects left in cycles with a buffer each (~80 MiB, as 4,000 stalled TLS handshakes left): nothing is handed
    back until the settle is due (the clock is injected); then the full collection frees them and malloc_trim
    hands the pages back (runtime/memory.py)."""
    out = subprocess.run(
        [sys.executable, "-c", SETTLE_PROBE], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    early, collected, trimmed, held_mib, left_mib = out[0], int(out[1]), out[2], int(out[3]), int(out[4])
    assert early == "None"  # not due yet: nothing ran
    assert collected >= 20_000 and trimmed == "True"
    assert held_mib >= 60 and left_mib <= 10, (held_mib, left_mib)
