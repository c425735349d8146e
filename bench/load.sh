#!/usr/bin/env bash
# Load: 200 connections for 60 s each against /metrics (text, OpenMetrics) and the JSON API, simulated 8x H100.
# Usage: bench/load.sh [seconds]   (Debian's wrk; loopback only). Prints latency percentiles and any errors.
set -euo pipefail
secs=${1:-60}
port=10052
python3 -m gpuwarden --sim --nvml.scenario nvlink-down --web.listen-address 127.0.0.1:$port >/tmp/gw-load.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
until curl -sf localhost:$port/readyz >/dev/null; do sleep 0.05; done
sleep 3
run() {
  echo "--- $1"
  shift
  wrk -t2 -c200 -d${secs}s --latency "$@" | grep -E "Latency|50%|90%|99%|Requests/sec|Non-2xx|Socket errors|requests in"
}
run "/metrics text" http://127.0.0.1:$port/metrics
run "/metrics OpenMetrics" -H 'Accept: application/openmetrics-text; version=1.0.0' http://127.0.0.1:$port/metrics
run "/api/v1/gpus" http://127.0.0.1:$port/api/v1/gpus
run "/api/v1/gpus/3" http://127.0.0.1:$port/api/v1/gpus/3
echo "--- after: readyz $(curl -s -o /dev/null -w '%{http_code}' localhost:$port/readyz), tracebacks $(grep -c Traceback /tmp/gw-load.log || true), RSS $(awk '/VmRSS/{print $2}' /proc/$pid/status) kB"
