"""The layering, as import-linter contracts (pyproject.toml) over the import graph: only nvml/ and sim/ import
pynvml, web/ and exposition/ never reach collect/ or NVML, the model never reaches NVML or the pod client, and the
fleet service loads nothing of NVML. Plus the operations-table checks the graph cannot make."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwarden.collect.reader import Reader
from gpuwarden.collect.tiers import TierRunner
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls
from gpuwarden.workers import WorkerPool
from tests.helpers.common import sweep

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exporter" / "gpuwarden"


def lint_imports(cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """import-linter over the contracts in pyproject.toml (in `cwd`), as the test command runs it."""
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_layer_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("KEPT") == 7, result.stdout  # every contract ran


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    sweep(
        [
            ("web/front.py", "import pynvml", "gpuwarden.web is not allowed to import pynvml"),
            ("exposition/render.py", "from gpuwarden.collect import poller", "gpuwarden.exposition is not allowed"),
            (
                "fleet/views/queries.py",
                "from gpuwarden.nvml import calls",
                "gpuwarden.fleet is not allowed to import pynvml",
            ),
            ("model/snapshot.py", "import grpc", "gpuwarden.model is not allowed to import grpc"),
            ("remediation/npd.py", "import httpx", "gpuwarden.remediation is not allowed to import httpx"),
            (
                "collect/poller.py",
                "from gpuwarden.config import settings",
                "gpuwarden.collect is not allowed to import gpuwarden.config",
            ),
            # the layers contract: one back-edge across each boundary, and one between siblings of a layer
            (
                "fleet/views/queries.py",
                "from gpuwarden.cli import main",
                "gpuwarden.fleet is not allowed to import gpuwarden.cli",
            ),
            (
                "web/front.py",
                "from gpuwarden.runtime import pipeline",
                "gpuwarden.web is not allowed to import gpuwarden.runtime",
            ),
            (
                "health/checks.py",
                "from gpuwarden.web import front",
                "gpuwarden.health is not allowed to import gpuwarden.web",
            ),
            (
                "collect/poller.py",
                "from gpuwarden.health import checks",
                "gpuwarden.collect is not allowed to import gpuwarden.health",
            ),
            (
                "nvml/device.py",
                "from gpuwarden.collect import poller",
                "gpuwarden.nvml is not allowed to import gpuwarden.collect",
            ),
            (
                "config/settings.py",
                "from gpuwarden.nvml import errors",
                "gpuwarden.config is not allowed to import gpuwarden.nvml",
            ),
            (
                "model/snapshot.py",
                "from gpuwarden.config import settings",
                "gpuwarden.model is not allowed to import gpuwarden.config",
            ),
            (
                "workers.py",
                "from gpuwarden.model import snapshot",
                "gpuwarden.workers is not allowed to import gpuwarden.model",
            ),
            (
                "web/front.py",
                "from gpuwarden.sim import scenario",
                "gpuwarden.web is not allowed to import gpuwarden.sim",
            ),
            (
                "health/checks.py",
                "from gpuwarden.attribution import processes",
                "gpuwarden.health is not allowed to import gpuwarden.attribution",
            ),
            (
                "fleet/views/queries.py",
                "from gpuwarden.runtime import pipeline",
                "gpuwarden.fleet is not allowed to import gpuwarden.runtime",
            ),
            # the job view sits above the stages it reads and below the runtime: no arrow back up
            (
                "health/checks.py",
                "from gpuwarden.jobs import collective",
                "gpuwarden.health is not allowed to import gpuwarden.jobs",
            ),
            (
                "jobs/collective.py",
                "from gpuwarden.runtime import pipeline",
                "gpuwarden.jobs is not allowed to import gpuwarden.runtime",
            ),
        ],
        # the developer tier plants one edge of each kind of contract: a forbidden import and a layers back-edge
        lambda case: (
            case[:2]
            in (("web/front.py", "import pynvml"), ("collect/poller.py", "from gpuwarden.health import checks"))
        ),
    ),
)
def test_a_planted_violation_breaks_its_contract(tmp_path, module, planted, contract):
    """The contracts catch what they forbid, even inside a function (where lazy imports live)."""
    copy = tmp_path / "src" / "gpuwarden"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _planted() -> None:\n    {planted}\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    result = lint_imports(tmp_path, extra_path=tmp_path / "src")
    assert result.returncode != 0, result.stdout
    assert contract in result.stdout and "BROKEN" in result.stdout, result.stdout


def test_fleet_app_imports_no_pynvml_in_a_fresh_interpreter():
    code = "import sys, gpuwarden.fleet.app; print('pynvml' in sys.modules, 'gpuwarden.collect.poller' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_every_nvml_function_called_in_the_package_is_in_the_operations_table():
    """Device reads, lifecycle and events call `calls.<symbol>`; calling pynvml.nvml… directly bypasses the table."""
    modules = sorted((PACKAGE / "nvml").glob("*.py"))
    assert len(modules) > 5, "the nvml folder moved: this check would pass over nothing"
    for path in modules:
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
    readers = sorted((PACKAGE / "collect" / "readers").glob("*.py"))
    assert len(readers) > 5, "the readers folder moved: this check would pass over nothing"
    for path in readers:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            is_nvml = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "nvml"
            if is_nvml and node.attr.startswith("nvmlDevice"):
                assert node.attr in calls.OPERATIONS, f"{path.name}: {node.attr}"


def test_a_reader_writing_a_family_it_did_not_declare_fails():
    from gpuwarden.model.families import POWER_USAGE_WATTS, TEMPERATURE_CELSIUS

    def sneaky(dev, out: SampleWriter) -> None:
        out.add(TEMPERATURE_CELSIUS, 40.0)

    bad = Reader("sneaky", Tier.FAST, (POWER_USAGE_WATTS,), sneaky)
    runner = TierRunner(WorkerPool(), lambda: {Tier.FAST: [bad], Tier.SLOW: [], Tier.STATIC: []}, lambda _: 1.0)
    with pytest.raises(ValueError, match="gpuwarden_temperature_celsius is written by a reader that does not"):
        runner.read(object(), Tier.FAST)  # type: ignore[arg-type]


def test_every_shipped_reader_declares_what_it_writes(sim, make_pipeline):
    """Run every reader over the richest scenarios: the writer raises on an undeclared family."""
    for scenario in ("training", "ecc-uncorrectable", "legacy-pcie"):
        sim(scenario)
        pipeline = make_pipeline()
        for _ in range(3):
            pipeline.poll_once()
        assert not [key for key in pipeline.snapshot.collect_errors if key[0].endswith("_tier")], scenario


def import_cycles(package: str, path: Path) -> list[list[str]]:
    """Every set of modules of `package` (found under `path`) that import one another round a loop: Tarjan's strongly
    connected components over the direct imports grimp finds (imports inside functions included)."""
    import grimp

    sys.path.insert(0, str(path))
    try:
        graph = grimp.build_graph(package, cache_dir=None)
    finally:
        sys.path.remove(str(path))
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in graph.modules) for m in graph.modules
    }
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in edges[module]:
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                cycles.append(sorted([module, *component]))

    for module in sorted(graph.modules):
        if module not in order:
            visit(module)
    return cycles


def test_no_module_imports_itself_round_a_loop(tmp_path):
    """No import cycle anywhere in the package (collect/readers/__init__ and the readers imported each other); a
    planted loop is found, so the check is alive."""
    assert import_cycles("gpuwarden", ROOT / "exporter") == []
    planted = tmp_path / "loopy"
    planted.mkdir()
    (planted / "__init__.py").write_text("")
    (planted / "a.py").write_text("from loopy import b\n")
    (planted / "b.py").write_text("def f():\n    from loopy import a\n")
    assert import_cycles("loopy", tmp_path) == [["loopy.a", "loopy.b"]]
