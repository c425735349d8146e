"""The README's references are generated from the code, and .ci/run runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

from exporter import docs

ROOT = Path(__file__).resolve().parent.parent


def test_readme_references_match_the_code():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert docs.render(readme) == readme, "run `python -m exporter.docs` to regenerate the README references"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    test_command = next(block.strip() for block in blocks if "pytest" in block)
    assert test_command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
