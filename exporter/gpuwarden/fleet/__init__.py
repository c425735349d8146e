"""`gpuwarden fleet`: a fleet view of every GPU, computed by Prometheus from gpuwarden's series.

Data path: Prometheus HTTP API (prometheus.py) → aggregated queries per endpoint (views.py; the planner is
planner.py) → FastAPI JSON and a server-rendered page (app.py). Nothing is collected again.
"""
