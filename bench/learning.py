"""Proof of learning: does talking to a persona change the agent? One persona, K rounds of
collect → train → promote → reload on the embedded stack, measured after every version.

Parts, all real: the gateway (`clawflow serve`, TorchEngine) as its own process; the persona
environment driving episodes through it (`collect_round`); the Prefect flow
`train-on-new-feedback` run in-process against a temporary Prefect API (Prefect's
`prefect_test_harness`, or the API in PREFECT_API_URL with `--prefect-api env`), which judges
(embedded judge by default), trains with torchrun, registers in MLflow, gates, promotes and
reloads the gateway. Each round's episodes ask `n` replies to their first prompt (a GRPO group);
each member's preference check is its env_reward, joined to its turn by the catalog.

After every version (v0 = the base model), on held-out data (configs/envs/learning_bench.yaml):
preference hit-rate and mean judge score of greedy replies to fresh prompts, and the mean NLL per
token of reference answers (general quality; lower is better). One row per version is printed and
logged to MLflow (experiment `learning-bench`, metrics with step = version, so the UI plots curves).

    .venv/bin/python bench/learning.py --mode rl [--persona terse --rounds 4 --max-steps 16]

The baseline is version 0 (the base model), measured in the same run. Time and machine load
(1-minute load average before/after) are printed with the table.

Bench settings (overrides of the product config, not new defaults): lr 3e-5 (the product's 1e-6
is for slow drift on live traffic; 5e-5 with 10 steps in one round moved the probe KL to 0.30 and
the gate rejected it), groups of 8 (SmolLM2-135M meets a 30-word limit in ~1 of 8 samples at
temperature 1, and a group with no hit carries no GRPO signal), 48 reply tokens (a cut-off reply
is ~35 words, so it fails the limit), 384 response tokens per step (~3 steps per round), torch
threads 1 (on a shared 2-core box, 2 threads spin against other processes: 10x slower decoding).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # flows/ and tasks/ are importable when run as a script

from clawflow.config import REPO_ROOT, Config, load_config  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["rl", "opd", "combined"], default="rl")
    ap.add_argument("--persona", default="terse")
    ap.add_argument("--rounds", type=int, default=4, help="collect → train rounds (K)")
    ap.add_argument("--max-steps", type=int, default=16, help="stop once this many optimizer steps were taken")
    ap.add_argument("--episodes", type=int, default=4, help="episodes (first prompts) per round")
    ap.add_argument("--group-n", type=int, default=8, help="replies sampled per first prompt (GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=48, help="reply budget while collecting")
    ap.add_argument("--eval-max-tokens", type=int, default=48)
    ap.add_argument("--eval-prompts", type=int, default=10, help="how many held-out prompts to measure on")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--step-tokens", type=int, default=384, help="response tokens per optimizer step")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the gateway, trainer and evaluation (1: no spinning on a busy box)")
    ap.add_argument("--judge", choices=["embedded", "rules"], default="embedded")
    ap.add_argument("--config", default=str(REPO_ROOT / "configs" / "default.yaml"), help="base config")
    ap.add_argument("--home", default=None, help="bench data dir (default: a new temp dir)")
    ap.add_argument("--model-cache", default=os.environ.get("CLAWFLOW_HOME", str(REPO_ROOT / ".clawflow")),
                    help="a CLAWFLOW_HOME whose models/ holds (or will hold) the materialized base model")
    ap.add_argument("--prefect-api", choices=["harness", "env"], default="harness")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(a: argparse.Namespace, home: Path) -> Config:
    """The base config with the bench's overrides, written under `home` and loaded."""
    raw = yaml.safe_load(Path(a.config).read_text())
    raw["home"] = str(home)
    raw.setdefault("serving", {}).update(port=_free_port(), threads=a.threads)
    raw.setdefault("train", {}).update(lr=a.lr, objective=a.mode, step_tokens=a.step_tokens, epochs=a.epochs,
                                       threads=a.threads)
    raw.setdefault("judge", {}).update(backend=a.judge)
    if a.judge == "embedded":  # its head, fitted once for this run when the shipped one is stale
        head = judge_head(Path(a.model_cache))
        raw["judge"]["embedded"] = {**(raw["judge"].get("embedded") or {}), "head": str(head)}
    raw.setdefault("registry", {})
    raw["envs"] = {**(raw.get("envs") or {}), "environments": ["persona"], "personas": [a.persona],
                   "max_turns": 2, "group_n": a.group_n, "max_tokens": a.max_tokens, "temperature": a.temperature,
                   "concurrency": a.episodes, "seed": a.seed}
    path = home / "bench-config.yaml"
    path.write_text("# written by bench/learning.py\n" + yaml.safe_dump(raw, sort_keys=False))
    return load_config(path)


