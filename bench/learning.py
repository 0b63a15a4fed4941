"""Does talking to the agent make it better for that user, without making it worse at answering?

For each persona (a simulated user with a checkable preference: length, format, tone), K rounds of
collect → train → gate → promote → reload on the embedded stack, measured after every version:

  * hit-rate: the share of held-out prompts whose greedy reply meets every preference of the
    persona (configs/envs/learning_bench.yaml; never used to collect training turns);
  * helpfulness: the share of held-out general questions whose greedy reply states its key fact,
    and the degeneracy signals (same reply to different questions, loops, off-topic replies), by
    `clawflow.helpfulness` (configs/eval/helpfulness.yaml), the same measure the eval gate uses,
    and key facts on a second set the gate never reads (configs/eval/facts_bench.yaml);
  * per persona: the teacher's ceiling (best-of-N hinted base, as bench/teacher.py), the sessions
    until the preference held in 3 replies in a row while collecting, and every candidate as the
    gate saw it (promoted or not, the dose, the preference measure and facts at each dose).

Everything is the shipped product unless a flag says otherwise: `configs/default.yaml` (its
`train:` recipe, lr and gate), one reply per prompt (live users do not send groups), the embedded
judge, and no outcome reward (a live user gives words, not a checkable score: `judge.env_reward:
ignore`). Parts, all real: the gateway (`clawflow serve`) as its own process, the persona
environment driving episodes through it like any client, and the Prefect flow
`train-on-new-feedback` in-process against a temporary Prefect API (which judges, trains with
torchrun, registers in MLflow, gates, promotes and reloads the gateway).

One row per version (v0 = the base model) is printed and logged to MLflow (experiment
`learning-bench`, one run per persona, metrics with step = version), then a summary per persona:

    .venv/bin/python bench/learning.py                       # dev personas: terse, numbered_steps, curious_coach
    .venv/bin/python bench/learning.py --personas-file configs/envs/personas_final.yaml   # the final set
    .venv/bin/python bench/learning.py --personas terse --rounds 8 --set train.lr=3e-5     # a variant

Torch threads as the config ships them (torch's default: every core) unless `--threads N` pins each
process (gateway, trainer, evaluation) to N, e.g. 1 when the box is shared with other work.
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

DEV_PERSONAS = "terse,numbered_steps,curious_coach"  # length, format, tone


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--personas", default=None, help=f"comma-separated names (default: {DEV_PERSONAS}, or every "
                                                      "persona of --personas-file)")
    ap.add_argument("--personas-file", default=None, help="default configs/envs/personas.yaml")
    ap.add_argument("--rounds", type=int, default=8, help="collect → train rounds per persona")
    ap.add_argument("--target", type=float, default=0.9, help="stop a persona once its hit-rate reaches this")
    ap.add_argument("--episodes", type=int, default=12, help="conversations per round (2 turns each)")
    ap.add_argument("--max-tokens", type=int, default=128, help="reply budget while collecting and measuring")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the hit-rate")
    ap.add_argument("--ceiling-samples", type=int, default=6,
                    help="the teacher's ceiling: best of 1 + N hinted base replies (bench/teacher.py); 0: skip")
    ap.add_argument("--questions", type=int, default=None, help="held-out general questions (default: all)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature while collecting")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per process (default: the config's, i.e. every core, as users run it)")
    ap.add_argument("--judge", choices=["embedded", "rules"], default="embedded")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value (YAML value), e.g. train.lr=3e-5; repeatable")
    ap.add_argument("--config", default=str(REPO_ROOT / "configs" / "default.yaml"), help="base config")
    ap.add_argument("--home", default=None, help="bench data dir (default: a new temp dir per persona)")
    ap.add_argument("--model-cache", default=os.environ.get("CLAWFLOW_HOME", str(REPO_ROOT / ".clawflow")),
                    help="a CLAWFLOW_HOME whose models/ holds (or will hold) the materialized base model")
    ap.add_argument("--prefect-api", choices=["harness", "env"], default="harness")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(pairs: list[str]) -> dict:
    """`--set train.lr=3e-5` pairs as a nested dict (values parsed as YAML); ValueError names a bad one."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ValueError(f"--set {pair!r}: expected SECTION.KEY=VALUE")
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML 1.1 reads 3e-5 (no dot) as a string
            try:
                parsed = float(parsed)
            except ValueError:
                pass
        node[leaf] = parsed
    return out


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(dict(base.get(k) or {}), v) if isinstance(v, dict) else v
    return base


