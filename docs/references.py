"""Generate the configuration reference (docs/configuration.md), the metric, collector-group and series-budget
references (docs/metrics.md) and docs/nvml.md's operations table from the code (`python docs/references.py`).

tests/test_docs.py fails when the committed documents differ from what this produces.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from gpuwarden.config.settings import options
from gpuwarden.model.families import FAMILIES

DOCS = Path(__file__).resolve().parent
if str(DOCS) not in sys.path:  # run as a script, or imported by tests as docs.references
    sys.path.insert(0, str(DOCS))
NVML_DOC = DOCS / "nvml.md"
METRICS_DOC = DOCS / "metrics.md"
CONFIG_DOC = DOCS / "configuration.md"


def metric_reference() -> str:
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in FAMILIES.values():
        labels = ", ".join(family.all_labels) or "—"
        lines.append(f"| `{family.name}` | {family.type} | {labels} | {family.help.replace('|', '/')} |")
    return "\n".join(lines)


def config_reference() -> str:
    lines = ["| key (YAML) | flag | environment | default | meaning |", "|---|---|---|---|---|"]
    for opt in options():
        default = opt.default
        shown = ", ".join(default) if isinstance(default, tuple) else default
        shown = "(empty)" if shown in ((), "", None) else shown
        lines.append(f"| `{opt.key}` | `{opt.flag}` | `{opt.env}` | `{shown}` | {opt.description} |")
    return "\n".join(lines)


def groups_reference() -> str:
    from gpuwarden.model.families import GROUPS

    lines = ["| group (all off by default) | exports |", "|---|---|"]
    for group in GROUPS.values():
        lines.append(f"| `{group.name}` | {group.description.replace('|', '/')} |")
    return "\n".join(lines)


def budget_reference() -> str:
    from series_budget import budget_table, default_series  # docs/, beside this file (on sys.path below)

    return budget_table(default_series())


def operations_reference() -> str:
    from gpuwarden.nvml.calls import OPERATIONS

    lines = ["| NVML call | used by | on error |", "|---|---|---|"]
    for name, operation in OPERATIONS.items():
        lines.append(f"| `{name}` | {operation.tier} | {operation.on_error.replace('|', '/')} |")
    return "\n".join(lines)


def _fill(text: str, sections: dict[str, str], where: str) -> str:
    for name, body in sections.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{where} lacks the <!-- {name}:start --> / <!-- {name}:end --> markers")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text


def render_metrics_doc(text: str) -> str:
    """docs/metrics.md with its metric, collector-group and series-budget references filled in."""
    sections = {"metrics": metric_reference(), "groups": groups_reference(), "budget": budget_reference()}
    return _fill(text, sections, "docs/metrics.md")


def render_config_doc(text: str) -> str:
    """docs/configuration.md with its configuration reference filled in."""
    return _fill(text, {"config": config_reference()}, "docs/configuration.md")


def render_nvml_doc(text: str) -> str:
    """docs/nvml.md with its operations table filled in."""
    return _fill(text, {"operations": operations_reference()}, "docs/nvml.md")


RENDERERS = {METRICS_DOC: render_metrics_doc, CONFIG_DOC: render_config_doc, NVML_DOC: render_nvml_doc}


def main() -> int:
    for path, render in RENDERERS.items():
        path.write_text(render(path.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
