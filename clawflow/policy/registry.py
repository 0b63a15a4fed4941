"""MLflow registry: one run per training, a model version per checkpoint, aliases `champion`/`previous`.

With the default local store, checkpoints are not copied into MLflow's artifact store: a
version's `source` is the checkpoint directory under `$CLAWFLOW_HOME/checkpoints/` (a 540 MB model
stored once, not twice). With a tracking server (http/https) the experiment's artifact location
is the server's, and a checkpoint is logged as its run's artifacts with a checksum manifest
(clawflow/artifacts.py): any host with the tracking URI fetches, verifies and caches it
(`checkpoint_dir`).

The base model is registered too (`ensure_base`, at first start): version 1 tagged `base=true`
and `champion` while nothing was trained, so `rollback` can always return to it.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from clawflow import artifacts
from clawflow.config import Config
from clawflow.home import Home

CHAMPION, PREVIOUS = "champion", "previous"
USER_LINE = "."  # `<model.name>.<user>`: a user's own adapters (a user name has no other dot-free meaning)


def model_name(cfg: Config) -> str:
    """The registered model of `cfg.registry.user`'s version line (the shared policy's when None)."""
    user = cfg.registry.user
    return cfg.model.name if user is None else f"{cfg.model.name}{USER_LINE}{user}"


def for_user(cfg: Config, user: str | None) -> Config:
    """`cfg` reading and writing `user`'s version line: their own adapters. The default user
    (`serving.user`) and None: the shared policy's line, as before users existed."""
    line = None if user in (None, cfg.serving.user) else user
    if line == cfg.registry.user:
        return cfg
    return cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"user": line})})


def user_lines(cfg: Config) -> list[str]:
    """The users who have a version line of their own (a registered `<model.name>.<user>`)."""
    prefix = cfg.model.name + USER_LINE
    try:
        models = _client(cfg).search_registered_models(f"name LIKE '{prefix}%'")
    except Exception:  # noqa: BLE001 - no registry yet: nobody has a line
        return []
    return sorted(m.name[len(prefix):] for m in models if m.name.startswith(prefix))


def _client(cfg: Config):
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(cfg.tracking_uri)
    return MlflowClient(tracking_uri=cfg.tracking_uri)


def experiment_id(cfg: Config) -> str:
    client = _client(cfg)
    exp = client.get_experiment_by_name(cfg.registry.experiment)
    if exp is not None:
        return exp.experiment_id
    if artifacts.is_remote(cfg):  # the server's artifact root, reachable by every host
        return client.create_experiment(cfg.registry.experiment)
    cfg.artifact_root.mkdir(parents=True, exist_ok=True)
    return client.create_experiment(cfg.registry.experiment, artifact_location=cfg.artifact_root.as_uri())


def start_run(cfg: Config, name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
    client = _client(cfg)
    run = client.create_run(experiment_id(cfg), run_name=name, tags=tags)
    for key, value in params.items():
        client.log_param(run.info.run_id, key, str(value)[:6000])
    return run.info.run_id


def log_metrics(cfg: Config, run_id: str, steps: list[dict[str, float]], totals: dict[str, float]) -> None:
    client = _client(cfg)
    for i, step in enumerate(steps):
        for key, value in step.items():
            if isinstance(value, (int, float)):
                client.log_metric(run_id, key, float(value), step=i)
    for key, value in totals.items():
        if isinstance(value, (int, float)):
            client.log_metric(run_id, key, float(value))


def log_json(cfg: Config, run_id: str, data: dict[str, Any], name: str) -> None:
    _client(cfg).log_dict(run_id, data, name)


def log_preferences(cfg: Config, run_id: str, preferences: list[dict], report: dict) -> None:
    """The standing preferences a run distilled, as an input dataset of its MLflow run (the UI's
    "Datasets used"), with what the trainer measured and taught in `preferences.json`."""
    import hashlib
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag

    client = _client(cfg)
    body = json.dumps(preferences, sort_keys=True)
    dataset = Dataset(name="standing-preferences", digest=hashlib.sha256(body.encode()).hexdigest()[:16],
                      source_type="clawflow", source=json.dumps({"preferences": [p["pref_id"] for p in preferences]}),
                      profile=json.dumps({"num_preferences": len(preferences), "taught": report.get("taught", "")}))
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])])
    client.log_dict(run_id, {"preferences": preferences, **report}, "preferences.json")
    client.set_tag(run_id, "clawflow.preferences", ",".join(p["pref_id"] for p in preferences
                                                            if p["pref_id"] not in {d["pref_id"] for d in
                                                                                    report.get("dropped", [])}))


CHAMPION_HISTORY = "champion-history"


