"""Measurements kept with the code they measure (bench/README.md lists them): each script runs from the repository
root as `python -m bench.NAME`, so it imports gpuwarden, the other scripts and tests/helpers as packages."""
