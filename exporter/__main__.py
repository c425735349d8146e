"""`python -m exporter` runs the same entry point as the `gpuwarden` console script."""

from exporter.cli import main

raise SystemExit(main())
