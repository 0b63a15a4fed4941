"""Typed configuration: YAML files in `configs/` validated into pydantic models.

One file is selected by `--config`, else `CLAWFLOW_CONFIG`, else `configs/default.yaml`.
Secrets come from the environment (`CLAWFLOW_API_KEY`, `CLAWFLOW_ADMIN_KEY`) and the data dir
from `CLAWFLOW_HOME` (default `./.clawflow`), so one YAML file serves every machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GGUFSource(_Strict):
    """A GGUF file shipped inside an installed Python package (located, never imported)."""

    package: str
    file: str


class TinySpec(_Strict):
    """A random-weight Llama made locally, with the tokenizer of the model it is based on."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    seed: int = 0


class ModelConfig(_Strict):
    name: str = "smollm2-135m-instruct"  # served model id and MLflow registered model name
    path: str | None = None  # a Hugging Face id or a local directory
    gguf: GGUFSource | None = None  # materialized once as safetensors under $CLAWFLOW_HOME/models
    tiny: TinySpec | None = None  # tests: random weights on top of path/gguf's tokenizer
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _has_source(self) -> "ModelConfig":
        if not self.path and not self.gguf:
            raise ValueError("model needs `path` (HF id or directory) or `gguf`")
        return self


class ServingConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = "clawflow"
    admin_key: str = "clawflow-admin"
    max_new_tokens: int = 256  # default when the request sets no max_tokens
    max_concurrency: int = 4  # requests decoding at once
    threads: int | None = None  # torch intra-op threads; None keeps torch's default


class StoreConfig(_Strict):
    fsync: Literal["always", "never"] = "always"  # "always": fsync each turn before replying
    segment_max_bytes: int = 8 * 1024 * 1024
    segment_max_age_s: float = 60.0
    seal_interval_s: float = 5.0  # how often the background sealer looks at segments


class JudgeConfig(_Strict):
    backend: Literal["rules"] = "rules"
    votes: int = 1


class TrainConfig(_Strict):
    lr: float = 1e-6
    epochs: int = 1
    micro_batch: int = 4
    max_turns: int = 256  # largest batch one training run takes, oldest first
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0  # truncated importance sampling cap for train/serve mismatch
    weight_decay: float = 0.0
    nproc: int = 1  # torchrun --nproc_per_node
    threads: int | None = None


class GateConfig(_Strict):
    """Eval gate before promotion (clawflow/gate.py)."""

    enabled: bool = True
    max_kl: float = 0.25  # nats/token, KL(champion ‖ candidate) on the champion's probe replies
    max_nll_increase: float = 0.25  # nats/token on those replies
    max_new_tokens: int = 24
    probes: list[str] = Field(default_factory=lambda: [
        "What is the capital of France?",
        "Write one sentence about the ocean.",
        "List three primary colors.",
        "How do I reverse a list in Python?",
        "Say hello to my friend Sam.",
    ])


class RegistryConfig(_Strict):
    tracking_uri: str | None = None  # None: sqlite:///$CLAWFLOW_HOME/mlflow.db
    experiment: str = "clawflow"


class ServicesConfig(_Strict):
    """Ports of the local stack started by `clawflow up`."""

    prefect_port: int = 4200
    mlflow_port: int = 5000
    work_pool: str = "clawflow-process"
    # train-on-new-feedback runs after this many clawflow.shard.sealed events within the window
    # (rendered into the deployment's trigger by `clawflow up`); runs are serial either way.
    train_trigger_threshold: int = Field(1, ge=1)
    train_trigger_within_s: float = Field(0.0, ge=0)


class Config(_Strict):
    home: Path = Path(".clawflow")
    model: ModelConfig
    serving: ServingConfig = Field(default_factory=ServingConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    source_file: Path | None = None

    @property
    def tracking_uri(self) -> str:
        return self.registry.tracking_uri or f"sqlite:///{self.home / 'mlflow.db'}"

    @property
    def artifact_root(self) -> Path:
        return self.home / "mlartifacts"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.serving.host}:{self.serving.port}"


class ConfigError(ValueError):
    """A config file that is missing or does not validate; the message is one line."""


def config_path(path: str | os.PathLike | None = None) -> Path:
    chosen = path or os.environ.get("CLAWFLOW_CONFIG") or DEFAULT_CONFIG
    return Path(chosen).expanduser().resolve()


def load_config(path: str | os.PathLike | None = None) -> Config:
    src = config_path(path)
    if not src.is_file():
        raise ConfigError(f"config file not found: {src}")
    try:
        raw = yaml.safe_load(src.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{src}: not valid YAML ({exc.__class__.__name__})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: the top level must be a mapping of sections, not {type(raw).__name__}")
    if env_home := os.environ.get("CLAWFLOW_HOME"):
        raw["home"] = env_home
    serving = raw.setdefault("serving", {}) or {}
    raw["serving"] = serving
    if isinstance(serving, dict):  # anything else fails validation below with a one-line message
        if key := os.environ.get("CLAWFLOW_API_KEY"):
            serving["api_key"] = key
        if key := os.environ.get("CLAWFLOW_ADMIN_KEY"):
            serving["admin_key"] = key
    try:
        cfg = Config.model_validate({**raw, "source_file": src})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{src}: {where}: {first['msg']}") from exc
    cfg.home = cfg.home.expanduser().resolve()
    return cfg
