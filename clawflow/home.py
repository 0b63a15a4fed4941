"""The data directory's layout (`$CLAWFLOW_HOME`), named in this one place.

Two kinds of names. The shared data (shards, judgments, env rewards, kept samples, quarantine,
staging) lives under the *storage root*, which may be an object-store URL (store.root, see
clawflow/store/storage.py), so it is named relative to that root: `Home.SHARDS` is what
`Storage.join`/`list`/`put_bytes` take. Everything else is this host's own and always local:
`Home(root).wal`, `.run`, `.catalog`, ... are Paths. On a local root (the default) the storage
root *is* the home, so `Home(root).shards` is also where the shards are.

Ground floor: imports nothing from clawflow, so every package may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True)
class Home:
    root: Path

    # -- relative to the storage root (local home or object store) --------------------------------
    SHARDS: ClassVar[str] = "shards"
    JUDGMENTS: ClassVar[str] = "judgments"
    ENV_REWARDS: ClassVar[str] = "env_rewards"
    RUNS: ClassVar[str] = "runs"  # runs/<run_id>/samples.parquet: what each run trained on
    QUARANTINE: ClassVar[str] = "quarantine"
    STAGING: ClassVar[str] = "staging"  # compaction's merged shard before the journal swaps it in
    SAMPLES_FILE: ClassVar[str] = "samples.parquet"
    PREFERENCES: ClassVar[str] = "preferences"  # preferences/preferences.parquet: standing preferences (clawflow/prefs)
    PREFERENCES_FILE: ClassVar[str] = "preferences.parquet"

    # -- this host's own, always local --------------------------------------------------------------
    WAL: ClassVar[str] = "wal"
    OUTBOX: ClassVar[str] = "outbox"  # sealed shards waiting for the object store
    RUN: ClassVar[str] = "run"  # pid files of the stack's processes
    LOGS: ClassVar[str] = "logs"
    MODELS: ClassVar[str] = "models"  # GGUF/tiny models materialized as safetensors
    CHECKPOINTS: ClassVar[str] = "checkpoints"
    EVAL: ClassVar[str] = "eval"
    REWRITES: ClassVar[str] = "rewrites"  # rewrites and preference strengths reused across runs (train/rewrite_cache.py)
    REGISTRY_CACHE: ClassVar[str] = "registry-cache"
    PREFECT: ClassVar[str] = "prefect"
    MLARTIFACTS: ClassVar[str] = "mlartifacts"
    MLFLOW_DB: ClassVar[str] = "mlflow.db"
    CATALOG: ClassVar[str] = "catalog.duckdb"
    STORE_LOCK: ClassVar[str] = "store.lock"
    JOURNAL: ClassVar[str] = "store-journal"
    TOMBSTONES: ClassVar[str] = "forgotten.jsonl"
    REGISTRY_LOCK: ClassVar[str] = ".registry.lock"
    PREFECT_RENDERED: ClassVar[str] = "prefect.rendered.yaml"  # prefect.yaml with the config's trigger
    USERS: ClassVar[str] = "users"  # users/users.json: `clawflow users add`'s users (key hashes only)
    USERS_FILE: ClassVar[str] = "users.json"
    USERS_LOCK: ClassVar[str] = "users.lock"

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def names(cls) -> dict[str, str]:
        """Every name above, by attribute: the one list tests check for stray literals."""
        return {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)}

    @staticmethod
    def samples_rel(run_id: str) -> str:
        """A run's samples file relative to the storage root (the copy kept beside the shards)."""
        return f"{Home.RUNS}/{run_id}/{Home.SAMPLES_FILE}"

    # -- local paths ----------------------------------------------------------------------------------
    @property
    def shards(self) -> Path:
        return self.root / self.SHARDS

    @property
    def judgments(self) -> Path:
        return self.root / self.JUDGMENTS

    @property
    def env_rewards(self) -> Path:
        return self.root / self.ENV_REWARDS

    @property
    def runs(self) -> Path:
        return self.root / self.RUNS

    def run_dir(self, run_id: str) -> Path:
        return self.runs / run_id

    def samples(self, run_id: str) -> Path:
        return self.run_dir(run_id) / self.SAMPLES_FILE

    @property
    def quarantine(self) -> Path:
        return self.root / self.QUARANTINE

    @property
    def wal(self) -> Path:
        return self.root / self.WAL

    @property
    def outbox(self) -> Path:
        """Where shards wait for upload: laid out like `shards/` so a relative name carries over."""
        return self.root / self.OUTBOX / self.SHARDS

    @property
    def run(self) -> Path:
        return self.root / self.RUN

    @property
    def logs(self) -> Path:
        return self.root / self.LOGS

    @property
    def models(self) -> Path:
        return self.root / self.MODELS

    @property
    def checkpoints(self) -> Path:
        return self.root / self.CHECKPOINTS

    @property
    def eval(self) -> Path:
        return self.root / self.EVAL

    @property
    def rewrites(self) -> Path:
        return self.root / self.REWRITES

    def user_rewrites(self, user: str) -> Path:
        """A user's own version line's rewrite cache (issue #29)."""
        return self.rewrites / self.USERS / user

    @property
    def registry_cache(self) -> Path:
        return self.root / self.REGISTRY_CACHE

    @property
    def prefect(self) -> Path:
        return self.root / self.PREFECT

    @property
    def mlartifacts(self) -> Path:
        return self.root / self.MLARTIFACTS

    @property
    def mlflow_db(self) -> Path:
        return self.root / self.MLFLOW_DB

    @property
    def catalog(self) -> Path:
        return self.root / self.CATALOG

    @property
    def store_lock(self) -> Path:
        return self.root / self.STORE_LOCK

    @property
    def journal(self) -> Path:
        return self.root / self.JOURNAL

    @property
    def tombstones(self) -> Path:
        return self.root / self.TOMBSTONES

    @property
    def registry_lock(self) -> Path:
        return self.root / self.REGISTRY_LOCK

    @property
    def prefect_rendered(self) -> Path:
        return self.root / self.PREFECT_RENDERED

    @property
    def users_file(self) -> Path:
        return self.root / self.USERS / self.USERS_FILE

    @property
    def users_lock(self) -> Path:
        return self.root / self.USERS / self.USERS_LOCK
