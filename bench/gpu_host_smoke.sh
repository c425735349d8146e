#!/usr/bin/env bash
# Run gpuwarden against the real GPUs of a host and keep what it served, next to nvidia-smi's view.
# Usage (on the GPU host, from the repository root): bench/gpu_host_smoke.sh OUTDIR
# Dependencies travel as wheels in .whl/ (downloaded beforehand on a machine with package access). A 6 s matmul load runs on GPU 0
# in the middle of the window (PyTorch, if installed) so utilization, power and clocks visibly respond.
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site   # gpuwarden importable from this checkout, dependencies from .whl/
export PYTHONUNBUFFERED=1
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,uuid,driver_version,pci.bus_id --format=csv
  python3 --version; python3 -c 'import pynvml, importlib.metadata as m; print("nvidia-ml-py", m.version("nvidia-ml-py"))'
} > "$out/host.txt" 2>&1
nvidia-smi topo -m > "$out/nvidia-smi-topo.txt" 2>&1
nvidia-smi -q -x > "$out/nvidia-smi-q.xml" 2>&1
nvidia-smi -q > "$out/nvidia-smi-q.txt" 2>&1
nvidia-smi nvlink -s > "$out/nvidia-smi-nvlink.txt" 2>&1

start=$(date +%s.%N)
python3 -m gpuwarden --web.listen-address 127.0.0.1:10045 --poll.fast-interval 1 --poll.slow-interval 5 \
  > "$out/exporter.log" 2>&1 &
pid=$!
until curl -sf localhost:10045/readyz >/dev/null; do
  sleep 0.05
  if ! kill -0 $pid 2>/dev/null; then echo "exporter died" >> "$out/host.txt"; break; fi
done
ready=$(date +%s.%N)
echo "time_to_ready_s: $(python3 -c "print(round($ready - $start, 3))")" >> "$out/host.txt"
curl -s localhost:10045/metrics > "$out/metrics-idle.txt"
sleep 4
python3 - <<'PY' >> "$out/host.txt" 2>&1 || true
import time, torch
x = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
end = time.time() + 6
n = 0
while time.time() < end:
    y = x @ x; n += 1
torch.cuda.synchronize()
print(f"load: {n} bf16 8192^3 matmuls on cuda:0 in 6 s")
PY
sleep 1
curl -s localhost:10045/metrics > "$out/metrics.txt"
curl -s localhost:10045/api/v1/topology > "$out/topology.json"
curl -s localhost:10045/api/v1/gpus > "$out/gpus.json"
curl -s -o /dev/null -w "readyz: %{http_code}\n" localhost:10045/readyz >> "$out/host.txt"
for i in 1 2 3 4 5; do curl -s -o /dev/null -w "scrape_s: %{time_total}\n" localhost:10045/metrics; done >> "$out/host.txt"
echo "rss_kib: $(awk '/VmRSS/{print $2}' /proc/$pid/status)" >> "$out/host.txt"
kill -TERM $pid; wait $pid; echo "exit_code: $?" >> "$out/host.txt"
grep -c Traceback "$out/exporter.log" | sed 's/^/tracebacks: /' >> "$out/host.txt"
cat "$out/host.txt"
[ -n "${OUT:-}" ] && tar czf "$OUT/$(basename "$out").tgz" -C "$(dirname "$out")" "$(basename "$out")"
