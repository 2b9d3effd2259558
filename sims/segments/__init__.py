"""Segment benchmarks: tail throughput, conditional appends, durable attribute updates (run.py)."""
