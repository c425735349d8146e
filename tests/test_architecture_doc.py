"""docs/architecture.md cannot drift from the code: its step lists are the pipeline's steps in the pipeline's order,
it names every module of the package, and its "Not yet here" names nothing that exists.

Each check is a function of the document's text, so the tests below also feed it planted drift (a reordered step,
a module the document does not name, a stale "Not yet here" entry) and show that it is reported.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from pathlib import Path

from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exporter" / "gpuwarden"
DOC = ROOT / "docs" / "architecture.md"
PREFIX = "exporter/gpuwarden/"

# Folders whose modules the document may name by the folder alone (folder → which of its modules): the readers,
# one per NVML domain, and the simulator's fakes, one per group of C symbols. Every other module is named itself.
NAMED_BY_FOLDER = {"collect/readers/": "*.py", "sim/": "fake*.py"}


# -- the checks, each over a document's text --------------------------------------------------------------------


def poller_block_steps(text: str) -> list[str]:
    """The steps of the composition root's drawing: `Poller(plan, steps=[A, B, ...])`."""
    found = re.search(r"Poller\(plan, steps=\[(.*?)\]\)", text, re.S)
    assert found, "docs/architecture.md has no `Poller(plan, steps=[...])` in its composition root's drawing"
    return re.findall(r"\b[A-Z]\w*Step\b", found.group(1))


def data_path_steps(text: str) -> list[str]:
    """Every step the data-path drawing names (the code block after "The data path"), in order of first mention."""
    found = re.search(r"^The data path\b.*?\n```\n(.*?)\n```", text, re.S | re.M)
    assert found, "docs/architecture.md has no data-path drawing (a code block after a line 'The data path ...')"
    return list(dict.fromkeys(re.findall(r"\b[A-Z]\w*Step\b", found.group(1))))


def step_order_problems(text: str, handed: list[str], ran: list[str]) -> list[str]:
    """Where the document's step lists differ from the pipeline's: `handed`, the steps the composition root hands
    the poller; `ran`, every step the assembler runs, the poller's own (the topology matrix) included."""
    problems = []
    if (block := poller_block_steps(text)) != handed:
        problems.append(f"the Poller drawing lists {block}, the pipeline hands the poller {handed}")
    if (path := data_path_steps(text)) != ran:
        problems.append(f"the data path lists {path}, the assembler runs {ran}")
    return problems


def package_modules(package: Path = PACKAGE) -> list[str]:
    """Every module of the package, as its path under exporter/gpuwarden/ (packages' __init__.py aside: a folder)."""
    return sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py")


def _mentions(text: str, path: str) -> bool:
    """`path` (a module or folder, relative) written whole: not the tail of a longer name or path."""
    return re.search(rf"(?<![\w/.-])(?:{PREFIX})?{re.escape(path)}(?![\w])", text) is not None


def drawing_entries(text: str) -> dict[str, str]:
    """Folder → what the drawings say under it: in every code block, a line whose first token (after an arrow) is
    a folder of the package opens an entry that runs over the lines indented past that token's column."""
    entries: dict[str, str] = {}
    for block in re.findall(r"```\n(.*?)\n```", text, re.S):
        folder, column = None, 0
        for line in block.splitlines():
            head = re.match(r"^(\s*)(?:→\s*)?(\S+)", line)
            if head is None:
                continue
            indent = len(head.group(1))
            if folder is not None and indent > column:
                entries[folder] += "\n" + line
                continue
            token = head.group(2).removeprefix(PREFIX)
            folder, column = (token, indent) if token.endswith("/") else (None, 0)
            if folder is not None:
                entries[folder] = entries.get(folder, "") + "\n" + line[head.end() :]
    return entries


def named(text: str, path: str, entries: dict[str, str]) -> bool:
    """A module or folder is named where the document writes its path under exporter/gpuwarden/ (with or without
    that prefix), or where a drawing's entry for a folder above it writes the rest of the path."""
    if _mentions(text, path):
        return True
    return any(path.startswith(folder) and _mentions(body, path[len(folder) :]) for folder, body in entries.items())


def unnamed_modules(text: str, modules: Iterable[str]) -> list[str]:
    """The modules the document names nowhere (those of NAMED_BY_FOLDER's folders count as named with the folder)."""
    entries = drawing_entries(text)
    missing = []
    for module in modules:
        by_folder = [
            folder
            for folder, pattern in NAMED_BY_FOLDER.items()
            if module.startswith(folder) and "/" not in module[len(folder) :]
            if fnmatch.fnmatch(module[len(folder) :], pattern)
        ]
        if not (named(text, module, entries) or any(named(text, folder, entries) for folder in by_folder)):
            missing.append(module)
    return missing


