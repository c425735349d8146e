#!/usr/bin/env bash
# One device call's worth of real-GPU work: validation against nvidia-smi, poll cost, utilization accuracy.
# Usage (GPU host, repository root): bench/gpu_host_run.sh OUTDIR [GPU-for-utilization]
set -uo pipefail
out=${1:?usage: $0 OUTDIR}; gpu=${2:-0}
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site   # gpuwarden importable from this checkout, dependencies from .whl/
export PYTHONUNBUFFERED=1
nvidia-smi topo -m > "$out/nvidia-smi-topo.txt" 2>&1
python3 -m gpuwarden validate --out "$out/validation.md" --json "$out/validation.json" > "$out/validate.log" 2>&1
echo "validate exit: $?" | tee -a "$out/summary.txt"
grep -E "comparisons|NO" "$out/validation.md" | head -20 | tee -a "$out/summary.txt"
python3 -m bench.poll_cost --json "$out/poll_cost.json" --md "$out/poll_cost.md" --cpu-seconds "${CPU_SECONDS:-60}" \
  > "$out/poll_cost.log" 2>&1; echo "poll_cost exit: $?" | tee -a "$out/summary.txt"
cat "$out/poll_cost.md" >> "$out/summary.txt"
if [ "${SKIP_UTIL:-0}" != 1 ]; then
  python3 -m bench.util_accuracy --gpu "$gpu" --json "$out/util.json" --md "$out/util.md" > "$out/util.log" 2>&1
  echo "util exit: $?" | tee -a "$out/summary.txt"
  cat "$out/util.md" >> "$out/summary.txt"
fi
cat "$out/summary.txt"
[ -n "${OUT:-}" ] && tar czf "$OUT/$(basename "$out").tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit 0