def judge_head(cache: Path) -> Path:
    """The embedded judge's head: the shipped file when it matches configs/judge/, else fitted once
    into `cache` by its data hash (the judge would otherwise refit it in memory in every flow run)."""
    from clawflow.config import EmbeddedJudgeConfig, JudgeConfig
    from clawflow.judge.embedded import _load_head, _paths, build, data_hash

    shipped, exemplars, labelled = _paths(JudgeConfig())
    digest = data_hash(exemplars, labelled)
    if _load_head(shipped, digest) is not None:
        return shipped
    head = cache / "judge-heads" / f"{digest[:16]}.safetensors"
    if not head.exists():
        head.parent.mkdir(parents=True, exist_ok=True)
        build(JudgeConfig(embedded=EmbeddedJudgeConfig(head=head)))
    return head


def link_base_model(cfg: Config, cache_home: Path) -> str:
    """Materialize the base model once under `cache_home` (clawflow.models) and link it into the
    bench home, so every run starts from the same weights without re-converting them."""
    from clawflow.models import base_model_dir

    if not (cfg.model.gguf or cfg.model.tiny):
        return base_model_dir(cfg)
    src = Path(base_model_dir(cfg.model_copy(update={"home": cache_home})))
    dst = cfg.home / "models" / cfg.model.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():
        dst.symlink_to(src, target_is_directory=True)
    return base_model_dir(cfg)


@contextlib.contextmanager
def gateway(cfg: Config):
    """`clawflow serve` as a child process; SIGTERM on exit (it seals what it recorded)."""
    from clawflow.stack import wait_http

    log = open(cfg.home / "gateway.log", "ab")
    env = {**os.environ, "CLAWFLOW_HOME": str(cfg.home)}
    proc = subprocess.Popen([sys.executable, "-m", "clawflow.cli", "serve", "--config", str(cfg.source_file)],
                            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{cfg.gateway_url}/healthz", 300, "gateway",
                  failed=lambda: proc.poll() is not None and f"exited {proc.returncode}, see {cfg.home}/gateway.log")
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
        log.close()


def _admin(cfg: Config) -> dict:
    return {"Authorization": f"Bearer {cfg.serving.admin_key}"}


def measure(cfg: Config, persona, wording, held, judge, model_dir: str, eval_max_tokens: int) -> dict:
    from clawflow.envs import evaluation as E

    replies = E.served_replies(cfg.gateway_url, cfg.serving.api_key, cfg.model.name, held.eval_prompts,
                               eval_max_tokens)
    return {"hit_rate": E.hit_rate(persona, replies),
            "judge_score": E.judge_score(judge, persona, wording, held.eval_prompts, replies),
            "ref_nll": E.reference_nll(model_dir, held.references, cfg.serving.threads),
            "mean_words": sum(len(r.split()) for r in replies) / len(replies), "example": replies[0][:80]}


def run(cfg: Config, rounds: int, max_steps: int, episodes: int, eval_max_tokens: int, seed: int = 0,
        say=print, eval_prompts: int | None = None) -> tuple[str, list[dict]]:
    """The round loop on a written config (gateway started here; a Prefect API must be reachable).
    Returns the MLflow run id of the curve and one row per measured version."""
    from clawflow import registry
    from clawflow.envs import build_envs
    from clawflow.envs.collect import collect_round
    from clawflow.envs.evaluation import load_held_out
    from clawflow.envs.personas import load_personas
    from clawflow.judge import make_judge
    from clawflow.models import base_model_dir
    from flows.train_on_new_feedback import train_on_new_feedback

    [persona], wording = load_personas(cfg.envs.personas_file, cfg.envs.personas)
    held = load_held_out(training_prompts=persona.prompts)
    held.eval_prompts = held.eval_prompts[:eval_prompts]
    judge = make_judge(cfg)
    envs = build_envs(cfg)
    rng = random.Random(seed)
    t0 = time.monotonic()
    rows: list[dict] = []
    run_id = _mlflow_run(cfg, episodes, rounds)
    with gateway(cfg):
        version, path, steps = 0, base_model_dir(cfg), 0
        for k in range(rounds + 1):
            if not rows or rows[-1]["version"] != version:  # a version the gate rejected is not served
                t_eval = time.monotonic()
                m = measure(cfg, persona, wording, held, judge, path, eval_max_tokens)
                m["eval_s"] = round(time.monotonic() - t_eval, 1)
                row = {"version": version, "round": k, "steps": steps, "wall_s": round(time.monotonic() - t0, 1), **m}
                rows.append(row)
                _log_row(cfg, run_id, row)
                say(_fmt(row))
            if k == rounds or steps >= max_steps:
                break
            t_round = time.monotonic()
            results = collect_round(cfg, envs, episodes, rng)
            t_collect = time.monotonic() - t_round
            if failed := [r.error for r in results if r.error]:
                raise RuntimeError(f"{len(failed)} episodes failed: {failed[0]}")
            httpx.post(f"{cfg.gateway_url}/admin/seal", headers=_admin(cfg), timeout=120).raise_for_status()
            try:
                out = train_on_new_feedback(str(cfg.source_file), reload=True)
            except Exception as exc:  # noqa: BLE001 - report the curve so far, with the reason
                say(f"  round {k + 1}: train-on-new-feedback failed: {str(exc).splitlines()[0][:300]}")
                break
            if not out.get("trained"):
                say(f"  round {k + 1}: not trained ({out.get('reason')})")
                continue
            done = json.loads((cfg.home / "checkpoints" / out["mlflow_run"] / "train_metrics.json").read_text())
            steps += int(done["steps"])
            say(f"  round {k + 1}: v{out['version']} from {out['samples']} samples, {done['steps']} steps, "
                f"reward mean {out['reward_mean']:+.3f}, gate: {out['gate']}, promoted={out['promoted']}; "
                f"collect {t_collect:.0f} s, flow {time.monotonic() - t_round - t_collect:.0f} s")
            if out["promoted"] and out["reloaded"]:
                version, path = registry.resolve(cfg, out["version"])
    registry.end_run(cfg, run_id)
    return run_id, rows


