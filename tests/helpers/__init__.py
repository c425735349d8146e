"""Modules the tests (and benchmarks) share; no test lives here."""