def not_yet_entries(text: str) -> list[str]:
    """The bullets of the "Not yet here" section."""
    found = re.search(r"^## Not yet here\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if found is None:
        return []
    return [" ".join(item.split()) for item in re.findall(r"^- (.*?)(?=^- |\Z)", found.group(1), re.S | re.M)]


def stale_not_yet_entries(text: str, package: Path = PACKAGE) -> list[str]:
    """The "Not yet here" entries that name, in backticks, something the package has: a word or path its code writes
    (a call, a setting, a metric, a device file) or a module of it. An entry names what would show it done."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in sorted(package.rglob("*.py")))
    stale = []
    for entry in not_yet_entries(text):
        present = [
            term
            for term in re.findall(r"`([^`]+)`", entry)
            if term in source or (package / term.removeprefix(PREFIX)).exists()
        ]
        if present:
            stale.append(f"{entry[:80]}... names {present}, which exist")
    return stale


# -- on the tree --------------------------------------------------------------------------------------------------


def pipeline_steps(sim) -> tuple[list[str], list[str]]:  # noqa: ANN001 - the sim fixture
    """(the steps the composition root hands the poller, every step the assembler runs), from a real Pipeline."""
    sim("healthy")
    pipeline = Pipeline(settings())
    try:
        handed = [type(step).__name__ for step in pipeline._steps()]
        ran = [type(step).__name__ for step in pipeline.poller.assembler.steps]
    finally:
        pipeline.stop(0.5)
    assert len(handed) > 1 and ran[-len(handed) :] == handed, (handed, ran)
    return handed, ran


def test_the_documented_steps_are_the_pipelines_in_order(sim) -> None:  # noqa: ANN001
    handed, ran = pipeline_steps(sim)
    assert step_order_problems(DOC.read_text(encoding="utf-8"), handed, ran) == []


def test_every_module_is_named() -> None:
    modules = package_modules()
    assert "runtime/pipeline.py" in modules and "collect/readers/power.py" in modules
    assert unnamed_modules(DOC.read_text(encoding="utf-8"), modules) == []


def test_not_yet_here_names_nothing_that_exists() -> None:
    assert stale_not_yet_entries(DOC.read_text(encoding="utf-8")) == []


# -- planted drift is caught ---------------------------------------------------------------------------------------


def test_a_planted_step_reorder_is_reported(sim) -> None:  # noqa: ANN001
    handed, ran = pipeline_steps(sim)
    text = DOC.read_text(encoding="utf-8")
    first, second = handed[0], handed[1]
    # swap the first two steps in the Poller drawing only, then in the data path only
    block = re.search(r"Poller\(plan, steps=\[.*?\]\)", text, re.S)
    assert block
    swapped = block.group(0).replace(first, "\0").replace(second, first).replace("\0", second)
    in_block = text[: block.start()] + swapped + text[block.end() :]
    problems = step_order_problems(in_block, handed, ran)
    assert len(problems) == 1 and problems[0].startswith("the Poller drawing lists"), problems

    path = re.search(r"^The data path\b.*?\n```\n.*?\n```", text, re.S | re.M)
    assert path
    swapped = path.group(0).replace(first, "\0").replace(second, first).replace("\0", second)
    in_path = text[: path.start()] + swapped + text[path.end() :]
    problems = step_order_problems(in_path, handed, ran)
    assert len(problems) == 1 and problems[0].startswith("the data path lists"), problems


def test_a_step_the_pipeline_gains_is_reported(sim) -> None:  # noqa: ANN001
    handed, ran = pipeline_steps(sim)
    text = DOC.read_text(encoding="utf-8")
    assert len(step_order_problems(text, [*handed, "PlantedStep"], [*ran, "PlantedStep"])) == 2


def test_a_planted_unnamed_module_is_reported() -> None:
    text = DOC.read_text(encoding="utf-8")
    modules = package_modules()
    planted = ["health/planted_verdicts.py", "planted_top.py", "jobs/planted/deep.py", "sim/planted_scenarios.py"]
    assert unnamed_modules(text, [*modules, *planted]) == sorted(planted, key=[*modules, *planted].index)
    # a reader and a fake are named by their folder; the same name elsewhere is not
    assert unnamed_modules(text, ["collect/readers/planted.py", "sim/fake_planted.py"]) == []
    # a module named in another folder's entry does not count: each folder's entry names its own
    unnamed_in_entry = "```\n  health/   findings.py\n  jobs/     step.py\n```\n"
    assert unnamed_modules(unnamed_in_entry, ["health/findings.py", "jobs/step.py", "jobs/findings.py"]) == [
        "jobs/findings.py"
    ]


def test_a_stale_not_yet_here_entry_is_reported() -> None:
    text = DOC.read_text(encoding="utf-8")
    planted = "## Not yet here\n\n- an optional `/dev/kmsg` XID reader for XIDs that never reach NVML (79, 119, 120)\n"
    stale = stale_not_yet_entries(re.sub(r"^## Not yet here\n", planted, text, flags=re.M))
    assert len(stale) == 1 and "/dev/kmsg" in stale[0], stale
    assert stale_not_yet_entries("## Not yet here\n\n- a `collect/kernel_log.py` module\n") != []
    assert stale_not_yet_entries("## Not yet here\n\n- a `gpuwarden_planted_total` counter\n") == []
