"""Tasks of `train-on-new-feedback`. Each does one thing; retries where I/O can fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawflow import events, ops, registry
from clawflow.config import Config
from clawflow.feedback import judge_pairs, training_samples, write_samples
from clawflow.judge import make_judge
from clawflow.models import base_model_dir
from clawflow.store.catalog import Catalog
from clawflow.train.launch import run_training


def catalog(cfg: Config) -> Catalog:
    return Catalog(cfg.home / "catalog.duckdb", cfg.home / "shards")


@task(name="collect-batch", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def collect_batch(cfg: Config, max_turns: int) -> list[dict[str, Any]]:
    """Unconsumed main turns that have a next state, oldest first."""
    pairs = catalog(cfg).pending_pairs(max_turns)
    get_run_logger().info("%d turns with a next state are waiting", len(pairs))
    return pairs


@task(name="judge-turns", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      task_run_name="judge-{cfg.judge.backend}")
def judge_turns(cfg: Config, pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    judgments = judge_pairs(make_judge(cfg), pairs)
    scores = [j["score"] for j in judgments]
    get_run_logger().info("judged %d turns: %d good, %d bad, %d neutral", len(scores),
                          scores.count(1), scores.count(-1), scores.count(0))
    return judgments


@task(name="serving-policy", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def current_policy(cfg: Config) -> tuple[int, str]:
    """The champion (version, checkpoint) to train from, or the base model as version 0."""
    return registry.champion(cfg) or (0, base_model_dir(cfg))


@task(name="start-mlflow-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def start_run(cfg: Config, flow_run: str, parent: int, pairs: list[dict], judgments: list[dict]) -> str:
    scores = [j["score"] for j in judgments]
    params = {"lr": cfg.train.lr, "epochs": cfg.train.epochs, "micro_batch": cfg.train.micro_batch,
              "eps_low": cfg.train.eps_low, "eps_high": cfg.train.eps_high, "nproc": cfg.train.nproc,
              "judge": judgments[0]["judge"] if judgments else cfg.judge.backend,
              "turns": len(pairs), "first_turn_at": pairs[0]["created_at"], "last_turn_at": pairs[-1]["created_at"],
              "config": str(cfg.source_file)}
    tags = {"clawflow.parent_version": str(parent), "clawflow.prefect_flow_run": flow_run,
            "clawflow.reward_mean": f"{sum(scores) / max(len(scores), 1):.4f}"}
    return registry.start_run(cfg, f"train-from-v{parent}", params, tags)


@task(name="train-policy", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="train-{run_id}", timeout_seconds=6 * 3600)
def train_policy(cfg: Config, run_id: str, base: str, samples: list[dict[str, Any]]) -> tuple[Path, dict]:
    """torchrun subprocess; the checkpoint appears atomically at $CLAWFLOW_HOME/checkpoints/<run_id>."""
    run_dir = cfg.home / "runs" / run_id
    batch = write_samples(samples, run_dir / "samples.parquet")
    out = cfg.home / "checkpoints" / run_id
    done = out / "train_metrics.json"
    if done.exists():  # a retry after the checkpoint was written: reuse it, don't train twice
        metrics = json.loads(done.read_text())
    else:
        metrics = run_training(cfg.source_file, cfg, Path(base), batch, out)
    registry.log_metrics(cfg, run_id, metrics.get("per_step", []),
                         {k: v for k, v in metrics.items() if k != "per_step"})
    return out, metrics


@task(name="register-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def register(cfg: Config, run_id: str, checkpoint: Path, parent: int, turns: int, reward_mean: float) -> int:
    version = registry.register_checkpoint(
        cfg, run_id, checkpoint,
        {"parent_version": str(parent), "turns": str(turns), "reward_mean": f"{reward_mean:.4f}"})
    registry.end_run(cfg, run_id)
    events.emit(events.POLICY_REGISTERED, f"clawflow.policy.{cfg.model.name}.v{version}",
                {"version": version, "run_id": run_id, "path": str(checkpoint)})
    return version


@task(name="promote-champion", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def promote(cfg: Config, version: int) -> int | None:
    previous = registry.promote(cfg, version)
    events.emit(events.POLICY_PROMOTED, f"clawflow.policy.{cfg.model.name}.v{version}",
                {"version": version, "previous": previous})
    return previous


@task(name="commit-consumption", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=2)
def commit_consumption(cfg: Config, turn_ids: list[str], run_id: str, version: int) -> int:
    """Exactly-once: turns are marked consumed together with the version they produced."""
    return catalog(cfg).commit_consumed(turn_ids, run_id, version)


@task(name="reload-gateway", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=3,
      task_run_name="reload-v{version}")
def reload_gateway(cfg: Config, version: int, checkpoint: str) -> bool:
    """Tell the gateway to serve `version`. A gateway that is down is not an error: it starts on
    the champion next time."""
    if ops.reload_gateway(cfg, version, checkpoint) is None:
        get_run_logger().warning("gateway at %s is not running; it will load v%d when it starts",
                                 cfg.gateway_url, version)
        return False
    return True
