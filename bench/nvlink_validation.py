"""NVLink bytes on a 2-GPU host: device-to-device copies of a known size from GPU 0 to GPU 1, gpuwarden's
`gpuwarden_nvlink_bytes_total` rate over a window inside the load against an independent GPM read of the same
window (NVLINK_TOTAL_TX/RX_PER_SEC) and against the bytes copied, and the bottleneck class each GPU gets.

    python3 -m bench.nvlink_validation OUT.json      # on the GPU host (PyTorch there; our dependencies as wheels)
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from bench.gpm_validation import IndependentGpm, exporter

NVLINK_IDS = {"rx_mib_s": 60, "tx_mib_s": 61}  # NVML_GPM_METRIC_NVLINK_TOTAL_RX/TX_PER_SEC

PORT = 10085
WINDOW_S = 6.0
LOAD = """
import json, time, torch
src = torch.empty(1024**3, dtype=torch.uint8, device="cuda:0")
dst = torch.empty(1024**3, dtype=torch.uint8, device="cuda:1")
torch.cuda.synchronize("cuda:0"); torch.cuda.synchronize("cuda:1")
print("READY", flush=True)
copied, t0, end = 0, time.time(), time.time() + 14
while time.time() < end:
    dst.copy_(src)
    torch.cuda.synchronize("cuda:1")
    copied += src.numel()
seconds, p2p = time.time() - t0, torch.cuda.can_device_access_peer(0, 1)
print(json.dumps({"copied_bytes": copied, "seconds": seconds, "p2p": p2p}), flush=True)
"""


def scrape() -> dict[tuple[str, str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("gpuwarden_nvlink_bytes_total", "gpuwarden_gpm_window_seconds_total")):
            name, _, rest = line.partition("{")
            labels = dict(part.split("=", 1) for part in rest.rpartition("} ")[0].split(","))
            out[(name, labels["gpu"].strip('"'), labels.get("direction", "").strip('"'))] = float(
                line.rsplit(" ", 1)[1]
            )
    return out


def main() -> None:
    out = Path(sys.argv[1])
    thresholds = out.parent / "nvlink-thresholds.yaml"
    thresholds.write_text(f"bottleneck_window_s: {int(WINDOW_S)}\n")
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    host = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    proc = exporter("--poll.fast-interval", "1", "--health.thresholds-file", str(thresholds), port=PORT)
    result: dict = {"host": host, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "topo": topo}
    try:
        gpms = [IndependentGpm(0, NVLINK_IDS), IndependentGpm(1, NVLINK_IDS)]
        load = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOAD)], stdout=subprocess.PIPE, text=True)
        assert load.stdout is not None
        while load.stdout.readline().strip() != "READY":
            if load.poll() is not None:
                raise RuntimeError("the copy load died before it started")
        time.sleep(2.0)
        before = scrape()
        for gpm in gpms:
            gpm.start()
        time.sleep(WINDOW_S)
        independent = [gpm.stop() for gpm in gpms]
        after = scrape()
        classes = [
            json.loads(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/api/v1/gpus/{i}", timeout=5).read())["health"]
            .get("bottleneck", {})
            .get("observed")
            for i in (0, 1)
        ]
        copy = json.loads([line for line in load.communicate(timeout=60)[0].splitlines() if line.startswith("{")][-1])
        payload = copy["copied_bytes"] / copy["seconds"]
        rows = {}
        for gpu, direction in (("0", "tx"), ("1", "rx"), ("0", "rx"), ("1", "tx")):
            window = (
                after[("gpuwarden_gpm_window_seconds_total", gpu, "")]
                - before[("gpuwarden_gpm_window_seconds_total", gpu, "")]
            )
            ours = (
                after[("gpuwarden_nvlink_bytes_total", gpu, direction)]
                - before[("gpuwarden_nvlink_bytes_total", gpu, direction)]
            ) / window
            theirs = independent[int(gpu)][f"{direction}_mib_s"] * 1024 * 1024
            rows[f"gpu{gpu}_{direction}"] = {
                "exporter_bytes_per_s": round(ours),
                "independent_gpm_bytes_per_s": round(theirs),
                "exporter_vs_independent_pct": None if theirs == 0 else round(100 * (ours - theirs) / theirs, 2),
            }
        result.update({"copy": copy, "payload_bytes_per_s": round(payload), "rates": rows, "classes": classes})
    finally:
        proc.terminate()
        proc.wait(10)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "topo"}, indent=1))
    print(topo)


if __name__ == "__main__":
    main()