def write_config(a: argparse.Namespace, home: Path, persona: str) -> Config:
    """The shipped config plus what the bench must set (its home, a free port, one persona, no
    outcome reward) and the `--set` overrides, written under `home` and loaded."""
    raw = yaml.safe_load(Path(a.config).read_text())
    raw["home"] = str(home)
    raw.setdefault("serving", {}).update(port=_free_port())
    if a.threads:
        raw["serving"]["threads"] = a.threads
        raw.setdefault("train", {}).update(threads=a.threads)
    raw.setdefault("judge", {}).update(backend=a.judge, env_reward="ignore")
    if a.judge == "embedded":  # its head, fitted once for this run when the shipped one is stale
        head = judge_head(Path(a.model_cache))
        raw["judge"]["embedded"] = {**(raw["judge"].get("embedded") or {}), "head": str(head)}
    raw["envs"] = {**(raw.get("envs") or {}), "environments": ["persona"], "personas": [persona],
                   "max_turns": 2, "group_n": 1, "max_tokens": a.max_tokens, "temperature": a.temperature,
                   "concurrency": min(a.episodes, 12), "seed": a.seed}
    if a.personas_file:
        raw["envs"]["personas_file"] = str(Path(a.personas_file).resolve())
    _merge(raw, overrides(a.set))
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
    """Materialize the base model once under `cache_home` (clawflow.base_model) and link it into the
    bench home, so every run starts from the same weights without re-converting them."""
    from clawflow.base_model import base_model_dir

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
    from clawflow.local_stack import wait_http

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


def measure(cfg: Config, persona, prompts: list[str], questions, max_tokens: int, bench_questions=()) -> dict:
    """Hit-rate on the persona's held-out prompts and helpfulness on the held-out questions (the
    gate's set) and key facts on the set the gate never reads, from the served policy's greedy
    replies (side turns: never trained on)."""
    from clawflow import helpfulness as H
    from clawflow.envs import evaluation as E

    h_cfg = cfg.gate.helpfulness  # the gate's own settings, so the figures match its verdicts
    mine = E.served_replies(cfg.gateway_url, cfg.serving.api_key, cfg.model.name, prompts, max_tokens)
    answers = E.served_replies(cfg.gateway_url, cfg.serving.api_key, cfg.model.name,
                               [q.prompt for q in questions], h_cfg.max_new_tokens)
    h = H.score(questions, answers, H.relevance(questions, answers), h_cfg.offtopic_below)
    other = E.served_replies(cfg.gateway_url, cfg.serving.api_key, cfg.model.name,
                             [q.prompt for q in bench_questions], h_cfg.max_new_tokens) if bench_questions else []
    facts_bench = sum(q.stated_in(a) for q, a in zip(bench_questions, other)) / len(other) if other else float("nan")
    return {"hit_rate": E.hit_rate(persona, mine), "facts": h.facts_rate, "facts_bench": facts_bench, "duplicates": h.duplicate_share,
            "loops": h.repetitive_share, "offtopic": h.offtopic_share, "empty": h.empty_share,
            "mean_words": sum(len(r.split()) for r in mine) / len(mine), "example": mine[0][:70],
            "answer": answers[0][:70]}


