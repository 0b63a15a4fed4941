"""Trajectory store: write-ahead segments, Parquet shards, the DuckDB catalog."""
