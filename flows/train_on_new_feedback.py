"""train-on-new-feedback: collect batch → judge → train → register → gate → promote → commit → reload.

Triggered by `clawflow.shard.sealed` events (see prefect.yaml) or by hand:
    prefect deployment run train-on-new-feedback/train-on-new-feedback
"""

from __future__ import annotations

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact

from clawflow.config import load_config
from clawflow.feedback import training_samples
from tasks.policy import gate_candidate
from tasks.training import (collect_batch, commit_consumption, current_policy, judge_turns, maintain_store, promote,
                            register, release_unjudged, reload_gateway, start_run, train_policy)


@flow(name="train-on-new-feedback", log_prints=True)
def train_on_new_feedback(config_path: str | None = None, max_turns: int | None = None,
                          reload: bool = True) -> dict:
    """Train the served policy on the feedback its conversations received since the last run."""
    cfg = load_config(config_path)
    log = get_run_logger()
    pairs = collect_batch(cfg, max_turns or cfg.train.max_turns)
    if not pairs:
        return _report({"trained": False, "reason": "no new turns with a next state"})

    judgments = judge_turns(cfg, pairs)
    if not judgments:  # judge unavailable: the turns go back to the queue for the next run
        release_unjudged(cfg)
        return _report({"trained": False, "reason": "judge unavailable; turns stay unjudged", "turns": len(pairs)})
    samples = training_samples(pairs, judgments)
    parent, base = current_policy(cfg)
    turn_ids = [j["turn_id"] for j in judgments]  # only judged turns are consumed
    if not samples:
        # Judged but neutral: nothing to learn; consume them so they are not judged again.
        commit_consumption(cfg, turn_ids, f"neutral-{runtime.flow_run.id}", parent)
        if len(judgments) < len(pairs):
            release_unjudged(cfg)
        return _report({"trained": False, "reason": "all turns judged neutral", "turns": len(pairs)})

    run_id = start_run(cfg, str(runtime.flow_run.id), parent, pairs, judgments)
    checkpoint, metrics = train_policy(cfg, run_id, base, samples, parent)
    rewards = [s["reward"] for s in samples]
    version = register(cfg, run_id, checkpoint, parent, len(samples), sum(rewards) / len(rewards))
    gate = gate_candidate(cfg, version, str(checkpoint), base)
    if gate.passed:
        promote(cfg, version)
    # Consumed either way: a rejected version's turns would train the same rejected step again.
    commit_consumption(cfg, turn_ids, run_id, version)
    if len(judgments) < len(pairs):
        release_unjudged(cfg)
    maintain_store(cfg)
    reloaded = reload_gateway(cfg, version, str(checkpoint)) if reload and gate.passed else False
    log.info("v%d trained on %d samples from v%d: %s", version, len(samples), parent, gate.reason)
    last = metrics.get("per_step") or [{}]
    return _report({"trained": True, "version": version, "parent": parent, "turns": len(pairs),
                    "samples": len(samples), "reward_mean": sum(rewards) / len(rewards),
                    "promoted": gate.passed, "gate": gate.reason, "mlflow_run": run_id,
                    "reloaded": reloaded, "loss": last[-1].get("loss")})


def _report(summary: dict) -> dict:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    create_markdown_artifact(markdown=f"| field | value |\n|---|---|\n{rows}\n", key="training-summary",
                             description="What this training run consumed and produced")
    return summary


if __name__ == "__main__":
    print(train_on_new_feedback())
