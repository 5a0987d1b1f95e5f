"""Benchmarks: router overhead now; trace-driven load and comparisons build on it."""