def log_champion(cfg: Config, version: int, metrics: dict[str, float]) -> None:
    """The champion's measures (facts, preference measure, dose) at step = version, in one run of
    the experiment: MLflow draws each as a running chart over versions."""
    client = _client(cfg)
    exp = experiment_id(cfg)
    found = client.search_runs([exp], filter_string=f"tags.`clawflow.kind` = '{CHAMPION_HISTORY}' and "
                                                    f"tags.`clawflow.model` = '{model_name(cfg)}'", max_results=1)
    run_id = found[0].info.run_id if found else client.create_run(
        exp, run_name=f"{CHAMPION_HISTORY}-{model_name(cfg)}",
        tags={"clawflow.kind": CHAMPION_HISTORY, "clawflow.model": model_name(cfg)}).info.run_id
    for key, value in metrics.items():
        client.log_metric(run_id, key, float(value), step=int(version))


def learned_preferences(cfg: Config, version: int) -> list[str]:
    """The standing preferences version `version` was trained on, through its parents' lineage:
    the ids its run distilled (a run without preferences inherits its parent's)."""
    client = _client(cfg)
    seen: set[int] = set()
    while version and version not in seen:
        seen.add(version)
        try:
            mv = client.get_model_version(model_name(cfg), str(version))
        except Exception:  # noqa: BLE001 - an unknown version learned nothing we know of
            return []
        if mv.run_id:
            tag = client.get_run(mv.run_id).data.tags.get("clawflow.preferences")
            if tag is not None:
                return [p for p in tag.split(",") if p]
        parent = str((mv.tags or {}).get("parent_version", ""))
        version = int(parent) if parent.isdigit() else 0  # the base is tagged "none"
    return []


def end_run(cfg: Config, run_id: str, status: str = "FINISHED") -> None:
    _client(cfg).set_terminated(run_id, status=status)


def register_checkpoint(cfg: Config, run_id: str, checkpoint: Path, tags: dict[str, str]) -> int:
    """A new model version whose source is `checkpoint`; returns its version number."""
    from mlflow.exceptions import MlflowException

    client = _client(cfg)
    name = model_name(cfg)
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="clawflow policy checkpoints")
    source = str(checkpoint)
    if artifacts.is_remote(cfg):
        source, sha = artifacts.upload(client, run_id, Path(checkpoint))
        tags = {**tags, artifacts.TAG: sha}
    mv = client.create_model_version(name, source=source, run_id=run_id, tags=tags)
    return int(mv.version)


def checkpoint_dir(cfg: Config, version: int, source: str, trainer_state: bool = False) -> str:
    """A local directory with `version`'s checkpoint: `source` itself when it is a local path (the
    default), else the verified download in $CLAWFLOW_HOME/registry-cache (ChecksumError if bad).
    `trainer_state`: also the optimizer state (the trainer continues it; serving never needs it)."""
    if not artifacts.is_artifact_uri(source):
        return source
    mv = _client(cfg).get_model_version(model_name(cfg), str(version))
    return str(artifacts.fetch(cfg, version, source, (mv.tags or {}).get(artifacts.TAG), trainer_state,
                               model_name(cfg)))


def resolve_local(cfg: Config, ref: int | str, trainer_state: bool = False) -> tuple[int, str]:
    """`resolve`, with the checkpoint made local (see `checkpoint_dir`)."""
    version, source = resolve(cfg, ref)
    return version, checkpoint_dir(cfg, version, source, trainer_state)


