"""Hot reload: SIGHUP re-reads the configuration atomically; /metrics never goes empty; a bad file is rejected."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.helpers.common import wait_for, write_yaml
from tests.helpers.daemon import running_cli, start_daemon, wait_ready

pytestmark = pytest.mark.slow  # end-to-end: real servers, Prometheus or Helm


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX")
def test_sighup_reloads_atomically_and_rejects_a_bad_file(tmp_path):
    config = write_yaml(
        tmp_path / "gpuwarden.yaml", {"nvml": {"backend": "sim", "scenario": "healthy"}, "poll": {"fast_interval": 0.2}}
    )
    exporter = start_daemon("--config", str(config), ready="/readyz")
    proc, url = exporter.proc, exporter.url + "/metrics"
    bad_scrapes: list[str] = []
    stop = threading.Event()

    def scrape_all_the_time() -> None:
        while not stop.is_set():
            try:
                body = httpx.get(url, timeout=5).text
                if "gpuwarden_nvml_up 1.0" not in body or "gpuwarden_gpu_up" not in body:
                    bad_scrapes.append(body[:200])
            except httpx.HTTPError as exc:
                bad_scrapes.append(repr(exc))
            time.sleep(0.02)

    try:
        assert "gpuwarden_temperature_celsius" in httpx.get(url).text
        scraper = threading.Thread(target=scrape_all_the_time)
        scraper.start()
        write_yaml(
            config,
            {
                "nvml": {"backend": "sim", "scenario": "healthy"},
                "poll": {"fast_interval": 0.2},
                "metrics": {"exclude": ["gpuwarden_temperature_celsius"]},
            },
        )
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "gpuwarden_temperature_celsius" not in httpx.get(url).text)
        # an invalid file: rejected, the running configuration stays (temperature still excluded)
        config.write_text("poll: {fast_interval: -1}\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        body = httpx.get(url).text
        assert "gpuwarden_temperature_celsius" not in body and "gpuwarden_energy_joules_total" in body
        stop.set()
        scraper.join()
        assert bad_scrapes == []
        assert proc.poll() is None
    finally:
        stop.set()
        exporter.stop()
    logs = exporter.output()
    assert "configuration reloaded" in logs
    assert "reload rejected, keeping the running configuration: config file" in logs
    assert "poll.fast_interval" in logs and "Traceback" not in logs


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX")
def test_readyz_judges_freshness_by_the_reloaded_fast_interval(tmp_path):
    """After a reload from a 1 s to a 10 s fast interval the exporter is healthy: /readyz must not judge it by the
    interval it started with (3 × 1 s), which would say "not ready" for ~7 s of every 10 s cycle."""
    config = write_yaml(tmp_path / "gpuwarden.yaml", {"nvml": {"backend": "sim"}, "poll": {"fast_interval": 1}})
    with running_cli("--config", str(config)) as (base_url, proc):
        url = base_url + "/readyz"
        wait_ready(url)
        write_yaml(config, {"nvml": {"backend": "sim"}, "poll": {"fast_interval": 10}})
        proc.send_signal(signal.SIGHUP)
        started, answers = time.monotonic(), []
        while time.monotonic() - started < 13:  # more than one whole 10 s cycle
            answers.append(httpx.get(url, timeout=5).status_code)
            time.sleep(0.25)
        assert set(answers) == {200}, answers
        proc.terminate()
        logs = proc.communicate(timeout=10)[1]
    assert "configuration reloaded" in logs


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX")
def test_a_reload_during_a_hung_start_is_applied_without_waiting_for_the_first_snapshot(tmp_path):
    """NVML's init hangs past the call deadline (5 s): the first snapshot waits for it, SIGHUP must not."""
    scenario = write_yaml(
        tmp_path / "hung.yaml",
        {"name": "hung", "faults": [{"kind": "hang", "call": "nvmlInitWithFlags", "at": 0, "until": 30}]},
    )
    lines: list[str] = []
    with running_cli("--sim", "--nvml.scenario", str(scenario)) as (_, proc):
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any("configuration reloaded" in line for line in lines), timeout=30)
        reloaded = next(i for i, line in enumerate(lines) if "configuration reloaded" in line)
        # applied before the first snapshot (which waits out the 5 s deadline on the hung init), not after it
        assert not any("first snapshot published" in line for line in lines[:reloaded]), lines
