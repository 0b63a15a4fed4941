"""A real S3-compatible server for tests: moto's standalone server (PyPI `moto[server]`) as a
subprocess on a free port. Not a mock inside the process: clawflow talks to it over HTTP with
s3fs/botocore exactly as it would to S3 or MinIO, and MLflow's server can keep artifacts on it."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

# moto accepts any credentials; botocore (ours, MLflow's) refuses to sign without some
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_buckets = itertools.count()


@contextlib.contextmanager
def moto_server(log: Path, port: int | None = None):
    """`moto_server` on 127.0.0.1:`port` (a free one by default); yields its endpoint URL."""
    port = port or free_port()
    exe = Path(sys.executable).with_name("moto_server")
    out = open(log, "ab")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **AWS_ENV}, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    try:
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
        out.close()


def make_bucket(endpoint: str, name: str | None = None) -> str:
    """A new bucket on `endpoint`; its name."""
    import s3fs

    name = name or f"clawflow-{os.getpid()}-{next(_buckets)}"
    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(name)
    return name


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server for the session, its credentials in this process's environment."""
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    try:
        with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as url:
            yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_store(s3_endpoint):
    """`store` config section values for a fresh bucket: (root URL, storage_options)."""
    return f"s3://{make_bucket(s3_endpoint)}/clawflow", {"endpoint_url": s3_endpoint}
