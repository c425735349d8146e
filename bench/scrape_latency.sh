#!/usr/bin/env bash
# /metrics latency under 1 and 32 concurrent clients (wrk) on a simulated 8x H100 node with every series.
# Usage: bench/scrape_latency.sh [seconds-per-run]   (needs Debian's wrk; runs on loopback only)
set -euo pipefail
secs=${1:-20}
port=10049
python3 -m gpuwarden --sim --nvml.scenario nvlink-down --metrics.enable-groups all --web.listen-address 127.0.0.1:$port >/tmp/gw-wrk.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
until curl -sf localhost:$port/readyz >/dev/null; do sleep 0.05; done
sleep 3      # the first slow poll (NVLink per link) is in
series=$(curl -s localhost:$port/metrics | grep -vc '^#')
bytes=$(curl -s localhost:$port/metrics | wc -c)
echo "series: $series, bytes: $bytes, $(nproc) CPUs, $(python3 --version)"
for conns in 1 32; do
  threads=$(( conns < 2 ? 1 : 2 ))
  echo "--- text format, $conns connection(s)"
  wrk -t$threads -c$conns -d${secs}s --latency http://127.0.0.1:$port/metrics | grep -E "Latency|50%|90%|99%|Requests/sec|Non-2xx|errors"
done
echo "--- OpenMetrics, 32 connections"
wrk -t2 -c32 -d${secs}s --latency -H 'Accept: application/openmetrics-text; version=1.0.0' \
  http://127.0.0.1:$port/metrics | grep -E "Latency|50%|90%|99%|Requests/sec|Non-2xx|errors"
echo "--- gzip, 32 connections"
wrk -t2 -c32 -d${secs}s --latency -H 'Accept-Encoding: gzip' \
  http://127.0.0.1:$port/metrics | grep -E "Latency|50%|90%|99%|Requests/sec|Non-2xx|errors"