def _mlflow_run(cfg: Config, episodes: int, rounds: int) -> str:
    from clawflow import registry

    exp = cfg.registry.experiment
    bench_cfg = cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"experiment": "learning-bench"})})
    run = registry.start_run(bench_cfg, f"learning-{cfg.train.objective}-{cfg.envs.personas[0]}", {
        "mode": cfg.train.objective, "persona": cfg.envs.personas[0], "lr": cfg.train.lr, "rounds": rounds,
        "episodes": episodes, "group_n": cfg.envs.group_n, "max_tokens": cfg.envs.max_tokens,
        "step_tokens": cfg.train.step_tokens, "judge": cfg.judge.backend, "model": cfg.model.name,
        "training_experiment": exp}, {"clawflow.bench": "learning"})
    return run


def _log_row(cfg: Config, run_id: str, row: dict) -> None:
    from clawflow.registry import _client

    client = _client(cfg)
    for key in ("hit_rate", "judge_score", "ref_nll", "mean_words", "steps", "wall_s"):
        client.log_metric(run_id, key, float(row[key]), step=int(row["version"]))


HEADER = (f"{'ver':>3} {'round':>5} {'steps':>5} {'hit_rate':>8} {'judge':>6} {'ref_nll':>7} {'words':>6} "
          f"{'wall_s':>7} {'eval_s':>6}  example")


def _fmt(r: dict) -> str:
    return (f"{r['version']:>3} {r['round']:>5} {r['steps']:>5} {r['hit_rate']:>8.3f} {r['judge_score']:>+6.2f} "
            f"{r['ref_nll']:>7.3f} {r['mean_words']:>6.1f} {r['wall_s']:>7.1f} {r['eval_s']:>6.1f}  "
            f"{json.dumps(r['example'])}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the gateway child on the way out
    for var, value in (("MLFLOW_DISABLE_TELEMETRY", "true"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
                       ("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")):
        os.environ.setdefault(var, value)
    home = Path(a.home or tempfile.mkdtemp(prefix=f"clawflow-learning-{a.mode}-")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["CLAWFLOW_HOME"] = str(home)  # the flow, torchrun and the gateway all read this config's home
    cfg = write_config(a, home)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    link_base_model(cfg, Path(a.model_cache).resolve())
    print(f"learning bench: mode={a.mode} persona={a.persona} lr={a.lr} episodes={a.episodes}x{a.group_n} "
          f"threads={a.threads} "
          f"max_tokens={a.max_tokens} step_tokens={a.step_tokens} judge={a.judge} home={home}")
    print(f"machine: {os.cpu_count()} cores, load average {load0:.2f} at start")
    print(HEADER)
    if a.prefect_api == "harness":
        from prefect.testing.utilities import prefect_test_harness

        harness = prefect_test_harness(server_startup_timeout=180)
    else:
        harness = contextlib.nullcontext()
    with harness:
        _, rows = run(cfg, a.rounds, a.max_steps, a.episodes, a.eval_max_tokens, a.seed,
                      say=lambda line: print(line, flush=True), eval_prompts=a.eval_prompts)
    wall = time.monotonic() - t0
    first, last = rows[0], rows[-1]
    print(f"hit-rate v{first['version']} {first['hit_rate']:.3f} -> v{last['version']} {last['hit_rate']:.3f} "
          f"in {last['steps']} steps; ref NLL {first['ref_nll']:.3f} -> {last['ref_nll']:.3f} "
          f"({last['ref_nll'] / first['ref_nll']:.3f}x base); wall {wall / 60:.1f} min; "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
