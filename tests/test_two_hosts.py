"""Two-host rehearsal on one machine (issue #18 part 6): a "gateway host" and a "trainer host"
with their own CLAWFLOW_HOME directories share nothing but an S3 object store (a real moto
server), an MLflow tracking server whose artifact store is on that S3, and a Prefect server.

The gateway (`clawflow serve`, its own process) records a conversation and seals it into the
bucket; the trainer's flow reads it from there (its own DuckDB catalog), judges, trains, and
registers the checkpoint as MLflow artifacts (so on S3); the gateway is told the version only,
downloads it from the tracking server into its own cache, verifies it and serves it. Both hosts
get the same base model directory, as an image would ship it."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml
from _mlflow_server import mlflow_server
from _object_store import make_bucket, s3_endpoint  # noqa: F401 - fixture
from conftest import admin, free_port, policy_version
from safetensors.torch import load_file
from test_crash import start_gateway

from clawflow.config import REPO_ROOT, load_config
from clawflow.store.catalog import Catalog
from clawflow.store.storage import Storage


def host_config(tmp_path: Path, name: str, model_dir: str, port: int, store: dict, tracking_uri: str) -> Path:
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / name / "home")
    raw["model"] = {"name": "clawflow-tiny", "path": model_dir}
    raw["serving"].update(port=port, public_url=f"http://127.0.0.1:{port}")  # what the trainer calls
    raw["store"].update(store)
    raw["registry"] = {"tracking_uri": tracking_uri}
    path = tmp_path / name / "config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_gateway_and_trainer_share_only_the_object_store_mlflow_and_prefect(
        tmp_path, tiny_model_dir, s3_endpoint, prefect_api):  # noqa: F811
    from flows.train_on_new_feedback import train_on_new_feedback

    t0 = time.monotonic()
    bucket = make_bucket(s3_endpoint)
    root = f"s3://{bucket}/clawflow"
    services = contextlib.ExitStack()
    tracking = services.enter_context(
        mlflow_server(tmp_path, f"s3://{bucket}/artifacts", {"MLFLOW_S3_ENDPOINT_URL": s3_endpoint}))
    port = free_port()
    store = {"root": root, "storage_options": {"endpoint_url": s3_endpoint}, "replica_id": "gw-0"}
    gw_cfg = load_config(host_config(tmp_path, "gateway-host", tiny_model_dir, port, store, tracking))
    tr_path = host_config(tmp_path, "trainer-host", tiny_model_dir, port, store, tracking)
    tr_cfg = load_config(tr_path)
    gateway = None
    try:
        gateway = start_gateway(gw_cfg, tmp_path / "gateway.log")
        print(f"services up in {time.monotonic() - t0:.1f} s")

        # the gateway host records a conversation (the middle turn corrected, the last thanked)
        chat = httpx.Client(base_url=gw_cfg.gateway_url, timeout=120,
                            headers={"Authorization": f"Bearer {gw_cfg.serving.api_key}", "X-Session-Id": "rehearsal"})
        history = [{"role": "user", "content": "Write a haiku about the sea."}]
        for follow_up in ("No, that's wrong. Make it shorter, please.", "Thanks, perfect!", None):
            r = chat.post("/v1/chat/completions", json={"model": "clawflow-tiny", "messages": history, "seed": 1})
            r.raise_for_status()
            if follow_up:
                reply = r.json()["choices"][0]["message"]["content"]
                history += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
        sealed = httpx.post(f"{gw_cfg.gateway_url}/admin/seal", headers=admin(gw_cfg)).json()["shards"]
        assert sealed and all(s["path"].startswith(f"{root}/shards/") for s in sealed), sealed
        assert not list((gw_cfg.home / "outbox").rglob("*.parquet"))  # uploaded, nothing left behind
        assert sum(e.size > 0 for e in Storage(root, store["storage_options"]).list("shards")) >= 1

        # the trainer host: its own home and catalog, the shards from the bucket
        t1 = time.monotonic()
        result = train_on_new_feedback(config_path=str(tr_path))
        print(f"train-on-new-feedback on the trainer host took {time.monotonic() - t1:.1f} s")
        assert result["trained"] and result["version"] == 1 and result["promoted"], result
        assert result["samples"] == 2 and result["reloaded"] is True, result
        assert Catalog.for_config(tr_cfg).stats()["consumed"] == 2
        bucket_store = Storage(root, store["storage_options"])
        assert f"{result['mlflow_run']}/samples.parquet" in {e.rel for e in bucket_store.list("runs")}
        assert bucket_store.list("judgments")  # the trainer's judgments are beside the shards

        # the gateway fetched v1 from the tracking server (artifacts on S3), verified, serves it
        assert policy_version(gw_cfg) == 1
        (served,) = (gw_cfg.home / "registry-cache" / "clawflow-tiny").glob("v1")
        base, new = load_file(Path(tiny_model_dir) / "model.safetensors"), load_file(served / "model.safetensors")
        assert any(not (base[k] == new[k]).all() for k in base), "the served weights are the base's"
        s3 = Storage(f"s3://{bucket}", store["storage_options"])
        assert any(e.rel.endswith("checkpoint/model.safetensors") for e in s3.list("artifacts", suffix=".safetensors"))

        # nothing crossed between the homes: no shards or catalog on the gateway, no WAL on the trainer
        assert not (gw_cfg.home / "catalog.duckdb").exists() and not (gw_cfg.home / "shards").exists()
        assert not (tr_cfg.home / "wal").exists() and not (tr_cfg.home / "shards").exists()
        print(f"two-host rehearsal took {time.monotonic() - t0:.1f} s")
    finally:
        if gateway is not None:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(60)
        services.close()
