"""Benchmarks: drivers, baselines and reports."""
