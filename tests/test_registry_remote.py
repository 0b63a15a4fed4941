"""Checkpoints through a real MLflow tracking server (lite `mlflow server`, SQLite + a proxied
artifact store): the experiment's artifact location is the server's; a trainer host registers a
checkpoint and deletes it; a gateway host with another CLAWFLOW_HOME fetches, verifies, caches and
serves it; a checkpoint altered in the artifact store is refused and the old weights keep serving."""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from _mlflow_server import mlflow_server as mlflow_server_process
from conftest import admin, policy_version, running_gateway
from safetensors.torch import load_file, save_file

from clawflow import artifacts
from clawflow.policy import registry, reload

_names = itertools.count()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    with mlflow_server_process(root, (root / "artifacts").as_uri()) as url:
        yield url, root / "artifacts"


@pytest.fixture
def hosts(make_config, mlflow_server, tmp_path):
    """(trainer cfg, gateway cfg): same tracking server and model name, separate CLAWFLOW_HOMEs."""
    url, store = mlflow_server
    cfg = make_config(registry={"tracking_uri": url, "experiment": f"remote-{next(_names)}", "cache_versions": 2})
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": f"remote-m{next(_names)}"})})
    trainer = cfg.model_copy(update={"home": tmp_path / "trainer-home"})
    gateway = cfg.model_copy(update={"home": tmp_path / "gateway-home"})
    return trainer, gateway, store


def register(cfg, src: Path, tmp: Path, scale: float | None, n: int) -> int:
    """Train-like: a checkpoint on the trainer host (weights scaled to tell it apart), registered,
    then deleted from that host, so only the artifact store has it."""
    ckpt = tmp / f"ckpt-{n}"
    shutil.copytree(src, ckpt)
    (ckpt / "trainer_state").mkdir()
    (ckpt / "trainer_state" / "optimizer.pt").write_bytes(b"adamw" * 100)
    if scale is not None:
        weights = load_file(ckpt / "model.safetensors")
        save_file({k: v * scale for k, v in weights.items()}, ckpt / "model.safetensors", metadata={"format": "pt"})
    run = registry.start_run(cfg, f"train-{n}", {}, {})
    version = registry.register_checkpoint(cfg, run, ckpt, {"turns": "1"})
    registry.end_run(cfg, run)
    shutil.rmtree(ckpt)
    return version


def test_experiment_artifact_location_comes_from_the_server(hosts):
    trainer, _, _ = hosts
    exp = registry._client(trainer).get_experiment(registry.experiment_id(trainer))
    assert exp.artifact_location.startswith("mlflow-artifacts:"), exp.artifact_location
    assert not (trainer.home / "mlartifacts").exists()


def test_gateway_host_fetches_verifies_and_serves_a_version(hosts, tiny_model_dir, tmp_path):
    trainer, gateway, _ = hosts
    t0 = time.monotonic()
    v = register(trainer, Path(tiny_model_dir), tmp_path, 1.5, 1)
    print(f"register (upload) took {time.monotonic() - t0:.1f} s")
    source = registry.resolve(trainer, v)[1]
    assert artifacts.is_artifact_uri(source) and not Path(source).exists()
    with running_gateway(gateway) as app:
        t0 = time.monotonic()
        assert reload.reload_gateway(trainer, v, "/trainer/only/path") is not None  # the trainer sends the version
        print(f"fetch + verify + reload took {time.monotonic() - t0:.1f} s")
        assert policy_version(gateway) == v
        served = Path(app.state.gateway.engine.model_path)
        assert served.is_relative_to(gateway.home / "registry-cache") and not (served / "trainer_state").exists()
        want = load_file(Path(tiny_model_dir) / "model.safetensors")
        got = load_file(served / "model.safetensors")
        assert all(torch.equal(got[k], want[k] * 1.5) for k in want)
    # the trainer continuing from this version gets the optimizer state too, verified
    _, with_state = registry.resolve_local(gateway, v, trainer_state=True)
    assert (Path(with_state) / "trainer_state" / "optimizer.pt").read_bytes() == b"adamw" * 100
    # a small cache: only the `cache_versions` (2) most recently used versions stay
    for n in (2, 3):
        registry.resolve_local(gateway, register(trainer, Path(tiny_model_dir), tmp_path, None, n))
    assert len(list((gateway.home / "registry-cache" / gateway.model.name).glob("v*"))) == 2


def test_checkpoint_failing_its_checksum_is_refused_and_old_weights_keep_serving(hosts, tiny_model_dir, tmp_path):
    trainer, gateway, store = hosts
    good = register(trainer, Path(tiny_model_dir), tmp_path, None, 1)
    bad = register(trainer, Path(tiny_model_dir), tmp_path, 2.0, 2)
    run_id = registry._client(trainer).get_model_version(trainer.model.name, str(bad)).run_id
    (stored,) = store.glob(f"*/{run_id}/artifacts/checkpoint/model.safetensors")
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF  # bit rot / tampering in the artifact store
    stored.write_bytes(bytes(data))
    with running_gateway(gateway):
        ok = httpx.post(f"{gateway.gateway_url}/admin/reload", headers=admin(gateway), json={"version": good})
        assert ok.status_code == 200, ok.text
        r = httpx.post(f"{gateway.gateway_url}/admin/reload", headers=admin(gateway), json={"version": bad})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "model.safetensors does not match its registered checksum" in message
        assert f"still serving version {good}" in message and policy_version(gateway) == good
    cache = gateway.home / "registry-cache" / gateway.model.name
    assert not (cache / f"v{bad}").exists() and not list(cache.glob(".*tmp"))
