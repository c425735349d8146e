"""A wedged GPU never holds the others back: fast data of the other GPUs stays fresh and /readyz stays ready while
one GPU's fast call hangs, and a GPU whose discovery hangs is skipped after the deadline (docs/nvml.md, Hangs)."""

from __future__ import annotations

import logging
import time

import pytest

from tests.helpers.common import parse_exposition, values, wait_for

pytestmark = pytest.mark.slow


def test_one_gpu_hung_for_15_s_never_stalls_the_others(live_server):
    """While GPU 2's call is stuck (past its 5 s deadline, until the hang ends at 18 s), the other GPUs' fast readings
    keep being renewed cycle after cycle and /readyz stays 200. Judged by what happens, not by a wall-clock bound on
    their age (which failed under a CPU load): a cycle held by the hung GPU would renew them at most once per
    deadline, two or three times in the stuck period, against about ten at the 1 s interval."""
    hang = {"kind": "hang", "gpu": 2, "call": "nvmlDeviceGetPowerUsage", "at": 3, "until": 18}
    server = live_server(
        {"node": {"count": 8}, "faults": [hang]},
        poll={"fast_interval": 1.0, "slow_interval": 10, "call_deadline": 5},  # the defaults: fast 1 s, deadline 5 s
    )
    wait_for(lambda: server.pipeline.snapshot.gpu("2").stale, timeout=60)  # stuck: past its deadline
    renewed: set[float] = set()  # GPU 0's fast readings published while GPU 2 was stuck
    not_ready: list[str] = []
    while (snapshot := server.pipeline.snapshot).gpu("2").stale:
        renewed.add(snapshot.gpu("0").updated_at["fast"])
        ready = server.get("/readyz")
        if ready.status_code != 200:
            not_ready.append(ready.text)
        wait_for(lambda seen=snapshot: server.pipeline.snapshot is not seen, timeout=60)  # the next publication
    assert not_ready == []
    assert len(renewed) >= 5, sorted(renewed)
    series = parse_exposition(server.get("/metrics").text)
    assert values(series, "gpuwarden_collect_timeouts_total", call="nvmlDeviceGetPowerUsage") == [1]
    assert not server.get("/api/v1/gpus/2").json()["stale"]  # once the hang clears, the GPU is read again


def test_a_gpu_whose_discovery_hangs_is_skipped_and_the_others_served(sim, make_pipeline, caplog):
    from tests.helpers.common import LiveServer

    caplog.set_level(logging.INFO)
    deadline_s, interval_s = 1.0, 0.5
    hang = {"kind": "hang", "gpu": 2, "call": "nvmlDeviceGetUUID", "at": 0, "until": 30}
    fake = sim({"node": {"count": 8}, "faults": [hang]})
    pipeline = make_pipeline(poll={"fast_interval": interval_s, "slow_interval": 5, "call_deadline": deadline_s})
    with LiveServer(pipeline) as server:
        wait_for(lambda: server.get("/readyz").status_code == 200, timeout=60)
        ready_at = fake.now()
        gpus = server.get("/api/v1/gpus").json()["gpus"]
        series = parse_exposition(server.get("/metrics").text)
    assert sorted(gpu["index"] for gpu in gpus) == [0, 1, 3, 4, 5, 6, 7]
    assert ready_at < hang["until"], ready_at  # ready while GPU 2's discovery still hung: it did not wait for it
    assert values(series, "gpuwarden_collect_timeouts_total", call="nvmlDeviceGetUUID") == [1]
    skipped = [r.getMessage() for r in caplog.records if "skipped at discovery" in r.getMessage()]
    assert skipped == ["gpu 2 skipped at discovery: nvmlDeviceGetUUID did not answer within 1.0 s"]


def test_nvml_init_begun_before_the_poller_is_adopted_once(sim, make_pipeline):
    """The CLI starts NVML's init on the pool before importing the rest; the lifecycle waits for that answer
    instead of initialising a second time (NVML counts inits: a second would need a second shutdown)."""
    from gpuwarden.config.settings import load_settings
    from gpuwarden.nvml.session import start_init
    from gpuwarden.runtime.pipeline import Pipeline
    from gpuwarden.workers import WorkerPool

    fake = sim("healthy")
    pool = WorkerPool()
    started = start_init(pool)
    pipeline = Pipeline(
        load_settings(None, environ={}, flags={"poll.fast_interval": 0.2}), pool=pool, started_init=started
    )
    try:
        pipeline.start()
        assert pipeline.ready_once.wait(10)
        assert pipeline.snapshot.nvml_up and any(gpu.up for gpu in pipeline.snapshot.gpus)
        assert fake.calls["nvmlInitWithFlags"] == 1
    finally:
        pipeline.stop(timeout=0.5)


