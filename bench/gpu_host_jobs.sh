#!/usr/bin/env bash
# Issue 37 on a GPU host: record what torchrun and mp.spawn leave in /proc (tests/data/proc), then the straggler
# suite (bench/straggler_suite.py) with gpuwarden watching. Usage (repository root): bench/gpu_host_jobs.sh OUTDIR GPUS [RUNS]
set -uo pipefail
out=${1:?usage: $0 OUTDIR GPUS [RUNS]}; gpus=${2:-2}; runs=${3:-cpu:1,cpu:0,input:1,gpu:0,hang:1,balanced:}
mkdir -p "$out/proc"
. bench/source_env.sh /tmp/gw-site
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$out/gpus.csv"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" > "$out/torch.txt" 2>&1
if [ "${RECORD:-1}" = 1 ]; then
timeout 60 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/record_proc.py "$out/proc/torchrun-standalone" > "$out/proc/torchrun-standalone.log" 2>&1
timeout 60 python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29411 \
  --rdzv-id llama7b-ft bench/record_proc.py "$out/proc/torchrun-c10d" > "$out/proc/torchrun-c10d.log" 2>&1
timeout 60 python3 bench/record_proc.py "$out/proc/mp-spawn" --spawn 2 > "$out/proc/mp-spawn.log" 2>&1
fi
timeout "${SUITE_TIMEOUT:-3600}" python3 bench/straggler_suite.py --gpus "$gpus" --out "$out/suite" --runs "$runs" ${SUITE_ARGS:-} 2>&1 | tee "$out/suite.log"
[ -n "${OUT:-}" ] && tar czf "$OUT/$(basename "$out").tgz" -C "$(dirname "$out")" "$(basename "$out")"
exit 0
