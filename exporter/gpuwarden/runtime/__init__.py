"""The composition root: the collection pipeline (pipeline.py) and the exporter process around it (service.py)."""
