"""Gateway replicas follow `champion` (`registry.follow_champion_s`): two `clawflow serve`
processes with their own homes, WALs and ports on one registry serve each promotion and rollback
without being told, as replicas behind a load balancer must (the training flow's reload reaches
only one of them). Separate processes, as replicas are: transformers' loading is not safe for two
models loading at once in one process."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import httpx
import yaml
from conftest import admin, free_port, policy_version, running_gateway
from safetensors.torch import load_file, save_file
from test_crash import spawn_gateway, wait_healthy

from clawflow.policy import registry


def register(cfg, src: Path, tmp: Path, scale: float) -> int:
    ckpt = tmp / f"ckpt-{scale}"
    shutil.copytree(src, ckpt)
    weights = load_file(ckpt / "model.safetensors")
    save_file({k: v * scale for k, v in weights.items()}, ckpt / "model.safetensors", metadata={"format": "pt"})
    run = registry.start_run(cfg, f"train-{scale}", {}, {})
    version = registry.register_checkpoint(cfg, run, ckpt, {})
    registry.end_run(cfg, run)
    return version


def wait_for(version: int, *cfgs, timeout_s: float = 30) -> float:
    t0 = time.monotonic()
    while any(policy_version(c) != version for c in cfgs):
        assert time.monotonic() - t0 < timeout_s, [policy_version(c) for c in cfgs]
        time.sleep(0.1)
    return time.monotonic() - t0


def replica(cfg, tmp_path: Path, name: str):
    """A config file for one replica: its own home and port, the shared registry."""
    raw = yaml.safe_load(cfg.source_file.read_text())
    raw["home"], raw["serving"]["port"] = str(tmp_path / name), free_port()
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return cfg.model_copy(update={"home": tmp_path / name, "source_file": path,
                                  "serving": cfg.serving.model_copy(update={"port": raw["serving"]["port"]})})


def test_replicas_serve_each_promotion_and_rollback(make_config, tiny_model_dir, tmp_path):
    cfg = make_config(registry={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "follow_champion_s": 0.3})
    v1 = register(cfg, Path(tiny_model_dir), tmp_path, 1.5)
    v2 = register(cfg, Path(tiny_model_dir), tmp_path, 2.0)
    a, b = replica(cfg, tmp_path, "gw-a"), replica(cfg, tmp_path, "gw-b")
    # both replicas start side by side (separate processes), then each is waited for
    procs = [spawn_gateway(c, tmp_path / f"{n}.log") for c, n in ((a, "gw-a"), (b, "gw-b"))]
    try:
        for c, n, p in zip((a, b), ("gw-a", "gw-b"), procs):
            wait_healthy(c, tmp_path / f"{n}.log", p)
        assert policy_version(a) == policy_version(b) == 0  # no champion yet: the base
        time.sleep(1.0)
        assert policy_version(a) == policy_version(b) == 0  # nothing to follow: nothing moves

        registry.promote(cfg, v1)
        print(f"promotion served by both replicas in {wait_for(v1, a, b):.1f} s")
        registry.promote(cfg, v2)
        wait_for(v2, a, b)
        registry.rollback(cfg)  # champion back to `previous`
        print(f"rollback served by both replicas in {wait_for(v1, a, b):.1f} s")

        for c in (a, b):
            served = httpx.get(f"{c.gateway_url}/admin/policy", headers=admin(c)).json()["path"]
            assert Path(served).name == "ckpt-1.5"
            assert "clawflow_reloads_total 3" in httpx.get(f"{c.gateway_url}/metrics").text
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(60)


def test_without_the_setting_nothing_follows(make_config, tiny_model_dir, tmp_path):
    cfg = make_config(registry={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    v1 = register(cfg, Path(tiny_model_dir), tmp_path, 1.5)
    with running_gateway(cfg):
        registry.promote(cfg, v1)
        time.sleep(1.5)
        assert policy_version(cfg) == 0
