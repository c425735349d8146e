"""Module hygiene over the whole package: no module over 500 lines, and each opens with a docstring saying its job.

The walk covers every .py file under exporter/gpuwarden/ (new folders included); the exemptions are named here, each
with why, and must exist, so the list cannot outlive the files it excuses.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "exporter" / "gpuwarden"
MAX_LINES = 500
# Modules allowed past MAX_LINES, with why: tables that are the contract, read top to bottom, or generated code.
LONG_BY_DESIGN = {
    "model/families.py": "the metric contract: one entry per family, in exposition order",
    "config/settings.py": "the typed settings model: flags and environment names derive from its fields",
}


def module_problems(package: Path, exempt: dict[str, str]) -> list[str]:
    """One line per module (path relative to `package`) that is too long or has no module docstring whose first
    line states its job."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_LINES and name not in exempt:
            problems.append(f"{name}: {lines} lines, over {MAX_LINES}: split it by job")
        docstring = ast.get_docstring(ast.parse(text, filename=str(path)), clean=False)
        if not docstring or not docstring.splitlines()[0].strip():
            problems.append(f"{name}: no module docstring with its job on the first line")
    return problems


def test_every_module_is_short_and_says_its_job():
    missing = [name for name in LONG_BY_DESIGN if not (PACKAGE / name).is_file()]
    assert not missing, f"exempted modules that no longer exist (drop them from LONG_BY_DESIGN): {missing}"
    assert len(list(PACKAGE.rglob("*.py"))) > 100, "the package moved: this check would walk over nothing"
    assert module_problems(PACKAGE, LONG_BY_DESIGN) == []


def test_a_long_or_undocumented_module_is_found(tmp_path):
    """The check is alive: a planted long module, one without a docstring and one whose docstring starts blank are
    each named; an exempted long one and a documented package __init__ are not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "sub" / "__init__.py").write_text("x = 1\n")
    body = "x = 1\n" * MAX_LINES
    (package / "long.py").write_text(f'"""Long."""\n{body}')
    (package / "table.py").write_text(f'"""A table, long by design."""\n{body}')
    (package / "blank.py").write_text('"""\nStarts on the second line."""\n')
    (package / "fits.py").write_text(f'"""Exactly {MAX_LINES} lines."""\n' + "x = 1\n" * (MAX_LINES - 1))
    assert module_problems(package, {"table.py": "by design"}) == [
        "blank.py: no module docstring with its job on the first line",
        f"long.py: {MAX_LINES + 1} lines, over {MAX_LINES}: split it by job",
        "sub/__init__.py: no module docstring with its job on the first line",
    ]
