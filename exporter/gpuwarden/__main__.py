"""`python -m gpuwarden` runs the same entry point as the `gpuwarden` console script."""

from gpuwarden.cli.main import main

raise SystemExit(main())
