#!/usr/bin/env bash
# Issue 49, acceptance 4, on a lent nvidia-h200 (one GPU): single-GPU jobs under an exporter run as the Helm chart runs
# it (UID 10045, every capability dropped, no new privileges, the host's /proc), each job's class and advice recorded
# (bench/diagnosis_gpu.py): a pageable and a pinned device-to-host copy loop, a training job with a second process
# computing on its GPU, a tiny-batch decode loop. Writes $OUT/diagnosis-gpu.{json,md} and the exporter's logs.
# Usage (repository root, as root: the jobs run as root, another user than the exporter):
#   bench/diagnosis_gpu.sh [--sim] [diagnosis_gpu.py arguments...]
#   --sim: a dry run over simulator stand-ins (no GPU, no PyTorch), e.g. on the build machine
set -uo pipefail
out=${OUT:-/tmp/diagnosis-gpu}
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site
chmod -R a+rX /tmp/gw-site "$PWD" 2>/dev/null  # the unprivileged exporter reads the checkout and its site
thresholds=/tmp/gw-diagnosis-thresholds.yaml
printf 'bottleneck_window_s: 20\n' > "$thresholds" && chmod 644 "$thresholds"  # 20 s windows: a case in a minute
if [ "${1:-}" != --sim ]; then
  nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv > "$out/gpus.csv"
  python3 -c "import torch; print('torch', torch.__version__)" > "$out/torch.txt" 2>&1
fi
# AS: how the exporter is started (default: as the chart runs it); AS= runs it as the caller (where the interpreter
# is not readable by UID 10045, e.g. a build machine whose Python lives under a 0700 /root)
as=${AS-setpriv --reuid=10045 --regid=10045 --clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs}
exporter="$as env PYTHONPATH=$PYTHONPATH $(command -v python3) -m gpuwarden --web.listen-address 127.0.0.1:10051 \
--processes.proc-root /proc --health.thresholds-file $thresholds"
python3 bench/diagnosis_gpu.py --out "$out" --exporter "$exporter" "$@"
status=$?
date -u +%FT%TZ > "$out/finished.txt"
exit $status
