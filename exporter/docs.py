"""Generate the README's configuration and metric references from the code (`python -m exporter.docs`).

tests/test_docs.py fails when the committed README differs from what this produces.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from exporter.config import options
from exporter.metrics import FAMILIES

README = Path(__file__).resolve().parent.parent / "README.md"


def metric_reference() -> str:
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for family in FAMILIES.values():
        labels = ", ".join(family.all_labels) or "—"
        lines.append(f"| `{family.name}` | {family.type} | {labels} | {family.help.replace('|', '/')} |")
    return "\n".join(lines)


def config_reference() -> str:
    lines = ["| key (YAML) | flag | environment | default | meaning |", "|---|---|---|---|---|"]
    for opt in options():
        default = opt.field.default
        shown = ", ".join(default) if isinstance(default, tuple) else default
        shown = "(empty)" if shown in ((), "", None) else shown
        lines.append(f"| `{opt.key}` | `{opt.flag}` | `{opt.env}` | `{shown}` | {opt.field.description} |")
    return "\n".join(lines)


def render(text: str) -> str:
    for name, body in (("metrics", metric_reference()), ("config", config_reference())):
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md lacks the <!-- {name}:start --> / <!-- {name}:end --> markers")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text


def main() -> int:
    README.write_text(render(README.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
