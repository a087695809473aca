"""Ops tools: capacity planner, benchmarks, validation runs."""
