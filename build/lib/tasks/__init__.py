"""Prefect tasks: thin wrappers over `clawflow` with retries, names and logging."""
