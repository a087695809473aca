"""Unserved kernels kept for their measurements (docs/perf-log): nothing served imports them."""
