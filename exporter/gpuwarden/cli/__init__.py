"""Entry points and process wiring: the exporter's command line, `gpuwarden validate`, logging."""
