"""Prefect flows, one file per deployment."""
