"""train-on-new-feedback: collect batch → judge → standing preferences → train → gate (doses) → register →
promote → commit → reload → prepare the next run's rewrites.

Triggered by `clawflow.shard.sealed` events (see prefect.yaml) or by hand:
    prefect deployment run train-on-new-feedback/train-on-new-feedback
Progress is the `training-progress` artifact (percent per phase); the summary is `training-summary`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from clawflow.config import load_config
from clawflow.feedback import training_samples
from clawflow.policy import registry
from clawflow.policy.holdout import split_holdout
from tasks.policy import gate_doses, held_out_probes, tag_gate
from tasks.training import (claim_id, collect_batch, commit_consumption, current_policy, judge_turns, maintain_store,
                            prepare_next_run, promote, record_preferences, register, release_unjudged, reload_gateway,
                            start_run, train_policy, update_preferences, user_of, waiting_users)


class Progress:
    """The run's `training-progress` artifact: percent done and the phase, updated as it goes."""

    def __init__(self) -> None:
        self.id = create_progress_artifact(0.0, key="training-progress", description="collecting the batch")

    def __call__(self, percent: float, phase: str) -> None:
        update_progress_artifact(self.id, percent, description=phase)


class Clock:
    """Seconds per phase of one run, so a user (and `bench/learning.py`) sees where a round's time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.monotonic() - t0, 1)


@flow(name="train-on-new-feedback", log_prints=True)
def train_on_new_feedback(config_path: str | None = None, max_turns: int | None = None,
                          reload: bool = True, user: str | None = None) -> dict:
    """Train on the feedback conversations received since the last run: each user's turns train
    that user's own version line (their adapter; the default user's is the shared policy), one user
    after another. `user`: only that user's line. Without `train.lora` there are no per-user
    adapters: every user's turns train the shared policy, as before users existed."""
    cfg = load_config(config_path)
    log = get_run_logger()
    if cfg.train.lora is None:
        if user is not None:
            raise ValueError("per-user training needs train.lora: users' own adapters are LoRA adapters")
        return _train_line(cfg, None, max_turns, reload)
    waiting = waiting_users(cfg)
    enough = {u for u, n in waiting.items() if n >= cfg.train.min_turns}
    if waiting:
        log.info("turns waiting per user: %s (train.min_turns %d)", ", ".join(f"{u} {n}" for u, n in
                                                                             sorted(waiting.items())),
                 cfg.train.min_turns)
    users = [user] if user is not None else sorted(enough, key=lambda u: (u != cfg.serving.user, u))
    if not users:
        return _report({"trained": False, "reason": "no user has train.min_turns new turns with a next state"
                        if waiting else "no new turns with a next state", "waiting": waiting}, Progress())
    results = {u: _train_line(registry.for_user(cfg, u), [u], max_turns, reload) for u in users}
    if len(results) == 1:
        return next(iter(results.values()))
    return {"trained": any(r["trained"] for r in results.values()), "users": results,
            "reason": "; ".join(f"{u}: {r.get('gate') or r.get('reason')}" for u, r in results.items())}


