"""Checkpoints through an MLflow tracking server: uploaded as the run's artifacts with a manifest
of SHA-256 checksums, fetched by any host into a small local cache and verified file by file.

Only for a tracking *server* (http/https): with the default local store a version's source is the
checkpoint directory itself and nothing is copied. The trust anchor is the model version's tag
`clawflow.manifest_sha256` (registry metadata, written when the version is created): the
downloaded manifest must hash to it, and every downloaded file must match its manifest entry.
A failed check raises ChecksumError and leaves nothing in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from clawflow.config import Config
from clawflow.home import Home

MANIFEST = "clawflow_manifest.json"
TAG = "clawflow.manifest_sha256"
SUBDIR = "checkpoint"  # the run's artifact folder holding the checkpoint
TRAINER_ONLY = ("trainer_state/",)  # AdamW state: the next training needs it, serving does not


class ChecksumError(RuntimeError):
    """A downloaded checkpoint that does not match what was registered."""


def is_remote(cfg: Config) -> bool:
    return cfg.tracking_uri.startswith(("http://", "https://"))


def is_artifact_uri(source: str) -> bool:
    """`mlflow-artifacts:/…`, `s3://…`, `runs:/…`: not a local directory."""
    head = source.split("/", 1)[0]
    return ":" in head and not source.startswith("file:")


def manifest(directory: Path) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} of every file under `directory`."""
    out = {}
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            out[rel] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    return out


def digest(man: dict) -> str:
    return hashlib.sha256(json.dumps(man, sort_keys=True).encode()).hexdigest()


def upload(client, run_id: str, checkpoint: Path) -> tuple[str, str]:
    """Log `checkpoint` and its manifest as the run's `checkpoint/` artifacts; (source URI, digest)."""
    man = manifest(checkpoint)
    client.log_artifacts(run_id, str(checkpoint), SUBDIR)
    client.log_dict(run_id, man, f"{SUBDIR}/{MANIFEST}")
    return client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + SUBDIR, digest(man)


def fetch(cfg: Config, version: int, source: str, expected: str | None, trainer_state: bool = False,
          model: str | None = None) -> Path:
    """The verified local copy of `version` (downloaded once, then served from the cache) of the
    registered `model` (default `model.name`; a user's version line has its own: numbers overlap)."""
    if not expected:
        raise ChecksumError(f"v{version} has no {TAG} tag: it was not registered through the artifact store")
    cache = Home(cfg.home).registry_cache / (model or cfg.model.name)
    final = cache / f"v{version}"
    tmp = cache / f".v{version}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        man = _download_manifest(cfg, source, tmp, expected, version)
        wanted = [rel for rel in man if trainer_state or not rel.startswith(TRAINER_ONLY)]
        missing = [rel for rel in wanted if not (final / rel).is_file()]
        for rel in missing:
            _download(cfg, f"{source}/{rel}", (tmp / rel).parent)
            if _sha256(tmp / rel) != man[rel]["sha256"]:
                raise ChecksumError(f"v{version}: {rel} does not match its registered checksum; refused")
        if not final.exists():
            tmp.rename(final)
        else:  # a serving copy gaining the trainer's files: move the verified ones in
            for rel in missing:
                (final / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / rel, final / rel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.utime(final)  # most recently used
    _prune(cache, keep=cfg.registry.cache_versions)
    return final


def _download_manifest(cfg: Config, source: str, into: Path, expected: str, version: int) -> dict:
    _download(cfg, f"{source}/{MANIFEST}", into)
    man = json.loads((into / MANIFEST).read_text())
    if digest(man) != expected:
        raise ChecksumError(f"v{version}: manifest does not match the registered checksum; refused")
    return man


def _download(cfg: Config, uri: str, into: Path) -> None:
    import mlflow.artifacts

    into.mkdir(parents=True, exist_ok=True)
    mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(into), tracking_uri=cfg.tracking_uri)


def _prune(cache: Path, keep: int) -> None:
    """Keep the `keep` most recently used versions (the one just fetched is the newest)."""
    done = sorted((p for p in cache.glob("v*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in done[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
