#!/usr/bin/env bash
# The composition root on real GPUs: the exporter serves while a 2-rank DDP job (bench/workloads/train.py) runs; a
# SIGHUP mid-job lengthens every health window; /metrics and /readyz are sampled throughout, and `gpuwarden validate`
# compares the readings with nvidia-smi. Usage (GPU host, repository root, .whl/ present): bench/gpu_host_reload.sh OUT
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
. bench/source_env.sh /tmp/gw-site
nvidia-smi --query-gpu=index,name,driver_version --format=csv > "$out/host.txt"; date -u >> "$out/host.txt"
printf "bottleneck_window_s: 20\n" > /tmp/t1.yaml
cat > /tmp/gw.yaml <<'Y'
health: {thresholds_file: /tmp/t1.yaml}
Y
python3 -m gpuwarden --config /tmp/gw.yaml --web.listen-address 127.0.0.1:10045 > "$out/exporter.log" 2>&1 &
pid=$!
until curl -sf localhost:10045/readyz >/dev/null; do sleep 0.1; kill -0 $pid || exit 1; done
python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/workloads/train.py --seconds 70 \
  > "$out/train.log" 2>&1 &
job=$!
ok=0; bad=0
for i in $(seq 1 80); do
  [ "$i" = 30 ] && { printf 'bottleneck_window_s: 2400\nutilization_for_s: 2400\n' > /tmp/t1.yaml; kill -HUP $pid; }
  if curl -sf localhost:10045/metrics -o /dev/null && curl -sf localhost:10045/readyz -o /dev/null; then ok=$((ok+1)); else bad=$((bad+1)); fi
  sleep 1
done
wait $job; echo "train_rc=$?" >> "$out/host.txt"
echo "scrapes_ok=$ok scrapes_failed=$bad exporter_alive=$(kill -0 $pid && echo yes)" >> "$out/host.txt"
curl -s localhost:10045/metrics > "$out/metrics.txt"
curl -s localhost:10045/api/v1/health > "$out/health.json"
kill $pid; wait $pid
python3 -m gpuwarden validate --out "$out/validate.md" > /dev/null 2>&1; echo "validate_rc=$?" >> "$out/host.txt"
grep -c "reload" "$out/exporter.log" >> "$out/host.txt"; grep -i "reload\|error\|Traceback" "$out/exporter.log" | head -20 >> "$out/host.txt"
