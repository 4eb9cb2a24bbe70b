"""Benchmark scripts (`python -m specjax.bench ...`): figures are printed, never asserted."""
