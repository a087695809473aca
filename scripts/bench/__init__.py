"""Benchmarks; each writes JSON to bench/results/."""
