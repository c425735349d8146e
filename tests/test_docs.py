"""The documents' references are generated from the code, and .ci/run runs the README's test command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from docs import references as docs

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # regenerates every reference, the series budget included
def test_metric_references_match_the_code():
    text = docs.METRICS_DOC.read_text(encoding="utf-8")
    assert docs.render_metrics_doc(text) == text, "run `python docs/references.py` to regenerate docs/metrics.md"


def test_configuration_reference_matches_the_code():
    text = docs.CONFIG_DOC.read_text(encoding="utf-8")
    assert docs.render_config_doc(text) == text, "run `python docs/references.py` to regenerate docs/configuration.md"
    assert "`--web.listen-address`" in text and "`GPUWARDEN_POLL_FAST_INTERVAL`" in text


def test_nvml_doc_lists_every_operation_the_code_performs():
    text = (ROOT / "docs" / "nvml.md").read_text(encoding="utf-8")
    assert docs.render_nvml_doc(text) == text, "run `python docs/references.py` to regenerate docs/nvml.md"
    assert "`nvmlDeviceGetPowerUsage`" in text and "`nvmlInitWithFlags`" in text


def test_no_document_or_comment_points_outside_the_repository():
    """Facts the code relies on live in docs/; a path above the repository root cannot be followed by a reader."""
    outside = re.compile(r"\.\./shared|\bnvml\.md §|\balerting\.md §|anchors\.md")
    offenders = []
    for path in ROOT.rglob("*"):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".json", ".tpl", ".txt", ".service"}:
            continue
        if path.name == "test_docs.py":
            continue
        if outside.search(path.read_text(encoding="utf-8", errors="replace")):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [block.strip() for block in re.findall(r"```sh\n(.*?)```", readme, re.S)]
    assert ".ci/test" in blocks  # the README's test command is the script, alone in its block
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^exec \.ci/test$", ci, re.M), ci
    script = (ROOT / ".ci" / "test").read_text(encoding="utf-8")
    assert os.access(ROOT / ".ci" / "test", os.X_OK) and script.startswith("#!/usr/bin/env bash\n")
    assert re.search(r"^set -euo pipefail$", script, re.M)
    # it lints, and runs the whole suite with pytest's arguments passed through; every step stops on failure
    assert "python -m ruff check ." in script and "python -m ruff format --check ." in script
    assert "lint-imports" in script  # the layer contracts
    assert 'python -m pytest -q -n 4 --dist loadgroup --phase parallel "$@"' in script  # on 4 workers, then
    assert 'python -m pytest -q -n 2 --dist loadfile --phase serial "$@"' in script  # the load-sensitive ones apart
    assert script.rstrip().endswith('exit "$status"')  # failing if either phase failed
    # in a venv of its own: Debian's Python refuses pip outside one (PEP 668)
    assert "python3 -m venv .venv" in script and 'PATH="$PWD/.venv/bin:$PATH"' in script
    assert re.search(r"^export CI_REQUIRE_ALL_TESTS=1$", ci, re.M)  # CI fails on a skipped test


@pytest.mark.parametrize(("required", "code"), [("1", 1), ("", 0)])
def test_a_skip_fails_the_run_only_where_ci_requires_every_test(tmp_path, required, code):
    (tmp_path / "test_tool.py").write_text(
        "import pytest\n\ndef test_needs_a_tool():\n    pytest.skip('sometool is not installed')\n"
        "\ndef test_runs():\n    assert True\n"
    )
    # only the plugin under test: the installed ones' imports would take most of this run
    env = {
        **os.environ,
        "CI_REQUIRE_ALL_TESTS": required,
        "PYTHONPATH": str(ROOT),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.require_all", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == code, result.stdout
    assert ("which CI does not allow" in result.stdout) == (required == "1"), result.stdout


# bench scripts other changes still have on sys.path; each one goes when it imports as `bench.NAME`
STILL_ON_SYS_PATH = {"fleet_scale.py", "hostile_clients.py", "kernel_log_forgery_rss.py"}


def bench_index() -> dict[str, list[str]]:
    """bench/README.md's table: script → the documents its line says cite it."""
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([^|]+) \|$", (ROOT / "bench" / "README.md").read_text(), re.M)
    return {script: [doc.strip() for doc in docs.split(",")] for script, docs in rows}


