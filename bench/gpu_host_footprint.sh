#!/bin/bash
# The footprint runs on a lent GPU host, in one call: import costs as installed; the start-up race (10 interleaved
# starts of each exporter, as installed then from bytecode); gpuwarden and nvitop-exporter side by side (as
# installed, then from bytecode); import costs and the start-up profile from bytecode.
#   bash bench/gpu_host_footprint.sh OUTDIR      (the wheels of both exporters in .whl/, see docs/benchmarks.md)
set -u
out=${1:?OUTDIR}
# a clean start even on a machine kept warm from an earlier call: no packages or bytecode left from it
rm -rf /tmp/site; find "$PWD/exporter" "$PWD/build" -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null
. bench/source_env.sh /tmp/site   # gpuwarden importable from this checkout, dependencies from .whl/
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/host.txt"
python3 --version >> "$out/host.txt"
env | grep -i "^PYTHON" >> "$out/host.txt"
python3 -m bench.import_costs "$out/import_costs_as_installed.json" > /dev/null
python3 -m bench.startup_variants "$out/startup_race.json" 10 > /dev/null
find /tmp/site "$PWD/exporter" -name __pycache__ -type d -prune -exec rm -rf {} +   # as installed again
python3 -m bench.side_by_side "$out/side_by_side.json"
python3 -m bench.import_costs "$out/import_costs_bytecode.json"
python3 -m bench.startup_profile /tmp/startup > /dev/null 2>&1 || echo "startup profile failed"
cp /tmp/startup/startup.json "$out/startup.json"; cp /tmp/startup/importtime.stderr "$out/importtime.txt"
