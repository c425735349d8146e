"""How long `gpuwarden npd-plugin` and `gpuwarden slurm-healthcheck --dry-run` take per run, as node-problem-detector
and slurmd run them (a fresh process each time), against the exporter over the simulator on loopback.

    python -m bench.remediation_timing [--runs 20] [--scenario ecc-uncorrectable]

NPD kills a plugin after 5 s by default, slurmd a health check after 60 s. Prints the median and the slowest run.
The Slurm part needs sinfo on PATH and a reachable slurmctld; it is skipped (one line) otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

from tests.helpers.daemon import free_port, running_cli


def timed(command: list[str], runs: int) -> tuple[list[float], set[int]]:
    took, codes = [], set()
    for _ in range(runs):
        began = time.perf_counter()
        codes.add(subprocess.run(command, capture_output=True, check=False).returncode)
        took.append(time.perf_counter() - began)
    return took, codes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--scenario", default="ecc-uncorrectable")
    args = parser.parse_args()
    scenario = f"--nvml.scenario={args.scenario}"
    with running_cli("--sim", scenario, ready="/readyz", stderr=subprocess.DEVNULL) as (url, _):
        time.sleep(8)  # the scenario's faults (t=5 s) are in the verdicts
        print(f"scenario {args.scenario}, {args.runs} runs each, a fresh process per run")
        for condition in ("hardware", "nvlink", "thermal", "driver"):
            took, codes = timed([sys.executable, "-m", "gpuwarden", "npd-plugin", "--condition", condition,
                                 "--exporter-url", url, "--state-dir", "/tmp/gw-bench-npd"], args.runs)  # fmt: skip
            print(f"npd-plugin --condition {condition:8s} median {statistics.median(took):.3f} s, "
                  f"slowest {max(took):.3f} s, exit codes {sorted(codes)}")  # fmt: skip
        took, codes = timed([sys.executable, "-m", "gpuwarden", "npd-plugin", "--condition", "hardware",
                             "--exporter-url", f"http://127.0.0.1:{free_port()}"], args.runs)  # fmt: skip
        print(f"npd-plugin, exporter down      median {statistics.median(took):.3f} s, slowest {max(took):.3f} s, "
              f"exit codes {sorted(codes)}")  # fmt: skip
        if shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0:
            took, codes = timed([sys.executable, "-m", "gpuwarden", "slurm-healthcheck", "--dry-run", "--exporter-url",
                                 url, "--state-dir", "/tmp/gpuwarden-bench-slurm"], args.runs)  # fmt: skip
            print(f"slurm-healthcheck --dry-run    median {statistics.median(took):.3f} s, "
                  f"slowest {max(took):.3f} s, exit codes {sorted(codes)}")  # fmt: skip
        else:
            print("slurm-healthcheck: skipped (no sinfo or no slurmctld answering here)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