def test_an_early_nvml_init_that_hangs_is_a_counted_timeout_and_retried(sim):
    from gpuwarden.config.settings import load_settings
    from gpuwarden.nvml.session import start_init
    from gpuwarden.runtime.pipeline import Pipeline
    from gpuwarden.workers import WorkerPool

    sim({"faults": [{"kind": "hang", "call": "nvmlInitWithFlags", "at": 0, "until": 2.5}]})
    pool = WorkerPool()
    started = start_init(pool)
    flags = {"poll.fast_interval": 0.2, "poll.call_deadline": 1.0}
    pipeline = Pipeline(load_settings(None, environ={}, flags=flags), pool=pool, started_init=started)
    try:
        pipeline.start()
        wait_for(lambda: pipeline.snapshot.nvml_error == "init_timeout", timeout=5)
        assert pipeline.poller.ledger.timeouts().get("nvmlInitWithFlags") == 1
        wait_for(lambda: pipeline.snapshot.nvml_up, timeout=15)  # the hang ends; the backoff's retry succeeds
    finally:
        pipeline.stop(timeout=0.5)


def _first_scrape(
    init_hang_s: float, call_deadline: float, tmp_path, scrapers: int = 1, headers: dict[str, str] | None = None
) -> tuple[float, dict]:
    """The real CLI whose NVML init hangs `init_hang_s`, scraped by `scrapers` at once as soon as it answers
    /healthz: how long the scrapes took, and what they said."""
    import concurrent.futures

    import httpx

    from tests.helpers.common import write_yaml
    from tests.helpers.daemon import running_cli

    hang = {"kind": "hang", "call": "nvmlInitWithFlags", "at": 0, "until": init_hang_s}
    scenario = write_yaml(tmp_path / "slow-init.yaml", {"name": "slow-init", "faults": [hang]})
    flags = ("--sim", "--nvml.scenario", str(scenario), "--poll.call-deadline", str(call_deadline))
    with running_cli(*flags) as (url, _), concurrent.futures.ThreadPoolExecutor(scrapers) as pool:
        asked = time.monotonic()
        bodies = list(
            pool.map(lambda _: httpx.get(url + "/metrics", headers=headers, timeout=30).text, range(scrapers))
        )
        took = time.monotonic() - asked
    assert len({"gpuwarden_nvml_up " in body for body in bodies}) == 1, "scrapes waiting together see the same"
    return took, parse_exposition(bodies[0])


def test_a_scrape_during_start_up_waits_for_the_first_snapshot_and_gets_the_gpus(tmp_path):
    """A restart must not give Prometheus a first sample without the GPUs: the scrape that arrives while NVML
    initialises (1.5 s here) is answered with the first snapshot."""
    took, series = _first_scrape(init_hang_s=1.5, call_deadline=4, tmp_path=tmp_path, scrapers=20)
    assert values(series, "gpuwarden_nvml_up") == [1.0], "the scrapes were answered before the first snapshot"
    assert values(series, "gpuwarden_gpu_up") and all(v == 1.0 for v in values(series, "gpuwarden_gpu_up"))
    assert took > 0.5  # it waited for the snapshot (nvml_up 1 above says which), however long a loaded machine takes


def test_a_start_up_scrape_waits_no_longer_than_the_call_deadline(tmp_path):
    """NVML's init hangs for good: the scrape is answered once the first snapshot says so (init_timeout),
    within the call deadline and a cycle, not held until Prometheus gives up."""
    took, series = _first_scrape(init_hang_s=60, call_deadline=1, tmp_path=tmp_path)
    assert values(series, "gpuwarden_nvml_up") == [0.0]
    # answered by the first snapshot, which the deadline ended (init_timeout), not held for the 60 s hang (the
    # client gives up at 30 s)
    assert ("gpuwarden_nvml_error_info", frozenset({("error", "init_timeout")})) in series


def test_a_start_up_scrape_waits_no_longer_than_prometheus_allows(tmp_path):
    """Prometheus sends its scrape timeout: the wait stays within it, so the scrape succeeds (with what is known,
    nothing of NVML yet) rather than time out and record up 0."""
    headers = {"X-Prometheus-Scrape-Timeout-Seconds": "0.5"}
    took, series = _first_scrape(init_hang_s=4, call_deadline=4, tmp_path=tmp_path, headers=headers)
    assert took > 0.3 and values(series, "gpuwarden_build_info") == [1.0]  # it used its allowance, then answered
    assert not values(
        series, "gpuwarden_nvml_up"
    )  # before the first snapshot (init hangs 4 s): within Prometheus' 0.5 s