def test_every_bench_has_its_line_and_is_cited_where_the_line_says():
    """bench/ holds what is maintained: each script has a line in bench/README.md naming a document that cites it
    (where its figures are), each line a script that exists."""
    index = bench_index()
    benches = sorted(
        p.relative_to(ROOT / "bench").as_posix()
        for p in (ROOT / "bench").rglob("*")
        if p.is_file() and p.suffix in (".py", ".sh", ".yaml") and p.name != "__init__.py" and "results" not in p.parts
    )
    assert len(benches) > 20
    assert sorted(index) == benches
    uncited = [
        (script, doc)
        for script, docs in index.items()
        for doc in docs
        if not (ROOT / doc).is_file() or Path(script).stem not in (ROOT / doc).read_text(encoding="utf-8")
    ]
    assert uncited == []


def test_bench_scripts_import_as_packages_and_their_imports_resolve():
    """Every module a Python bench imports from gpuwarden, tests or bench still exists (a rename that forgets bench/
    fails here, not on a lent GPU host), and none edits sys.path to find them (`python -m bench.NAME`)."""
    import ast
    import importlib.util

    missing, on_sys_path, stale = [], [], set(STILL_ON_SYS_PATH)
    for path in sorted((ROOT / "bench").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "sys.path" in source:
            stale.discard(path.name)
            if path.name not in STILL_ON_SYS_PATH:
                on_sys_path.append(path.name)
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.ImportFrom) and node.module):
                continue
            if node.module.split(".")[0] in ("gpuwarden", "tests", "bench"):
                module = importlib.import_module(node.module)
                missing += [
                    f"{path.name}: {node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None
                ]
    assert missing == []
    assert on_sys_path == []
    assert stale == set(), "no longer on sys.path: drop them from STILL_ON_SYS_PATH"


README_MAX_LINES = 250
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def readme_problems(text: str) -> list[str]:
    """The README reads in five minutes and holds no lab notebook: under README_MAX_LINES lines, no commit hash."""
    problems = []
    if (lines := len(text.splitlines())) >= README_MAX_LINES:
        problems.append(f"{lines} lines (the README stays under {README_MAX_LINES}: move reference to docs/)")
    problems += [f"a commit hash: {found}" for found in COMMIT_HASH.findall(text)]
    return problems


def test_the_readme_is_short_and_names_no_commit():
    assert readme_problems((ROOT / "README.md").read_text(encoding="utf-8")) == []


def test_a_long_readme_or_a_commit_hash_is_reported():
    assert readme_problems("# x\n" * README_MAX_LINES) != []
    assert readme_problems("fixed at 8f05687, measured at d3a938b1c2\n") == [
        "a commit hash: 8f05687",
        "a commit hash: d3a938b1c2",
    ]
    # numbers, words of hex letters and UUIDs' short parts are not commits
    assert readme_problems("10045 deadbeef 1234567 2026-11-29 `cafe` 0x1f\n") == []


# A count of something the tree defines (rules, scenarios, dashboards, tests, ...) goes stale the day one is added:
# the documents give none, outside the tables docs/references.py generates. Measured figures keep their counts with
# their conditions in docs/benchmarks.md and the validation reports.
NUMBER = r"(?:\d[\d,]*|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve)"
DEFINED = (
    r"alert rules|alerts|rules|recording rules|scenarios|dashboards|tests|test files|test cases|cases|checks"
    r"|collector groups|groups|modules|endpoints|panels|runbooks|metric families|families"
)
COUNT = re.compile(rf"\b{NUMBER} (?:[a-z-]+ )?(?:{DEFINED})\b", re.I)
MEASURED = ("docs/benchmarks.md", "docs/validation/")


def counts_of_defined_things(text: str) -> list[str]:
    """The counts of things the tree defines in a document, its generated tables aside."""
    prose = re.sub(r"<!-- (\w+):start -->.*?<!-- \1:end -->", "", text, flags=re.S)
    return [found.group(0) for found in COUNT.finditer(prose)]


def test_no_document_counts_what_the_tree_defines():
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {
        str(path.relative_to(ROOT)): counts
        for path in documents
        if not str(path.relative_to(ROOT)).startswith(MEASURED)
        if (counts := counts_of_defined_things(path.read_text(encoding="utf-8")))
    }
    assert found == {}, "drop these counts, or generate them (docs/references.py)"


def test_a_planted_count_is_reported():
    assert counts_of_defined_things("gpuwarden ships 29 alert rules and twenty scenarios") == ["29 alert rules"]
    planted = "in three groups, with 12 shipped scenarios"
    assert counts_of_defined_things(planted) == ["three groups", "12 shipped scenarios"]
    assert counts_of_defined_things("<!-- budget:start -->\n377 checks\n<!-- budget:end -->\n") == []
