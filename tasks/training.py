"""Tasks of `train-on-new-feedback`. Each does one thing; retries where I/O can fail."""

from __future__ import annotations

import json
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawflow import events
from clawflow.base_model import base_model_dir
from clawflow.config import Config
from clawflow.contracts.judgment import Judged
from clawflow.contracts.pair import Pair
from clawflow.contracts.sample import Sample, write_samples
from clawflow.feedback import judge_pairs, keep_samples
from clawflow.home import Home
from clawflow.judge import make_judge
from clawflow.judge.stats import combine_reward, judge_stats
from clawflow.judge.store import JudgmentStore
from clawflow.policy import registry, reload
from clawflow.policy.lineage import lineage_tags, shards_of
from clawflow.policy.loader import is_adapter
from clawflow.store.catalog import Catalog
from clawflow.store.storage import Storage
from clawflow.train.launch import EXIT_NO_SAMPLES, TrainingError, run_training


def catalog(cfg: Config) -> Catalog:
    return Catalog.for_config(cfg)


def claim_id(cfg: Config) -> str:
    """This flow run's claim on the turns of the user it trains now (one claim per user: a run
    trains several users one after another)."""
    from prefect import runtime

    run = str(runtime.flow_run.id or f"manual-{uuid.uuid4().hex}")
    return run if cfg.registry.user is None else f"{run}:{cfg.registry.user}"