def run(cfg: Config, rounds: int, episodes: int, max_tokens: int, target: float, eval_prompts: int,
        questions: int | None, seed: int = 0, say=print, ceiling_samples: int = 0) -> tuple[str, list[dict]]:
    """The round loop for one persona on a written config (gateway started here; a Prefect API must
    be reachable). Returns the MLflow run id of the curve and one row per measured version."""
    from clawflow.policy import registry
    from clawflow.envs import build_envs
    from clawflow.envs.collect import collect_round
    from clawflow.envs.evaluation import load_held_out
    from clawflow.envs.personas import load_personas
    from clawflow.helpfulness import load_questions
    from clawflow.base_model import base_model_dir
    from flows.train_on_new_feedback import train_on_new_feedback

    [persona], _ = load_personas(cfg.envs.personas_file, cfg.envs.personas)
    held = load_held_out(training_prompts=persona.prompts, persona=persona.name)
    prompts, qs = held.eval_prompts[:eval_prompts], load_questions(cfg.gate.helpfulness.questions)[:questions]
    bench_qs = load_questions(FACTS_BENCH)[:questions]
    if len(prompts) < eval_prompts:
        say(f"  only {len(prompts)} held-out prompts for {persona.name} (asked for {eval_prompts})")
    if ceiling_samples:
        t_c = time.monotonic()
        ceiling = teacher_ceiling(cfg, persona, list(prompts), ceiling_samples, max_tokens, seed)
        say(f"  teacher ceiling (base + the persona's wishes, best of {1 + ceiling_samples} by the plain policy): "
            f"hit-rate {ceiling:.3f} ({time.monotonic() - t_c:.0f} s)")
    streak, sessions, held_at, candidates = 0, 0, None, []  # sessions until it holds in 3 replies in a row
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
                m = measure(cfg, persona, prompts, qs, max_tokens, bench_qs)
                m["eval_s"] = round(time.monotonic() - t_eval, 1)
                row = {"version": version, "round": k, "steps": steps, "wall_s": round(time.monotonic() - t0, 1), **m}
                rows.append(row)
                _log_row(cfg, run_id, row)
                say(_fmt(row))
                if m["hit_rate"] >= target:
                    break
            if k == rounds:
                break
            t_round = time.monotonic()
            results = collect_round(cfg, envs, episodes, rng)
            t_collect = time.monotonic() - t_round
            if failed := [r.error for r in results if r.error]:
                raise RuntimeError(f"{len(failed)} episodes failed: {failed[0]}")
            hits = [r.outcome for r in results if r.outcome is not None]  # the episodes' own hit-rates
            for r in results:
                sessions += 1
                for sc in r.scores:
                    streak = streak + 1 if sc >= 1.0 else 0
                    if streak >= 3 and held_at is None:
                        held_at = sessions
                        say(f"  the preference held in 3 replies in a row at session {sessions}")
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
            served = served_after(out)
            say(f"  round {k + 1}: v{out['version']} served {served:.0f} s after the round's last turn"
                f"{'' if out['promoted'] else ' (rejected: the champion stays)'}; from {out['samples']} samples, "
                f"{done['steps']} steps, "
                f"reward mean {out['reward_mean']:+.3f}, gate: {out['gate'][:160]}, promoted={out['promoted']}; "
                f"collect {t_collect:.0f} s, flow {time.monotonic() - t_round - t_collect:.0f} s "
                f"({', '.join(f'{p} {s:.0f} s' for p, s in out.get('seconds', {}).items())}; "
                f"rewrites {out.get('rewrite_seconds') or 0:.0f} s of train; " + _prepared(out) + ")"
                + (f", collect hit-rate {sum(hits) / len(hits):.2f}" if hits else ""))
            candidates.append(_candidate(cfg, out))
            say(f"  v{out['version']} at the gate: " + json.dumps(candidates[-1]))
            if out["promoted"] and out["reloaded"]:
                version, path = registry.resolve(cfg, out["version"])
    registry.end_run(cfg, run_id)
    say(f"  sessions until the preference held in 3 replies in a row: {held_at or 'not reached'} "
        f"(of {sessions}); ceiling {ceiling if ceiling_samples else 'not measured'}")
    return run_id, rows


