# Source this from the repository root on a GPU host: makes the checkout importable as `gpuwarden` without
# installing it (exporter/ is the package root: exporter/gpuwarden/), with the dependencies from .whl/ if present.
#   . bench/source_env.sh [SITE_DIR]
gw_site=${1:-/tmp/gw-site}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$gw_site" .whl/*.whl
fi
export PYTHONPATH="$gw_site:$PWD/exporter:$PWD"
