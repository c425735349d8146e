#!/usr/bin/env bash
# Issue 37 on a GPU host: the straggler injections or the diagnosis suite (bench/straggler_suite.py) with gpuwarden
# watching; with HOST_READINGS=1 first the host's own readings (nvidia-smi -q, topology, the kernel log) and one
# exporter's answers beside them (issue 39's comparison). A Prometheus .deb in .debs/ (carried) is unpacked for
# `--nodes 2`. Usage (repository root):
#   bench/gpu_host_jobs.sh OUTDIR stragglers|suite RUNS [straggler_suite.py arguments...]
set -uo pipefail
out=${1:?usage: $0 OUTDIR MODE RUNS [ARGS...]}; mode=${2:?MODE}; runs=${3:?RUNS}; shift 3
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv > "$out/gpus.csv"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" > "$out/torch.txt" 2>&1
date -u +%FT%TZ > "$out/started.txt"
if [ "${HOST_READINGS:-0}" = 1 ]; then
  nvidia-smi -q > "$out/nvidia-smi-q.txt" 2>&1
  nvidia-smi -q -x > "$out/nvidia-smi-q.xml" 2>&1
  nvidia-smi topo -m > "$out/topo.txt" 2>&1
  nvidia-smi nvlink -s > "$out/nvlink-s.txt" 2>&1
  uname -a > "$out/uname.txt"; cat /proc/driver/nvidia/version >> "$out/uname.txt" 2>&1
  ls -la /dev/kmsg >> "$out/uname.txt" 2>&1
  timeout 3 cat /dev/kmsg > "$out/kmsg.txt" 2>&1   # the kernel log as a reader of /dev/kmsg gets it
  dmesg > "$out/dmesg.txt" 2>&1
  python3 -m gpuwarden --web.listen-address 127.0.0.1:10050 > "$out/readings-exporter.log" 2>&1 &
  reader=$!
  for _ in $(seq 60); do curl -sf -o "$out/api-gpus.json" http://127.0.0.1:10050/api/v1/gpus && break; sleep 0.5; done
  sleep 3
  curl -sf -o "$out/metrics.txt" http://127.0.0.1:10050/metrics
  curl -sf -o "$out/api-gpus.json" http://127.0.0.1:10050/api/v1/gpus
  kill "$reader"; wait "$reader"
fi
prometheus=()
if ls .debs/prometheus_*.deb > /dev/null 2>&1; then
  dpkg -x .debs/prometheus_*.deb /tmp/prom && prometheus=(--prometheus /tmp/prom/usr/bin/prometheus)
fi
timeout "${SUITE_TIMEOUT:-570}" python3 bench/straggler_suite.py "$mode" --out "$out/run" --runs "$runs" \
  "${prometheus[@]}" "$@" 2>&1 | tee "$out/suite.log"
[ -n "${OUT:-}" ] && tar czf "$OUT/$(basename "$out").tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit 0
