"""First metrics with GPU data under start-up variants, each started N times beside nvitop-exporter in the same run
(from bytecode): what a change to the start-up would buy before it is made. Variants run the unchanged exporter
through a wrapper that changes one interpreter setting first.

    python3 bench/startup_variants.py OUT.json [N]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import side_by_side  # noqa: E402 - the bench's own start/stop helpers

PORT = side_by_side.PORT
LISTEN = f"--web.listen-address=127.0.0.1:{PORT}"
RUN = "import runpy, sys; sys.argv = ['gpuwarden', '{listen}']; runpy.run_module('exporter', run_name='__main__')"
VARIANTS = {
    "gpuwarden": [sys.executable, "-m", "exporter", LISTEN],
    # the GIL handed over every 0.5 ms instead of 5 ms while NVML's start and the imports overlap
    "switch_interval_0.5ms": [
        sys.executable,
        "-c",
        "import sys; sys.setswitchinterval(0.0005); " + RUN.format(listen=LISTEN),
    ],  # fmt: skip
    # dataclasses without generated __eq__/__hash__ (class creation cost only; not a supported mode)
    "dataclasses_no_eq": [
        sys.executable,
        "-c",
        "import dataclasses; o = dataclasses._process_class; "
        "dataclasses._process_class = lambda c, i, r, e, *a: o(c, i, r, False, *a); " + RUN.format(listen=LISTEN),
    ],  # fmt: skip
}


def main() -> None:
    out, count = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 7
    side_by_side.compile_packages()
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "starts": count}
    names = ["nvitop-exporter", *VARIANTS]
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(count):  # interleaved, so that drift on the host touches every variant alike
        for name in names:
            if name in VARIANTS:
                side_by_side.EXPORTERS[name] = (VARIANTS[name], b"gpuwarden_gpu_up")
            proc, first = side_by_side.start(name)
            times[name].append(round(first, 3))
            side_by_side.stop(proc)
            time.sleep(0.3)
    for name in names:
        results[name] = {"first_metrics_s": times[name], "median_s": statistics.median(times[name])}
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
