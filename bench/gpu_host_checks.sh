#!/bin/bash
# One 2-GPU device call: the reads added for DRA (minor number) checked against the driver's own device files and
# nvidia-smi, then the real-workload soak (bench/gpm_soak.py: NCCL DDP bf16/FP32, killed and slow ranks, memory
# fill) with the exporter at its defaults, then the footprint (bench/gpu_host_footprint.sh) if time is left.
#   bash bench/gpu_host_checks.sh OUTDIR [SOAK_SECONDS]
set -u
out=${1:?OUTDIR}; soak=${2:-240}
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,uuid,pci.bus_id --format=csv > "$out/host.txt" 2>&1
nvidia-smi -q | grep -E "^GPU |Minor Number" >> "$out/host.txt"
ls -l /dev/nvidia[0-9]* >> "$out/host.txt" 2>&1
python3 -X faulthandler -m gpuwarden --web.listen-address 127.0.0.1:10046 > "$out/minor-exporter.log" 2>&1 &
pid=$!
for _ in $(seq 50); do curl -sf 127.0.0.1:10046/readyz > /dev/null && break; sleep 0.2; done
curl -s 127.0.0.1:10046/api/v1/gpus > "$out/api-gpus.json"
curl -s 127.0.0.1:10046/metrics > "$out/metrics.txt"
kill -INT $pid; wait $pid; echo "minor-check exporter exit: $?" >> "$out/host.txt"
python3 - "$out" <<'PY' | tee "$out/minor-check.txt"
import json, re, subprocess, sys
out = sys.argv[1]
smi = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True).stdout
pairs = re.findall(r"GPU UUID\s+:\s+(\S+).*?Minor Number\s+:\s+(\d+)", smi, re.S)
api = json.load(open(f"{out}/api-gpus.json"))
gpus = api.get("gpus", api) if isinstance(api, dict) else api
def find(node, key):
    if isinstance(node, dict):
        if key in node:
            return node[key]
        for value in node.values():
            got = find(value, key)
            if got is not None:
                return got
    return None
ours = {find(g, "uuid"): find(g, "minor_number") for g in gpus}
for uuid, minor in pairs:
    print(uuid, "nvidia-smi minor", minor, "gpuwarden", ours.get(uuid), "OK" if ours.get(uuid) == int(minor) else "DIFFERS")
PY
timeout $((soak + 120)) python3 bench/gpm_soak.py --seconds "$soak" --out "$out/soak" > "$out/soak.log" 2>&1
echo "soak exit: $?" | tee -a "$out/host.txt"; tail -30 "$out/soak.log"
if [ "${FOOTPRINT:-1}" = 1 ]; then
  mkdir -p "$out/footprint"; timeout 200 bash bench/gpu_host_footprint.sh "$out/footprint" > "$out/footprint.log" 2>&1
  echo "footprint exit: $?" | tee -a "$out/host.txt"
fi