def served_after(out: dict) -> float:
    """Seconds from the round's last turn to the verdict served (issue #27's round time): the flow's
    steps up to the reload (`seconds`), not the prepare step that follows it while users talk. Pure."""
    return sum((out.get("seconds") or {}).values())


def _prepared(out: dict) -> str:
    """What the flow's prepare step did after the round (not round time: the user talks meanwhile)."""
    if out.get("prepared"):
        return f"then the next run's rewrites prepared in {out.get('prepare_seconds') or 0:.0f} s, not round time"
    return f"the next run's rewrites not prepared: {str(out.get('prepare_reason') or 'no reason given')[:160]}"


def _candidate(cfg: Config, out: dict) -> dict:
    """A trained version as the gate saw it: promoted or not, at which dose, and its measures at each."""
    from clawflow.policy.registry import _client

    tags = _client(cfg).get_model_version(cfg.model.name, str(out["version"])).tags or {}
    return {"version": out["version"], "promoted": out["promoted"], "dose": tags.get("dose"),
            "pref_gain": tags.get("eval.pref_gain"), "facts": tags.get("eval.help_facts_rate"),
            "doses": tags.get("doses", "")}


def teacher_ceiling(cfg: Config, persona, prompts: list[str], samples: int, max_tokens: int, seed: int) -> float:
    """The persona's teacher ceiling: the hit-rate of the base with the persona's concrete wishes in
    its system prompt, best of 1 + `samples` chosen by the plain policy (bench/teacher.py), on the
    same held-out prompts. What distillation can reach without a checker of the preference."""
    from bench.teacher import replies
    from clawflow.base_model import base_model_dir
    from clawflow.envs.evaluation import hit_rate
    from clawflow.envs.personas import load_personas
    from clawflow.helpfulness import load_model
    from clawflow.prefs.update import teacher_text

    _, wording = load_personas(cfg.envs.personas_file, cfg.envs.personas)
    hint = teacher_text([wording.concrete[p.kind][0].format(value=", ".join(p.value) if isinstance(p.value, list)
                                                             else p.value) for p in persona.preferences], 8)
    model, tok = load_model(base_model_dir(cfg))
    return hit_rate(persona, replies(model, tok, prompts, hint, samples, "plain", max_tokens, seed))


def _mlflow_run(cfg: Config, episodes: int, rounds: int) -> str:
    from clawflow.policy import registry

    exp = cfg.registry.experiment
    bench_cfg = cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"experiment": "learning-bench"})})
    run = registry.start_run(bench_cfg, f"learning-{cfg.train.objective}-{cfg.envs.personas[0]}", {
        "objective": cfg.train.objective, "persona": cfg.envs.personas[0], "lr": cfg.train.lr, "rounds": rounds,
        "episodes": episodes, "group_n": cfg.envs.group_n, "max_tokens": cfg.envs.max_tokens,
        "epochs": cfg.train.epochs, "step_tokens": cfg.train.step_tokens, "judge": cfg.judge.backend,
        "model": cfg.model.name, "training_experiment": exp}, {"clawflow.bench": "learning"})
    return run


METRICS = ("hit_rate", "facts", "facts_bench", "duplicates", "loops", "offtopic", "mean_words", "steps", "wall_s")
FACTS_BENCH = REPO_ROOT / "configs" / "eval" / "facts_bench.yaml"  # the facts set the gate never reads


def _log_row(cfg: Config, run_id: str, row: dict) -> None:
    from clawflow.policy.registry import _client

    client = _client(cfg)
    for key in METRICS:
        client.log_metric(run_id, key, float(row[key]), step=int(row["version"]))


HEADER = (f"{'ver':>3} {'round':>5} {'steps':>5} {'hit_rate':>8} {'facts':>6} {'f_bench':>7} {'dup':>5} {'loop':>5} "
          f"{'offtop':>6} "
          f"{'words':>6} {'wall_s':>7} {'eval_s':>6}  example | answer")