@contextmanager
def _registry_lock(cfg: Config):
    """One registering process at a time per home (`up` and serve-policy may start together)."""
    cfg.home.mkdir(parents=True, exist_ok=True)
    with open(Home(cfg.home).registry_lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_base(cfg: Config, base_dir: str) -> int:
    """Register the base model once (tag `base=true`), `champion` when there is none; its version.
    Idempotent: a second call returns the version registered first."""
    client = _client(cfg)
    with _registry_lock(cfg):
        for mv in client.search_model_versions(f"name='{model_name(cfg)}'"):
            if (mv.tags or {}).get("base") == "true":
                return int(mv.version)
        run_id = start_run(cfg, "base-model", {"source": base_dir, "model": model_name(cfg)},
                           {"clawflow.base": "true"})
        version = register_checkpoint(cfg, run_id, Path(base_dir), {
            "base": "true", "parent_version": "none", "turn_count": "0", "shard_count": "0", "shards": "",
            "gate": "base"})
        end_run(cfg, run_id)
        if champion(cfg) is None:
            client.set_registered_model_alias(model_name(cfg), CHAMPION, str(version))
        return version


def promote(cfg: Config, version: int) -> int | None:
    """Point `champion` at `version` and `previous` at the old champion; returns the old one."""
    client = _client(cfg)
    old = champion(cfg)
    if old is not None and old[0] != version:
        client.set_registered_model_alias(model_name(cfg), PREVIOUS, str(old[0]))
    client.set_registered_model_alias(model_name(cfg), CHAMPION, str(version))
    return old[0] if old else None


def resolve(cfg: Config, ref: int | str) -> tuple[int, str]:
    """(version, checkpoint directory) for a version number or an alias; LookupError if unknown."""
    from mlflow.exceptions import MlflowException

    client = _client(cfg)
    try:
        if isinstance(ref, int) or str(ref).isdigit():
            mv = client.get_model_version(model_name(cfg), str(ref))
        else:
            mv = client.get_model_version_by_alias(model_name(cfg), str(ref))
    except MlflowException as exc:
        raise LookupError(f"no version {ref!r} of model {model_name(cfg)!r} in the registry") from exc
    source = mv.source.removeprefix("file://")
    return int(mv.version), source


def latest_version(cfg: Config) -> int:
    """The newest version number (promoted or not); 0 when nothing is registered."""
    from mlflow.exceptions import MlflowException

    try:
        found = _client(cfg).search_model_versions(f"name='{model_name(cfg)}'", max_results=1,
                                                    order_by=["version_number DESC"])
    except MlflowException:
        return 0
    return int(found[0].version) if found else 0


def champion(cfg: Config) -> tuple[int, str] | None:
    try:
        return resolve(cfg, CHAMPION)
    except LookupError:
        return None


def tag_version(cfg: Config, version: int, tags: dict[str, str]) -> None:
    client = _client(cfg)
    for key, value in tags.items():
        client.set_model_version_tag(model_name(cfg), str(version), key, str(value))


def rollback(cfg: Config, target: int | str | None = None) -> tuple[int, int, str]:
    """Point `champion` at `target` (default: the `previous` alias); the old champion becomes
    `previous`. Returns (old champion, new champion, its checkpoint)."""
    current = champion(cfg)
    if current is None:
        raise LookupError(f"model {model_name(cfg)!r} has no champion to roll back from")
    version, path = resolve(cfg, PREVIOUS if target is None else target)
    if version == current[0]:
        raise LookupError(f"version {version} is already the champion")
    client = _client(cfg)
    client.set_registered_model_alias(model_name(cfg), CHAMPION, str(version))
    client.set_registered_model_alias(model_name(cfg), PREVIOUS, str(current[0]))
    client.set_model_version_tag(model_name(cfg), str(current[0]), "rolled_back_from", "true")
    return current[0], version, path


def delete_line(cfg: Config) -> list[str]:
    """Delete `cfg.registry.user`'s version line (never the shared policy's): the registered model
    and the checkpoint directories of its versions under $CLAWFLOW_HOME. Their runs stay in the
    experiment (metrics only). Returns the deleted checkpoint directories."""
    import shutil

    from mlflow.exceptions import MlflowException

    if cfg.registry.user is None:
        raise ValueError("the shared policy's line is not deleted; roll it back instead")
    client = _client(cfg)
    try:
        versions = client.search_model_versions(f"name='{model_name(cfg)}'")
    except MlflowException:
        return []
    checkpoints = Home(cfg.home).checkpoints.resolve()
    gone = []
    for mv in versions:
        src = Path(mv.source.removeprefix("file://"))
        if src.is_dir() and src.resolve().is_relative_to(checkpoints):  # ours: never a path elsewhere
            shutil.rmtree(src)
            gone.append(str(src))
    try:
        client.delete_registered_model(model_name(cfg))
    except MlflowException:
        pass  # deleted meanwhile
    return gone


def list_versions(cfg: Config) -> list[dict[str, Any]]:
    """Every version, newest first: number, aliases, tags, source, creation time, run metrics."""
    from mlflow.exceptions import MlflowException

    client = _client(cfg)
    try:
        model = client.get_registered_model(model_name(cfg))
    except MlflowException:
        return []
    aliases: dict[str, list[str]] = {}
    for alias, v in (model.aliases or {}).items():
        aliases.setdefault(str(v), []).append(alias)
    rows = []
    for mv in client.search_model_versions(f"name='{model_name(cfg)}'"):
        metrics = client.get_run(mv.run_id).data.metrics if mv.run_id else {}
        rows.append({"version": int(mv.version), "aliases": sorted(aliases.get(str(mv.version), [])),
                     "tags": dict(mv.tags or {}), "source": mv.source, "created": mv.creation_timestamp,
                     "run_id": mv.run_id, "metrics": metrics})
    return sorted(rows, key=lambda r: -r["version"])
