"""What each import (and NVML's initialisation) costs in resident memory and time on a GPU host, each set in a
fresh interpreter, three times (median): the numbers behind the serving process's choice of libraries.

    python3 -m bench.import_costs OUT.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import sys, time
t = time.perf_counter()
{code}
took = time.perf_counter() - t
rss = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) / 1024
print(rss, took * 1000, len(sys.modules))
"""
INIT = "pynvml.nvmlInit(); pynvml.nvmlDeviceGetHandleByIndex(0)"
SETS = {
    "nothing": "pass",
    "pynvml": "import pynvml",
    "pynvml+init": f"import pynvml; {INIT}",
    "prometheus_client": "import prometheus_client",
    "asyncio": "import asyncio",
    "ssl": "import ssl",
    "selectors+socketserver": "import selectors, socketserver",
    "httptools": "import httptools",
    "h11": "import h11",
    "msgspec": "import msgspec",
    "pydantic": "import pydantic",
    "uvicorn": "import uvicorn",
    "base: prometheus_client+pynvml+init": f"import prometheus_client, pynvml; {INIT}",
    "base+asyncio+httptools": f"import prometheus_client, pynvml, asyncio, httptools; {INIT}",
    "base+msgspec": f"import prometheus_client, pynvml, msgspec; {INIT}",
    "nvitop_exporter+init": f"import nvitop_exporter, pynvml; {INIT}",
    "gpuwarden.config.settings": "import gpuwarden.config.settings",
    "gpuwarden.cli.main": "import gpuwarden.cli.main",
    "gpuwarden.web.server": "import gpuwarden.web.server",
    "exporter serving path": (
        "import gpuwarden.cli.main, gpuwarden.collect.poller, gpuwarden.web.front, gpuwarden.web.server"
    ),
}


def measure(code: str) -> dict[str, float]:
    runs = []
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True, text=True,
                                cwd=ROOT)  # fmt: skip
        if result.returncode:
            return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
        runs.append([float(x) for x in result.stdout.split()])
    return {"rss_mib": round(statistics.median(r[0] for r in runs), 1),
            "ms": round(statistics.median(r[1] for r in runs), 1), "modules": int(runs[0][2])}  # fmt: skip


def main() -> None:
    out = {name: measure(code) for name, code in SETS.items()}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    for name, row in out.items():
        print(f"{name:40} {row}")


if __name__ == "__main__":
    main()
