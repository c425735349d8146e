"""Where gpuwarden's resident memory goes on a GPU host: the interpreter alone, NVML initialised, then the exporter's
serving path built in-process (pipeline running, HTTP stack imported), with tracemalloc's largest Python allocators.

    python3 bench/rss_breakdown.py OUT.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RSS = "int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])/1024"


def child(code: str) -> float:
    return float(subprocess.run([sys.executable, "-c", code + f"\nprint({RSS})"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip().splitlines()[-1])  # fmt: skip


def main() -> None:
    out: dict = {"interpreter": child("pass"), "interpreter_-S_no_site": float(subprocess.run(
        [sys.executable, "-S", "-c", f"print({RSS})"], capture_output=True, text=True).stdout)}  # fmt: skip
    out["pynvml_imported"] = child("import pynvml")
    out["nvml_initialised_1_gpu"] = child("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)")
    out["prometheus_client"] = child("import prometheus_client")
    out["pydantic"] = child("import pydantic")
    out["exporter_config"] = child("import gpuwarden.config.settings")
    out["http_server"] = child("import gpuwarden.web.server")
    code = """
import tracemalloc, time
tracemalloc.start(1)
from gpuwarden.config.settings import load_settings
from gpuwarden.runtime.pipeline import Pipeline
settings = load_settings(None, environ={}, flags={})
pipeline = Pipeline(settings)
pipeline.start()
import gpuwarden.web.server, gpuwarden.web.front, gpuwarden.exposition.render
time.sleep(6)
snap = tracemalloc.take_snapshot()
stats = snap.statistics('filename')[:15]
import json
print(json.dumps([[s.traceback[0].filename.split('site-packages/')[-1], round(s.size / 2**20, 2)] for s in stats]))
print(json.dumps(round(sum(s.size for s in snap.statistics('filename')) / 2**20, 1)))
"""
    result = subprocess.run([sys.executable, "-c", code + f"\nprint({RSS})"], capture_output=True, text=True, cwd=ROOT)
    lines = result.stdout.strip().splitlines()
    if len(lines) >= 3:
        out["serving_path_rss"] = float(lines[-1])
        out["tracemalloc_total_mib"] = json.loads(lines[-2])
        out["tracemalloc_top_files_mib"] = json.loads(lines[-3])
    else:
        out["error"] = result.stderr[-1500:]
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
