#!/bin/bash
# One 2-GPU device call for issue 34's GPU-host figures: the process tree's memory when node-problem-detector asks
# /api/v1/health and nobody uses the JSON API (bench/health_rss.py --real), then the real-workload soak
# (bench/gpm_soak.py: NCCL DDP bf16/FP32, killed and slow ranks, memory fill) with GPM's owner thread, counting
# scrapes with a stale GPU.
#   bash bench/gpu_host_safety.sh OUTDIR [SOAK_SECONDS]
set -u
out=${1:?OUTDIR}; soak=${2:-240}
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv > "$out/host.txt" 2>&1
date -u >> "$out/host.txt"; python3 --version >> "$out/host.txt"
python3 bench/health_rss.py "$out/health-rss.json" --real > "$out/health-rss.log" 2>&1
echo "health-rss exit: $?" | tee -a "$out/host.txt"; tail -20 "$out/health-rss.log"
timeout $((soak + 120)) python3 bench/gpm_soak.py --seconds "$soak" --out "$out/soak" > "$out/soak.log" 2>&1
echo "soak exit: $?" | tee -a "$out/host.txt"; tail -5 "$out/soak.log"
python3 -c "import json; d=json.load(open('$out/soak/summary.json')); print({k: d[k] for k in ('passed','scrapes','scrape_failures','readyz_failures','scrapes_with_a_stale_gpu','longest_gpm_gap_s','gpm_sampler_lines')})"
