#!/usr/bin/env bash
# /metrics throughput of two checkouts of gpuwarden, in turn, in the same run: wrk -t2 -c50 on loopback against
# the simulator, snapshot held still (30 s polls) so that every request is served from the render cache.
# usage: bench/throughput_side_by_side.sh BEFORE_DIR AFTER_DIR [PAIRS] [SECONDS]
# Prints req/s per run and the median after/before ratio. Needs wrk (Debian: apt install wrk).
set -euo pipefail
before=$1 after=$2 pairs=${3:-10} seconds=${4:-8}
run() {  # dir port -> req/s
  local dir=$1 port=$2 pid path mod
  if [ -d "$dir/exporter/gpuwarden" ]; then  # exporter/ is the package root
    path=$dir/exporter; mod=gpuwarden
  elif grep -q '"gpuwarden" = "exporter"' "$dir/pyproject.toml"; then  # the folder exporter/ imports as gpuwarden
    path=$(mktemp -d); ln -s "$dir/exporter" "$path/gpuwarden"; mod=gpuwarden
  else  # a checkout from before the rename imports as exporter
    path=$dir; mod=exporter
  fi
  (cd "$path" && PYTHONPATH="$path" exec python -m "$mod" --sim --web.listen-address "127.0.0.1:$port" \
     --poll.fast-interval 30 --poll.slow-interval 30 >/dev/null 2>&1) &
  pid=$!
  for _ in $(seq 100); do curl -sf "127.0.0.1:$port/metrics" >/dev/null && break; sleep 0.1; done
  rps=$(wrk -t2 -c50 -d"${seconds}s" "http://127.0.0.1:$port/metrics" | awk '/Requests\/sec/ {print $2}')
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$rps"
}
ratios=()
for i in $(seq "$pairs"); do
  b=$(run "$before" 19201); a=$(run "$after" 19202)
  r=$(python3 -c "print(f'{$a / $b:.3f}')")
  ratios+=("$r")
  echo "pair $i: before $b req/s, after $a req/s, ratio $r"
done
printf '%s\n' "${ratios[@]}" | sort -n | python3 -c "
import statistics, sys
values = [float(line) for line in sys.stdin]
print(f'median ratio {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f}) over {len(values)} pairs')"
