#!/usr/bin/env bash
# The demo without containers: five simulated nodes, Prometheus with the shipped rules, the fleet service, and
# Grafana with both dashboards where grafana-server is installed. Ctrl-C stops everything.
#   deploy/demo/run-local.sh          (from anywhere; needs gpuwarden installed, prometheus on PATH)
# Ports: BASE_PORT (10045-10049, the nodes), PROM_PORT (9090), FLEET_PORT (10050), GRAFANA_PORT (3000).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE_PORT=${BASE_PORT:-10045} PROM_PORT=${PROM_PORT:-9090} FLEET_PORT=${FLEET_PORT:-10050}
GRAFANA_PORT=${GRAFANA_PORT:-3000}
GPUWARDEN=${GPUWARDEN:-gpuwarden}
command -v "$GPUWARDEN" >/dev/null || { echo "run-local.sh: $GPUWARDEN not found; pip install . first" >&2; exit 2; }
command -v prometheus >/dev/null || { echo "run-local.sh: prometheus not found on PATH" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpuwarden-demo.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"' EXIT INT TERM

scenarios=(training thermal-throttling nvlink-down shared-gpu data-starvation)
targets=""
for i in "${!scenarios[@]}"; do
  port=$((BASE_PORT + i))
  groups=()
  [ "${scenarios[$i]}" = data-starvation ] && groups=(--metrics.enable-groups=all)
  "$GPUWARDEN" --sim --nvml.scenario="${scenarios[$i]}" --no-pods.attribution \
    --web.listen-address="127.0.0.1:$port" "${groups[@]}" >"$WORK/node-$port.log" 2>&1 &
  targets="$targets\"127.0.0.1:$port\","
done

mkdir -p "$WORK/rules"
cp "$ROOT/alert_rules/gpuwarden.rules.yaml" "$WORK/rules/"
# the demo's Prometheus configuration with the local nodes as targets
awk -v t="[${targets%,}]" '
  /- targets:/ { print "      - targets: " t; skip = 1; next }
  skip && /^          - / { next }
  { skip = 0; print }' "$ROOT/deploy/demo/prometheus.yml" >"$WORK/prometheus.yml"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
"$GPUWARDEN" fleet --prometheus-url="http://127.0.0.1:$PROM_PORT" \
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
