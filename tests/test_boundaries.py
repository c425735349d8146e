"""The layering, checked over the module import graph (not over text): NVML stays inside exporter.nvml, HTTP and
the fleet service never reach the poller or NVML, render and snapshot never reach NVML or the pod client."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from exporter.nvml import calls
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier
from exporter.tiers import TierRunner
from exporter.workers import WorkerPool

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exporter"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def import_graph() -> dict[str, set[str]]:
    """module → every module it imports (at top level or inside a function), exporter modules and third-party."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                targets.add(base)
                # `from exporter.nvml import calls` imports the module exporter.nvml.calls
                targets.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
        graph[name] = {t.strip(".") for t in targets}
    # importing a.b.c runs a/__init__ and a/b/__init__ too
    for name in list(graph):
        for target in list(graph[name]):
            parts = target.split(".")
            graph[name].update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in graph)
    return graph


def reachable(start: str) -> set[str]:
    graph, seen, todo = import_graph(), set(), [start]
    while todo:
        module = todo.pop()
        for target in graph.get(module, ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_graph_sees_imports_inside_functions():
    # exporter.cli imports the HTTP front and the poller only inside `serve`: the graph must still see them.
    assert {"exporter.front", "exporter.poller"} <= import_graph()["exporter.cli"]
    assert "pynvml" in reachable("exporter.cli")


def test_pynvml_is_imported_only_inside_the_nvml_package_and_the_simulator():
    importers = {name for name, targets in import_graph().items() if "pynvml" in targets}
    assert importers, "the graph found no importer at all: the check itself is broken"
    outside = {name for name in importers if not name.startswith(("exporter.nvml", "exporter.sim"))}
    assert not outside, outside


@pytest.mark.parametrize("start", ["exporter.server", "exporter.asgi", "exporter.fleet.app", "exporter.fleet.main"])
def test_http_and_fleet_never_reach_the_poller_or_nvml(start):
    reached = reachable(start)
    forbidden = {"exporter.poller", "exporter.lifecycle", "exporter.tiers", "pynvml"} | {
        m for m in reached if m.startswith("exporter.nvml")
    }
    assert not reached & forbidden, sorted(reached & forbidden)


@pytest.mark.parametrize("start", ["exporter.render", "exporter.snapshot"])
def test_render_and_snapshot_never_reach_nvml_or_the_pod_client(start):
    reached = reachable(start)
    bad = {m for m in reached if m.startswith(("exporter.nvml", "exporter.podresources", "grpc")) or m == "pynvml"}
    assert not bad, sorted(bad)


def test_fleet_app_imports_no_pynvml_in_a_fresh_interpreter():
    code = "import sys, exporter.fleet.app; print('pynvml' in sys.modules, 'exporter.poller' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_every_nvml_function_called_in_the_package_is_in_the_operations_table():
    """Device reads, lifecycle and events call `calls.<symbol>`; calling pynvml.nvml… directly bypasses the table."""
    for path in (PACKAGE / "nvml").glob("*.py"):
        if path.name in ("calls.py",):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func
                if isinstance(target.value, ast.Name) and target.value.id == "pynvml":
                    assert not target.attr.startswith("nvml"), f"{path.name} calls pynvml.{target.attr} directly"
                if isinstance(target.value, ast.Name) and target.value.id == "calls":
                    assert target.attr in calls.OPERATIONS, f"{path.name}: calls.{target.attr} is not an operation"


def test_readers_call_only_listed_operations():
    for path in (PACKAGE / "readers").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            is_nvml = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "nvml"
            if is_nvml and node.attr.startswith("nvmlDevice"):
                assert node.attr in calls.OPERATIONS, f"{path.name}: {node.attr}"


def test_a_reader_writing_a_family_it_did_not_declare_fails():
    from exporter.metrics import POWER_USAGE_WATTS, TEMPERATURE_CELSIUS

    def sneaky(dev, out: SampleWriter) -> None:
        out.add(TEMPERATURE_CELSIUS, 40.0)

    bad = Reader("sneaky", Tier.FAST, (POWER_USAGE_WATTS,), sneaky)
    runner = TierRunner(WorkerPool(), lambda: {Tier.FAST: [bad], Tier.SLOW: [], Tier.STATIC: []}, lambda _: 1.0)
    with pytest.raises(ValueError, match="gpuwarden_temperature_celsius is written by a reader that does not"):
        runner.read(object(), Tier.FAST)  # type: ignore[arg-type]


def test_every_shipped_reader_declares_what_it_writes(sim, make_poller):
    """Run every reader over the richest scenarios: the writer raises on an undeclared family."""
    for scenario in ("training", "ecc-uncorrectable", "legacy-pcie"):
        sim(scenario)
        poller = make_poller()
        for _ in range(3):
            poller.poll_once()
        assert not [key for key in poller.snapshot.collect_errors if key[0].endswith("_tier")], scenario
