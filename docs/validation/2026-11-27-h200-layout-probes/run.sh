set -uo pipefail
out=$OUT; . bench/source_env.sh /tmp/gw-site
nvidia-smi --query-gpu=index,name,driver_version --format=csv > $out/host.txt; date -u >> $out/host.txt
python3 -m gpuwarden --web.listen-address 127.0.0.1:10045 --web.probe-listen-address 127.0.0.1:10047 > $out/exporter.log 2>&1 &
pid=$!
for i in $(seq 200); do curl -sf localhost:10047/readyz >/dev/null && break; sleep 0.1; done
python3 - <<'P' > $out/load.txt 2>&1 &
try:
    import torch, time
    a=torch.randn(8192,8192,device="cuda",dtype=torch.bfloat16); t=time.time()
    while time.time()-t<15: (a@a).sum().item()
    print("matmul load done")
except Exception as e: print("no load:", e)
P
sleep 20
curl -s localhost:10045/metrics > $out/metrics.txt
curl -s localhost:10047/healthz > $out/probe_healthz.txt; curl -s localhost:10047/readyz >> $out/probe_healthz.txt
ps -eo pid,rss,args | grep -i "gpm_child" | grep -v grep > $out/gpm_child_ps.txt
for p in $(pgrep -f "gpuwarden"); do grep -E "^Pss:" /proc/$p/smaps_rollup | sed "s/^/$p /"; done > $out/pss.txt
kill -INT $pid; wait $pid; echo "exit $?" >> $out/host.txt
grep -E "^gpuwarden_(gpm_|sm_active|gpu_up|gpus )" $out/metrics.txt | head -40 > $out/gpm_lines.txt
grep -c Traceback $out/exporter.log >> $out/host.txt
