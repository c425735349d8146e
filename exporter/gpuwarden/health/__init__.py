"""Health: thresholds defined once, the exporter's verdicts per GPU and check, and the alert rules derived from them."""
