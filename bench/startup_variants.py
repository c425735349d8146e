"""First metrics with GPU data, gpuwarden and nvitop-exporter started in turn N times each (interleaved, so that
drift on the host touches both alike), as installed and then from bytecode: the start-up comparison with enough
starts for a median. Variants of the start-up can be added to VARIANTS to measure a change before making it
(two were measured this way on 2026-11-26; docs/benchmarks.md, Footprint). `--against DIR` races another tree of
gpuwarden (DIR holds its `exporter/`, e.g. the previous release) as "gpuwarden-before", started from DIR exactly as
this checkout's is started from the repository root: a change's effect measured in one run on one host.
`--bytecode-only` skips the as-installed round.

    python3 -m bench.startup_variants OUT.json [N] [--against DIR] [--bytecode-only]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from bench import side_by_side  # the bench's own start/stop helpers

VARIANTS: dict[str, list[str]] = {}  # name → command line, started beside the two exporters


def race(count: int) -> dict:
    names = list(dict.fromkeys([*side_by_side.EXPORTERS, *VARIANTS]))  # each once, however often it is called
    for name, cmd in VARIANTS.items():
        side_by_side.EXPORTERS[name] = (cmd, b"gpuwarden_gpu_up")
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(count):
        for name in names:
            proc, first = side_by_side.start(name)
            times[name].append(round(first, 3))
            side_by_side.stop(proc)
            time.sleep(0.3)
    return {name: {"first_metrics_s": values, "median_s": statistics.median(values)} for name, values in times.items()}


def main() -> None:
    args = sys.argv[1:]
    bytecode_only = "--bytecode-only" in args
    args = [arg for arg in args if arg != "--bytecode-only"]
    if "--against" in args:
        at = args.index("--against")
        against = Path(args[at + 1]).resolve()
        del args[at : at + 2]
        VARIANTS["gpuwarden-before"] = side_by_side.EXPORTERS["gpuwarden"][0]
        side_by_side.CWD["gpuwarden-before"] = against
    out, count = Path(args[0]), int(args[1]) if len(args) > 1 else 10
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "starts": count}
    if not bytecode_only:
        results["as_installed"] = race(count)
    results["compiled"] = side_by_side.compile_packages()
    if "gpuwarden-before" in VARIANTS:
        import compileall

        compileall.compile_dir(str(side_by_side.CWD["gpuwarden-before"] / "exporter"), quiet=1, workers=0)
    results["bytecode"] = race(count)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
