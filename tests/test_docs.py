"""The README's references are generated from the code, and .ci/run runs the README's test command."""

from __future__ import annotations

import os
import re
from pathlib import Path

from docs import references as docs

ROOT = Path(__file__).resolve().parent.parent


def test_readme_references_match_the_code():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert docs.render(readme) == readme, "run `python docs/references.py` to regenerate the README references"


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
    assert "python3 -m ruff check ." in script and "python3 -m ruff format --check ." in script
    assert script.rstrip().endswith('python3 -m pytest -q "$@"')
