"""Tasks that decide which policy serves: the eval gate, rollback, evaluation of versions,
provisioning of the base model. (The always-on restart guard is tasks/restarts.py.)"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from clawflow.base_model import base_model_dir
from clawflow.config import Config
from clawflow.home import Home
from clawflow.policy import registry, reload
from clawflow.policy.gate import DoseVerdict, GateResult, evaluate, evaluate_doses
from clawflow.policy.holdout import ProbeTurn, held_out_turns
from clawflow.store.catalog import Catalog


def helpfulness_cache(cfg: Config):
    from clawflow.policy.warm import gate_cache

    return gate_cache(cfg)


@task(name="held-out-probes", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def held_out_probes(cfg: Config, batch_turn_ids: list[str], users: list[str] | None = None) -> list[ProbeTurn]:
    """The newest judged turns the candidate did not train on (clawflow/policy/holdout.py); `users`:
    only theirs (a version line is gated on the turns of the users it trains on)."""
    g = cfg.gate
    turns = held_out_turns(Catalog.for_config(cfg), g.judged_probes, batch_turn_ids, g.holdout_fraction, users)
    get_run_logger().info("%d held-out judged turns (%d good, %d bad) for the gate", len(turns),
                          sum(t.score > 0 for t in turns), sum(t.score < 0 for t in turns))
    return turns


@task(name="eval-gate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="gate-v{version}")
def gate_candidate(cfg: Config, version: int, candidate: str, champion: str,
                   judged: list[ProbeTurn] | None = None) -> GateResult:
    """Evaluate the candidate against the champion; tag the version with the verdict."""
    result = evaluate(cfg.gate, candidate, champion, judged, base_model_dir(cfg), helpfulness_cache(cfg))
    tags = {f"eval.{k}": f"{v:.6g}" for k, v in result.metrics.items()}
    tags["gate"] = "passed" if result.passed else "rejected"
    tags["gate_reason"] = result.reason
    if not result.passed:
        tags["rejected"] = result.reason
    registry.tag_version(cfg, version, tags)
    log = get_run_logger()
    (log.info if result.passed else log.warning)("v%d %s: %s", version, tags["gate"], result.reason)
    return result


@task(name="eval-gate-doses", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="gate-{run_id}")
def gate_doses(cfg: Config, run_id: str, candidate: str, champion: str, judged: list[ProbeTurn] | None = None,
               taught: str = "") -> DoseVerdict:
    """The candidate at each of `gate.doses`, strongest first (clawflow/policy/gate.py
    `evaluate_doses`); every dose's figures go to the MLflow run (`dose_<d>.<measure>`)."""
    work = Home(cfg.home).checkpoints / f"{run_id}.doses"
    verdict = evaluate_doses(cfg.gate, candidate, champion, work, judged, base_model_dir(cfg),
                             helpfulness_cache(cfg), taught)
    registry.log_metrics(cfg, run_id, [], {f"dose_{d:g}.{k}": v for d, m in verdict.per_dose.items()
                                           for k, v in m.items()} | {"gate.dose": verdict.dose or 0.0})
    log = get_run_logger()
    for d, m in verdict.per_dose.items():
        log.info("dose %g: %s", d, ", ".join(f"{k} {v:.4g}" for k, v in m.items() if k in DOSE_SHOWN))
    (log.info if verdict.passed else log.warning)("gate: %s", verdict.reason)
    return verdict


@task(name="tag-gate-verdict", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      task_run_name="tag-v{version}")
def tag_gate(cfg: Config, version: int, verdict: DoseVerdict) -> None:
    """The verdict on the version's tags; a promoted one's measures on the champion's running chart."""
    registry.tag_version(cfg, version, dose_tags(verdict))
    if verdict.passed:
        m = verdict.metrics
        registry.log_champion(cfg, version, {k: m[src] for k, src in (
            ("facts", "help_facts_rate"), ("preference_gain", "pref_gain"), ("dose", "dose"), ("probe_kl", "probe_kl"))
            if src in m})


DOSE_SHOWN = ("pref_gain", "help_facts_rate", "probe_kl", "help_facts_rate_champion")


def dose_tags(verdict: DoseVerdict) -> dict[str, str]:
    """Version tags of a dosed verdict: `gate`, `gate_reason`, `dose`, `eval.*` of the chosen (or
    strongest) dose, and `doses` (every measured dose's preference measure and facts, one line)."""
    tags = {f"eval.{k}": f"{v:.6g}" for k, v in verdict.metrics.items()}
    tags["gate"] = "passed" if verdict.passed else "rejected"
    tags["gate_reason"] = verdict.reason
    tags["dose"] = f"{verdict.dose:g}" if verdict.dose else "none"
    tags["doses"] = "; ".join(f"{d:g}: " + ", ".join(f"{k}={m[k]:.4g}" for k in ("pref_gain", "help_facts_rate")
                                                      if k in m) for d, m in verdict.per_dose.items())
    if not verdict.passed:
        tags["rejected"] = verdict.reason
    return tags


@task(name="rollback-champion", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def rollback_champion(cfg: Config, target: int | str | None) -> dict[str, Any]:
    return reload.rollback(cfg, target)


@task(name="evaluate-version", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5,
      task_run_name="evaluate-v{version}")
def evaluate_version(cfg: Config, version: int, champion: tuple[int, str]) -> dict[str, Any]:
    _, path = registry.resolve_local(cfg, version)
    champion_dir = registry.checkpoint_dir(cfg, *champion)  # fetched when the registry is a server
    result = evaluate(cfg.gate, path, champion_dir, None, base_model_dir(cfg), helpfulness_cache(cfg))
    registry.tag_version(cfg, version, {f"eval_vs_v{champion[0]}.{k}": f"{v:.6g}" for k, v in result.metrics.items()})
    return {"version": version, "vs": champion[0], "passed": result.passed, "reason": result.reason, **result.metrics}


@task(name="provision-base-model", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def provision_policy(cfg: Config) -> tuple[int, str]:
    """First start: the base model on disk and registered (version 1, `champion`); then a no-op."""
    return reload.provision(cfg)
