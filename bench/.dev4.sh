set -u
out=$1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $out/host.txt
python3 bench/rss_variants.py $out/rss_variants.json 2
python3 bench/startup_variants.py $out/startup_variants.json 7 > /dev/null
python3 bench/startup_profile.py /tmp/startup > /dev/null 2>&1; cp /tmp/startup/startup.json $out/startup.json
