# Source this from the repository root on a GPU host: makes the checkout importable as `gpuwarden` without
# installing it (the folder is exporter/, the import name gpuwarden), with the dependencies from .whl/ if present.
#   . bench/source_env.sh [SITE_DIR]
gw_site=${1:-/tmp/gw-site}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$gw_site" .whl/*.whl
fi
mkdir -p /tmp/gw-src && ln -sfn "$PWD/exporter" /tmp/gw-src/gpuwarden
export PYTHONPATH="$gw_site:/tmp/gw-src:$PWD"