@task(name="waiting-users", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def waiting_users(cfg: Config) -> dict[str, int]:
    """{user: turns with a next state waiting}: whose version lines this run trains."""
    return catalog(cfg).pending_users()


@task(name="collect-batch", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      task_run_name="collect-batch-{cfg.registry.user}")
def collect_batch(cfg: Config, max_turns: int, users: list[str] | None = None) -> list[Pair]:
    """Unconsumed main turns that have a next state, oldest first (`users`: only theirs), claimed
    for this flow run: a retry of the run gets the same batch back, other runs skip it until it
    is committed."""
    pairs = catalog(cfg).select_batch(claim_id(cfg), max_turns, cfg.store.batch_max_tokens, users=users)
    get_run_logger().info("%d turns with a next state are waiting%s", len(pairs),
                          f" from {', '.join(users)}" if users else "")
    return pairs


@task(name="judge-turns", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      task_run_name="judge-{cfg.judge.backend}")
def judge_turns(cfg: Config, pairs: list[Pair]) -> list[Judged]:
    """Judgments of the turns the judge answered, stored under $CLAWFLOW_HOME/judgments and reused
    per judge version; turns it could not answer are left out and judged on a later run."""
    jc = cfg.judge
    combine = partial(combine_reward, mode=jc.env_reward, weight=jc.env_reward_weight)
    judgments = judge_pairs(make_judge(cfg), pairs, jc.concurrency, JudgmentStore.for_config(cfg), combine)
    scores = [j.score for j in judgments]
    log = get_run_logger()
    log.info("judged %d of %d turns (%d reused): %d good, %d bad, %d neutral", len(scores), len(pairs),
             sum(j.reused for j in judgments), scores.count(1), scores.count(-1), scores.count(0))
    if len(judgments) < len(pairs):
        log.warning("%d turns stay unjudged (judge unavailable); the next run judges them",
                    len(pairs) - len(judgments))
    return judgments


@task(name="release-unjudged", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def release_unjudged(cfg: Config) -> int:
    """Drop this run's claim on the turns it did not consume (unjudged), so the next run takes them
    instead of waiting for the claim to expire."""
    return catalog(cfg).release(claim_id(cfg))


def user_of(cfg: Config) -> str:
    """Whose policy this run trains: the user of its registry line, or the default user (the API
    key's owner whose line is the shared policy)."""
    return cfg.registry.user or getattr(cfg.serving, "user", None) or "default"


def rewrites_dir(cfg: Config) -> Path:
    """Where the rewrites of this line's runs are cached (a user's own line: their own directory,
    so preparing one user's next run never prunes another's)."""
    home = Home(cfg.home)
    return home.rewrites if cfg.registry.user is None else home.user_rewrites(cfg.registry.user)


@task(name="update-preferences", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def update_preferences(cfg: Config, pairs: list[Pair], judgments: list[Judged]) -> list[dict]:
    """The hints of turns judged −1 folded into their users' standing preferences (clawflow/prefs:
    merged, superseded, or refused with the reason logged); this run's user's active preferences,
    strongest first, as the trainer reads them."""
    from clawflow.prefs.store import PreferenceStore
    from clawflow.prefs.update import NewHint

    store, by_id = PreferenceStore.for_config(cfg), {p.turn_id: p for p in pairs}
    hints = [NewHint(getattr(by_id.get(j.turn_id), "user", None) or user_of(cfg), j.hint, j.session_id, j.turn_id,
                     _iso(getattr(by_id.get(j.turn_id), "created_at", None)))
             for j in judgments if j.score < 0 and j.hint is not None]
    log = get_run_logger()
    for line in store.add_hints(hints):
        (log.warning if " refused: " in line else log.info)("preferences: %s", line)
    active = [{"pref_id": p.pref_id, "text": p.text, "variants": [v.text for v in p.variants],
               "strength": p.strength, "sessions": p.sessions} for p in store.active(user_of(cfg))]
    log.info("%d standing preferences for %s: %s", len(active), user_of(cfg),
             "; ".join(f"{p['pref_id']} {p['text'][:40]!r}" for p in active) or "none")
    return active


def _iso(t) -> str:
    from datetime import datetime, timezone

    if t is None:
        return datetime.now(timezone.utc).isoformat()
    return t.isoformat() if hasattr(t, "isoformat") else str(t)


@task(name="record-preferences", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def record_preferences(cfg: Config, run_id: str, checkpoint: Path, preferences: list[dict]) -> dict:
    """What the trainer measured and taught (`preferences.json` beside the weights): strengths back
    onto the records, and the preferences logged as an input of the MLflow run."""
    from clawflow.prefs.store import PreferenceStore
    from clawflow.train.recipe import PREFERENCES_REPORT

    path = Path(checkpoint) / PREFERENCES_REPORT
    report = json.loads(path.read_text()) if path.is_file() else {"taught": "", "strengths": {}, "dropped": []}
    PreferenceStore.for_config(cfg).set_strengths(user_of(cfg), report.get("strengths", {}))
    registry.log_preferences(cfg, run_id, preferences, report)
    for d in report.get("dropped", []):
        get_run_logger().warning("preference %s (%r) was dropped for this run: %s", d["pref_id"], d["text"][:50],
                                 d["why"])
    return report


@task(name="serving-policy", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def current_policy(cfg: Config, preferences: list[dict] | None = None) -> tuple[int, str, str]:
    """(champion version, the weights to train from, the champion's checkpoint); the base model as
    version 0 when nothing is registered. When the champion learned a standing preference that has
    since been forgotten or superseded, this run starts from the base: the standing preferences
    that remain are distilled again in full (broad prompts), and the dropped one's effect is gone."""
    found = registry.champion(cfg)  # fetched (with its optimizer state) when the registry is a server
    line = cfg
    if not found and cfg.registry.user is not None:
        # a user's first adapter: from the shared policy that served them until now (the gate's
        # champion too), unless it learned preferences that are not theirs (then from the base)
        line = registry.for_user(cfg, None)
        found = registry.champion(line)
        if found:
            get_run_logger().info("%s's first adapter: the shared policy v%d served them so far", cfg.registry.user,
                                  found[0])
    if not found:
        return 0, base_model_dir(cfg), base_model_dir(cfg)
    champion = registry.checkpoint_dir(line, *found, trainer_state=True)
    parent = found[0] if line is cfg else 0  # a user's line starts at 0: its parent is in another line
    learned = registry.learned_preferences(line, found[0])
    gone = sorted(set(learned) - {p["pref_id"] for p in preferences or []})
    if gone:
        get_run_logger().warning("v%d learned preferences that are now forgotten, superseded or not %s's (%s): "
                                 "this run trains from the base", found[0], user_of(cfg), ", ".join(gone))
        return parent, base_model_dir(cfg), champion
    if line is not cfg and not is_adapter(champion):  # the registered base (v1): a fresh adapter on it
        return parent, base_model_dir(cfg), champion
    return parent, champion, champion


@task(name="start-mlflow-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def start_run(cfg: Config, flow_run: str, parent: int, pairs: list[Pair], judgments: list[Judged]) -> str:
    scores = [j.score for j in judgments]
    params = {"lr": cfg.train.lr, "epochs": cfg.train.epochs, "micro_batch": cfg.train.micro_batch,
              "eps_low": cfg.train.eps_low, "eps_high": cfg.train.eps_high, "nproc": cfg.train.nproc,
              "objective": cfg.train.objective, "teacher": cfg.train.teacher, "aggregation": cfg.train.aggregation,
              "kl_beta": cfg.train.kl_beta, "tis_cap": cfg.train.tis_cap, "step_tokens": cfg.train.step_tokens,
              "lora": cfg.train.lora.model_dump() if cfg.train.lora else None,
              "judge": judgments[0].judge if judgments else cfg.judge.backend,
              "turns": len(pairs), "first_turn_at": pairs[0].created_at, "last_turn_at": pairs[-1].created_at,
              "config": str(cfg.source_file)}
    tags = {"clawflow.parent_version": str(parent), "clawflow.prefect_flow_run": flow_run,
            "clawflow.user": user_of(cfg), "clawflow.registered_model": registry.model_name(cfg),
            "clawflow.reward_mean": f"{sum(scores) / max(len(scores), 1):.4f}"}
    run_id = registry.start_run(cfg, f"train-from-v{parent}", params, tags)
    registry.log_metrics(cfg, run_id, [], judge_stats(judgments, len(pairs)))
    return run_id


@task(name="train-policy", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="train-{run_id}", timeout_seconds=6 * 3600)
def train_policy(cfg: Config, run_id: str, base: str, samples: list[Sample],
                 parent: int = 0, preferences: list[dict] | None = None) -> tuple[Path | None, dict]:
    """torchrun subprocess from the champion `base` (its weights, and its AdamW state when saved);
    the checkpoint appears atomically at $CLAWFLOW_HOME/checkpoints/<run_id>. A retry after an
    interruption resumes the run from `<run_id>.resume`. Step metrics go to the MLflow run.
    Returns (None, {"reason": ...}) when the recipe finds nothing to train on (e.g. every GRPO
    group has equal rewards, or OPD samples without a usable hint): a result, not a failure."""
    home = Home(cfg.home)
    batch = write_samples(samples, home.samples(run_id))
    keep_samples(Storage.for_config(cfg), run_id, batch)
    out = home.checkpoints / run_id
    done = out / "train_metrics.json"
    if done.exists():  # a retry after the checkpoint was written: reuse it, don't train twice
        metrics = json.loads(done.read_text())
    else:
        needs_base = cfg.train.teacher == "base" or cfg.train.kl_beta > 0  # the frozen base: teacher / KL ref
        prefs_file = None
        if preferences:
            prefs_file = batch.with_name("preferences.json")
            prefs_file.write_text(json.dumps(preferences))
        try:
            metrics = run_training(cfg.source_file, cfg, Path(base), batch, out, parent_version=parent,
                                   frozen_base=base_model_dir(cfg) if needs_base else None, preferences=prefs_file,
                                   cache_dir=rewrites_dir(cfg), broad_seed=registry.latest_version(cfg))
        except TrainingError as e:
            if e.returncode != EXIT_NO_SAMPLES:
                raise
            registry.end_run(cfg, run_id, "KILLED")
            return None, {"reason": "nothing to train: " + e.reason.split("): ", 1)[-1]}
    registry.log_metrics(cfg, run_id, metrics.get("per_step", []),
                         {k: v for k, v in metrics.items() if k != "per_step"})
    return out, metrics


@task(name="prepare-next-run", cache_policy=NO_CACHE, task_run_name="prepare-from-v{parent}")
def prepare_next_run(cfg: Config, parent: int, start: str, preferences: list[dict]) -> dict:
    """The rewrites the next run from `start` (version `parent`, the champion) will read, written now
    by a niced process (`recipe --prepare`) while the user talks, so the next round's training
    only rewrites its own corrected turns. It draws the general prompts the next run will draw
    (seeded by the newest version number, which the next run reads before it registers). Best
    effort: when it fails or the preferences change, the next run computes them itself."""
    import time

    from clawflow.train.launch import run_prepare
    from clawflow.train.objective import Objective
    from clawflow.train.rewrite_cache import prune
    from tasks.policy import helpfulness_cache

    t = cfg.train
    if not preferences or not (t.rehearsal or t.broad_prompts) or not Objective.from_config(t).rewrites:
        return {"prepared": False, "reason": "nothing the next run would rewrite before its batch"}
    rewrites = rewrites_dir(cfg)
    prefs_file = rewrites / "next-preferences.json"
    prefs_file.parent.mkdir(parents=True, exist_ok=True)
    prefs_file.write_text(json.dumps(preferences))
    t0 = time.monotonic()
    try:
        run_prepare(cfg.source_file, cfg, Path(start), prefs_file, rewrites, parent, registry.latest_version(cfg),
                    gate_cache=helpfulness_cache(cfg))
    except Exception as exc:  # noqa: BLE001 - best effort: the version is already served
        why = exc.reason if isinstance(exc, TrainingError) else f"{type(exc).__name__}: {exc}"
        get_run_logger().warning("preparing the next run failed; it will rewrite everything itself: %s", why)
        return {"prepared": False, "reason": why, "seconds": round(time.monotonic() - t0, 1)}
    seconds = round(time.monotonic() - t0, 1)
    prune(rewrites)  # the files of earlier champions
    get_run_logger().info("prepared the next run's rewrites from v%d in %.0f s", parent, seconds)
    return {"prepared": True, "seconds": seconds}


@task(name="register-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def register(cfg: Config, run_id: str, checkpoint: Path, parent: int, turns: int, reward_mean: float,
             turn_ids: list[str] | None = None) -> int:
    """A model version with lineage tags (parent, shards, turn count); the full lists in lineage.json."""
    shards = shards_of(catalog(cfg), turn_ids or [])
    registry.log_json(cfg, run_id, {"parent_version": parent, "shards": shards, "turn_ids": turn_ids or []},
                      "lineage.json")
    version = registry.register_checkpoint(
        cfg, run_id, checkpoint,
        {**lineage_tags(parent, shards, turns), "turns": str(turns), "reward_mean": f"{reward_mean:.4f}"})
    registry.end_run(cfg, run_id)
    events.emit(events.POLICY_REGISTERED, f"clawflow.policy.{registry.model_name(cfg)}.v{version}",
                {"version": version, "run_id": run_id, "path": str(checkpoint), "user": user_of(cfg)})
    return version


@task(name="promote-champion", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def promote(cfg: Config, version: int) -> int | None:
    previous = registry.promote(cfg, version)
    events.emit(events.POLICY_PROMOTED, f"clawflow.policy.{registry.model_name(cfg)}.v{version}",
                {"version": version, "previous": previous, "user": user_of(cfg)})
    return previous


@task(name="commit-consumption", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=2)
def commit_consumption(cfg: Config, turn_ids: list[str], run_id: str, version: int) -> int:
    """Exactly-once: turns are marked consumed together with the version they produced."""
    return catalog(cfg).commit_consumed(turn_ids, run_id, version)


@task(name="maintain-store", cache_policy=NO_CACHE)
def maintain_store(cfg: Config) -> dict[str, Any]:
    """Retention (never untrained turns, nor those of registered versions), then compaction.
    Best effort: a failure is logged and retried by the next run, never fails this one."""
    from clawflow.store.maintenance import apply_retention, compact

    s = cfg.store
    try:
        lines = [registry.for_user(cfg, None)] + [registry.for_user(cfg, u) for u in registry.user_lines(cfg)]
        # version numbers of every line: they overlap, so this keeps more turns, never fewer
        kept = sorted({v["version"] for line in lines for v in registry.list_versions(line)})
        retention = apply_retention(catalog(cfg), s.retention_days, s.retention_max_bytes, kept,
                                    row_group_rows=s.row_group_rows)
        merged = compact(catalog(cfg), s.compaction_target_bytes, s.row_group_rows)
    except Exception as exc:  # noqa: BLE001 - maintenance must not undo a committed training
        get_run_logger().warning("store maintenance failed, next run retries: %s", exc)
        return {"error": str(exc)}
    return {"turns_deleted": retention.deleted, "shards_compacted": sum(c.inputs for c in merged)}


@task(name="reload-gateway", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=3,
      task_run_name="reload-v{version}")
def reload_gateway(cfg: Config, version: int, checkpoint: str) -> bool:
    """Tell the gateway to serve `version`. A gateway that is down is not an error: it starts on
    the champion next time."""
    if reload.reload_gateway(cfg, version, checkpoint) is None:
        get_run_logger().warning("gateway at %s is not running; it will load v%d when it starts",
                                 cfg.gateway_url, version)
        return False
    return True