def _train_line(cfg, users: list[str] | None, max_turns: int | None, reload: bool) -> dict:
    """One version line's run: `users`' turns (None: everyone's) train `cfg.registry.user`'s line."""
    log = get_run_logger()
    progress, clock = Progress(), Clock()
    with clock("collect"):
        pairs = collect_batch(cfg, max_turns or cfg.train.max_turns, users)
    if not pairs:
        return _report({"trained": False, "reason": "no new turns with a next state"}, progress)

    progress(10, f"judging {len(pairs)} turns")
    with clock("judge"):
        judgments = judge_turns(cfg, pairs)
    if not judgments:  # judge unavailable: the turns go back to the queue for the next run
        release_unjudged(cfg)
        return _report({"trained": False, "reason": "judge unavailable; turns stay unjudged", "turns": len(pairs)},
                       progress)
    trainable, held_out = split_holdout(judgments, cfg.gate.holdout_fraction)  # held out: the gate's probes
    samples = training_samples(pairs, trainable)
    with clock("preferences"):
        preferences = update_preferences(cfg, pairs, judgments)  # the user's standing preferences, this batch folded in
        parent, start, champion = current_policy(cfg, preferences)
    turn_ids = [j.turn_id for j in judgments]  # only judged turns are consumed (held-out ones too)
    if not samples and not preferences:
        # Judged but neutral: nothing to learn; consume them so they are not judged again.
        _consume(cfg, turn_ids, f"neutral-{claim_id(cfg)}", parent, all_judged=len(judgments) == len(pairs))
        reason = "all turns judged neutral" if not held_out else "no trainable turns (neutral or held out for the gate)"
        return _report({"trained": False, "reason": reason, "turns": len(pairs)}, progress)

    progress(25, f"training on {len(samples)} samples and {len(preferences)} standing preferences from v{parent}")
    run_id = start_run(cfg, str(runtime.flow_run.id), parent, pairs, judgments)
    with clock("train"):
        checkpoint, metrics = train_policy(cfg, run_id, start, samples, parent, preferences)
    if checkpoint is None:  # the recipe found no usable advantage or hint: consume, nothing to register
        _consume(cfg, turn_ids, f"untrainable-{claim_id(cfg)}", parent, all_judged=len(judgments) == len(pairs))
        return _report({"trained": False, "reason": metrics["reason"], "turns": len(pairs),
                        "samples": len(samples)}, progress)
    taught = record_preferences(cfg, run_id, checkpoint, preferences)["taught"]
    trained_ids = [s.turn_id for s in samples]
    progress(65, f"eval gate: the candidate at doses {', '.join(f'{d:g}' for d in cfg.gate.doses)} vs v{parent}")
    with clock("gate"):
        gate = gate_doses(cfg, run_id, str(checkpoint), champion, held_out_probes(cfg, trained_ids, users), taught)
    progress(85, "registering the checkpoint")
    rewards = [s.reward for s in samples] or [0.0]
    with clock("register"):
        version = register(cfg, run_id, Path(gate.checkpoint), parent, len(samples), sum(rewards) / len(rewards),
                           trained_ids)
        tag_gate(cfg, version, gate)
    progress(90, "promoting" if gate.passed else "rejected: committing the batch")
    if gate.passed:
        promote(cfg, version)
    # Consumed either way: a rejected version's turns would train the same rejected step again.
    _consume(cfg, turn_ids, run_id, version, all_judged=len(judgments) == len(pairs))
    maintain_store(cfg)
    progress(95, f"reloading the gateway on v{version}" if gate.passed else "done")
    with clock("reload"):
        reloaded = reload_gateway(cfg, version, gate.checkpoint) if reload and gate.passed else False
    log.info("v%d trained on %d samples and %d preferences from v%d: %s", version, len(samples), len(preferences),
             parent, gate.reason)
    log.info("where the time went: %s", ", ".join(f"{k} {v:.0f} s" for k, v in clock.seconds.items()))
    # after the served weights: the next run's rewrites, written while the user talks (not round time)
    progress(97, "preparing the next run's rewrites")
    prepared = prepare_next_run(cfg, *current_policy(cfg, preferences)[:2], preferences) \
        if cfg.train.prepare_next else {"prepared": False, "reason": "train.prepare_next is off"}
    last = metrics.get("per_step") or [{}]
    return _report({"trained": True, "user": user_of(cfg), "version": version, "parent": parent, "turns": len(pairs),
                    "samples": len(samples), "preferences": len(preferences), "held_out": len(held_out),
                    "reward_mean": sum(rewards) / len(rewards), "promoted": gate.passed, "dose": gate.dose,
                    "gate": gate.reason, "mlflow_run": run_id, "reloaded": reloaded, "loss": last[-1].get("loss"),
                    "seconds": clock.seconds, "rewrite_seconds": metrics.get("rewrite_seconds"),
                    "prepared": prepared["prepared"], "prepare_reason": prepared.get("reason"),
                    "prepare_seconds": prepared.get("seconds")},
                   progress)


def _consume(cfg, turn_ids: list[str], consumer: str, version: int, all_judged: bool) -> None:
    """Mark the judged turns used; turns the judge skipped go back to the queue for the next run."""
    commit_consumption(cfg, turn_ids, consumer, version)
    if not all_judged:
        release_unjudged(cfg)


def _report(summary: dict, progress: Progress) -> dict:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    create_markdown_artifact(markdown=f"| field | value |\n|---|---|\n{rows}\n", key="training-summary",
                             description="What this training run consumed and produced")
    progress(100, "done: " + (f"v{summary['version']}" if summary.get("trained") else summary["reason"]))
    return summary


if __name__ == "__main__":
    print(train_on_new_feedback())
