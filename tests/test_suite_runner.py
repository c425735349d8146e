"""The test command's own scheduling: tests marked `xdist_group` share one worker in the parallel phase, so a module's
expensive servers (the fleet backends' Prometheus and VictoriaMetrics, a minute to fill) are set up once, not on
every worker that drew one of its tests. pytest 9.2 broke this silently (pytest-dev/pytest-xdist#1386): this test
runs the same scheduler over two grouped tests and says so if it happens again."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a pytest with two xdist workers

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.path.join(os.environ["GROUP_PROBE_OUT"], f"ran-{i}"), "w") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_grouped_tests_share_one_worker_under_the_test_commands_scheduler(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:randomly", "-p",
         "no:cacheprovider", "test_probe.py"],
        cwd=probe, capture_output=True, text=True, timeout=300, env={**os.environ, "GROUP_PROBE_OUT": str(out)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    workers = {path.read_text() for path in out.glob("ran-*")}
    assert len(list(out.glob("ran-*"))) == 6
    assert len(workers) == 1, f"the grouped tests ran on {sorted(workers)}: loadgroup does not group (xdist#1386?)"


def test_the_fleet_backends_module_is_one_group() -> None:
    tree = ast.parse((ROOT / "tests" / "test_fleet_backends.py").read_text())
    marks = next(
        ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
    )
    assert "xdist_group" in marks, marks
