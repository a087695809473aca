"""Explorations and sweeps: variants, probes and tuning runs behind docs/perf-log (GPU only);
the served step is benchmarked by scripts/bench/."""
