"""A policy's life after training: loading it (loader), scoring replies under it (logprobs), the eval
gate (gate, with its held-out turns in holdout), the MLflow registry and lineage of its versions
(registry, lineage), and telling the gateway to serve a version (reload)."""
