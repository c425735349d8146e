"""Remediation: what the systems that act (node-problem-detector, Slurm) hear from the exporter's verdicts."""
