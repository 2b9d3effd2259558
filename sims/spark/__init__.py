"""Spark benchmarks: the ``attrindex`` data source against Parquet (run.py), and a profile of the
per-task write path without Spark (profile_write.py)."""