def _fmt(r: dict) -> str:
    return (f"{r['version']:>3} {r['round']:>5} {r['steps']:>5} {r['hit_rate']:>8.3f} {r['facts']:>6.3f} "
            f"{r['facts_bench']:>7.3f} "
            f"{r['duplicates']:>5.2f} {r['loops']:>5.2f} {r['offtopic']:>6.2f} {r['mean_words']:>6.1f} "
            f"{r['wall_s']:>7.1f} {r['eval_s']:>6.1f}  {json.dumps(r['example'])} | {json.dumps(r['answer'])}")


def summary(persona: str, rows: list[dict], target: float, wall_s: float) -> str:
    """One line: hit-rate from v0 to the last version, versions to the target, helpfulness floor."""
    first, last = rows[0], rows[-1]
    reached = next((r["version"] for r in rows if r["hit_rate"] >= target), None)
    worst = min(rows[1:], key=lambda r: r["facts"], default=first)
    worst_b = min(rows[1:], key=lambda r: r["facts_bench"], default=first)
    return (f"{persona}: hit-rate v0 {first['hit_rate']:.2f} -> v{last['version']} {last['hit_rate']:.2f}; "
            f"target {target} " + (f"at v{reached}" if reached is not None else "not reached")
            + f"; facts v0 {first['facts']:.3f}, lowest promoted {worst['facts']:.3f} (v{worst['version']}), "
            f"last {last['facts']:.3f}; facts (never gated) v0 {first['facts_bench']:.3f}, lowest promoted "
            f"{worst_b['facts_bench']:.3f}, last {last['facts_bench']:.3f}; max duplicates {max(r['duplicates'] for r in rows):.2f}; "
            f"wall {wall_s / 60:.1f} min")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the gateway child on the way out
    for var, value in (("MLFLOW_DISABLE_TELEMETRY", "true"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
                       ("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")):
        os.environ.setdefault(var, value)
    from clawflow.envs.personas import load_personas

    try:
        overrides(a.set)
        everyone, _ = load_personas(a.personas_file)
        names = a.personas.split(",") if a.personas else \
            (DEV_PERSONAS.split(",") if not a.personas_file else [p.name for p in everyone])
        load_personas(a.personas_file, names)
    except ValueError as exc:
        print(f"bench/learning.py: error: {exc}", file=sys.stderr)
        return 2
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)  # the flow's gate runs in this process
    load0 = os.getloadavg()[0]
    print(f"learning bench: personas {','.join(names)}; config {a.config} {' '.join(a.set)}; "
          f"{a.episodes} conversations/round, one reply per prompt, judge {a.judge}; "
          f"{os.cpu_count()} cores, load average {load0:.2f}")
    if a.prefect_api == "harness":
        from prefect.testing.utilities import prefect_test_harness

        harness = prefect_test_harness(server_startup_timeout=180)
    else:
        harness = contextlib.nullcontext()
    lines = []
    with harness:
        for name in names:
            home = Path(a.home or tempfile.mkdtemp(prefix=f"clawflow-learning-{name}-")).resolve() / name
            home.mkdir(parents=True, exist_ok=True)
            os.environ["CLAWFLOW_HOME"] = str(home)  # the flow, torchrun and the gateway read this home
            cfg = write_config(a, home, name)
            link_base_model(cfg, Path(a.model_cache).resolve())
            t0 = time.monotonic()
            print(f"\n== {name} (objective {cfg.train.objective}, lr {cfg.train.lr}, home {home})\n{HEADER}",
                  flush=True)
            _, rows = run(cfg, a.rounds, a.episodes, a.max_tokens, a.target, a.eval_prompts, a.questions,
                          a.seed, say=lambda line: print(line, flush=True), ceiling_samples=a.ceiling_samples)
            lines.append(summary(name, rows, a.target, time.monotonic() - t0))
            print(lines[-1], flush=True)
    print("\n" + "\n".join(lines) + f"\nload average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
