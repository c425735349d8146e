#!/usr/bin/env bash
# The demo without containers: five simulated nodes, Prometheus with the shipped rules, the fleet service, and
# Grafana with both dashboards where grafana-server is installed. Ctrl-C stops everything.
#   deploy/demo/run-local.sh          (from anywhere; needs gpuwarden installed, prometheus on PATH)
# Ports: BASE_PORT (10045-10049, the nodes), PROM_PORT (9090), FLEET_PORT (10050), GRAFANA_PORT (3000).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE_PORT=${BASE_PORT:-10045} PROM_PORT=${PROM_PORT:-9090} FLEET_PORT=${FLEET_PORT:-10050}
GRAFANA_PORT=${GRAFANA_PORT:-3000}
# gpuwarden on PATH, else the README quickstart's venv (.venv at the repository root)
if [ -z "${GPUWARDEN:-}" ]; then
  GPUWARDEN=gpuwarden
  command -v gpuwarden >/dev/null || [ ! -x "$ROOT/.venv/bin/gpuwarden" ] || GPUWARDEN="$ROOT/.venv/bin/gpuwarden"
fi
command -v "$GPUWARDEN" >/dev/null || {
  echo "run-local.sh: gpuwarden not found on PATH or in $ROOT/.venv; install it (README, Quickstart) or set GPUWARDEN" >&2
  exit 2
}
command -v prometheus >/dev/null || {
  echo "run-local.sh: prometheus not found on PATH (Debian: apt install prometheus)" >&2
  exit 2
}
# every port must be free: a busy one would be scraped (or served) by whatever holds it
for port in $(seq "$BASE_PORT" $((BASE_PORT + 4))) "$PROM_PORT" "$FLEET_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "run-local.sh: port $port is in use; choose others with BASE_PORT, PROM_PORT or FLEET_PORT" >&2
    exit 2
  fi
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpuwarden-demo.XXXXXX")
stop() {  # every child (killed outright after 10 s), then the data; the logs stay, for what went wrong
  trap - EXIT INT TERM
  local children
  children=$(jobs -p)
  if [ -n "$children" ]; then
    kill $children 2>/dev/null || true
    for _ in $(seq 50); do kill -0 $children 2>/dev/null || break; sleep 0.2; done
    kill -9 $children 2>/dev/null || true  # (set -e: a kill of what already ended must not end this function)
  fi
  wait 2>/dev/null || true
  rm -rf "$WORK/tsdb" "$WORK/rules" "$WORK/grafana"
  echo "stopped; logs kept in $WORK"
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

scenarios=(training thermal-throttling nvlink-down shared-gpu data-starvation)
nodes=(node-training node-thermal node-nvlink-down node-shared-gpu node-starved)  # as compose.yaml names them
static=""
for i in "${!scenarios[@]}"; do
  port=$((BASE_PORT + i))
  groups=()
  [ "${scenarios[$i]}" = data-starvation ] && groups=(--metrics.enable-groups=all)
  "$GPUWARDEN" --sim --nvml.scenario="${scenarios[$i]}" --no-pods.attribution \
    --web.listen-address="127.0.0.1:$port" "${groups[@]}" >"$WORK/node-$port.log" 2>&1 &
  static="$static      - targets: ['127.0.0.1:$port']
        labels: {node: ${nodes[$i]}}
"
done

mkdir -p "$WORK/rules"
cp "$ROOT/alert_rules/gpuwarden.rules.yaml" "$WORK/rules/"
# the demo's Prometheus configuration with the local nodes as targets, each its own `node` (all are 127.0.0.1)
cat >"$WORK/prometheus.yml" <<CONFIG
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - rules/gpuwarden.rules.yaml
scrape_configs:
  - job_name: gpuwarden
    static_configs:
$static
CONFIG
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
"$GPUWARDEN" fleet --prometheus-url="http://127.0.0.1:$PROM_PORT" --node-label=node \
  --web.listen-address="127.0.0.1:$FLEET_PORT" >"$WORK/fleet.log" 2>&1 &

if command -v grafana-server >/dev/null || command -v grafana >/dev/null; then
  mkdir -p "$WORK/grafana/provisioning/datasources" "$WORK/grafana/provisioning/dashboards" "$WORK/grafana/data"
  sed "s|http://prometheus:9090|http://127.0.0.1:$PROM_PORT|" \
    "$ROOT/deploy/demo/grafana/provisioning/datasources/prometheus.yaml" \
    >"$WORK/grafana/provisioning/datasources/prometheus.yaml"
  sed "s|/var/lib/grafana/dashboards|$ROOT/grafana_dashboards|" \
    "$ROOT/deploy/demo/grafana/provisioning/dashboards/gpuwarden.yaml" \
    >"$WORK/grafana/provisioning/dashboards/gpuwarden.yaml"
  export GF_PATHS_PROVISIONING="$WORK/grafana/provisioning" GF_PATHS_DATA="$WORK/grafana/data"
  export GF_SERVER_HTTP_PORT="$GRAFANA_PORT" GF_AUTH_ANONYMOUS_ENABLED=true GF_AUTH_ANONYMOUS_ORG_ROLE=Viewer
  if command -v grafana >/dev/null; then grafana server --homepath /usr/share/grafana >"$WORK/grafana.log" 2>&1 &
  else grafana-server --homepath /usr/share/grafana >"$WORK/grafana.log" 2>&1 &
  fi
  echo "Grafana:    http://127.0.0.1:$GRAFANA_PORT (folder gpuwarden)"
else
  echo "Grafana:    not installed here; import grafana_dashboards/*.json into yours (data source: Prometheus below)"
fi
echo "Prometheus: http://127.0.0.1:$PROM_PORT   fleet: http://127.0.0.1:$FLEET_PORT   nodes: :$BASE_PORT-$((BASE_PORT + 4))"
echo "logs in $WORK; Ctrl-C stops everything"
wait
