"""Replay one recorded learning-bench round with a changed recipe, and gate what it learns.

A round of `bench/learning.py` keeps everything it trained from: the training command (first line
of `checkpoints/<run>.log`), its batch, its standing preferences and its rewrites. This retrains
that batch from the same start weights with `--set train.KEY=VALUE` overrides, then measures the
candidate against a champion at each `--doses` (each dose on its own, no early stop) with the
gate's own `evaluate_doses`, and adds what users would see: the persona's hit-rate on the held-out
prompts and the key facts on the set the gate never reads (greedy, transformers `generate`).

    .venv/bin/python bench/replay_round.py --home /tmp/clawflow-learning-terse-XXXX/terse \\
        --run 563f93ba... --champion <v3 dir> --set train.kl_reference=start --doses 1,0.75 --out /tmp/replay-a

One variant: training ~2-4 min (rewrites reused from --rewrites when the settings match), ~2.5 min
a dose on 2 cores. The recorded home is read, never written (the rewrite cache is copied).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from bench.learning import FACTS_BENCH, _merge, overrides  # noqa: E402

LEARNING_BENCH = Path(__file__).resolve().parents[1] / "configs" / "envs" / "learning_bench.yaml"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--home", type=Path, required=True, help="a bench home: <tmp>/clawflow-learning-P-X/P")
    ap.add_argument("--run", required=True, help="the recorded run's checkpoint id (checkpoints/<id>.log)")
    ap.add_argument("--champion", required=True, help="the champion's checkpoint directory to gate against")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="train.KEY=VALUE (YAML value)")
    ap.add_argument("--doses", default="1", help="comma-separated doses, each gated on its own")
    ap.add_argument("--persona", default="terse")
    ap.add_argument("--rewrites", type=Path, default=None,
                    help="rewrite cache to use (default: a copy of the home's; an empty directory rewrites all)")
    ap.add_argument("--max-tokens", type=int, default=128, help="reply budget for the hit-rate, as the bench's")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def replay_argv(log_line: str, config: Path, out: Path, cache: Path) -> list[str]:
    """The recorded training command (a checkpoint log's first line, "$ cmd ...") with another
    config, output and rewrite cache; everything else (start weights, batch, preferences, seed) as
    recorded. Pure; ValueError when the line is not a recorded training command."""
    argv = shlex.split(log_line.removeprefix("$ "))
    if "clawflow.train.recipe" not in argv:
        raise ValueError(f"not a recorded training command: {log_line[:80]!r}")
    for flag, value in (("--config", config), ("--out", out), ("--cache-dir", cache)):
        if flag not in argv:
            raise ValueError(f"the recorded command has no {flag}")
        argv[argv.index(flag) + 1] = str(value)
    return argv


def train(a: argparse.Namespace) -> Path:
    """The recorded training command with this variant's config, output and rewrite cache."""
    raw = _merge(yaml.safe_load((a.home / "bench-config.yaml").read_text()), overrides(a.sets))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.yaml").write_text(yaml.safe_dump(raw))
    cache = a.rewrites or a.out / "rewrites"
    if a.rewrites is None and not cache.exists():
        shutil.copytree(a.home / "rewrites", cache)
    cand = a.out / "candidate"
    argv = replay_argv((a.home / "checkpoints" / f"{a.run}.log").read_text().splitlines()[0],
                       a.out / "config.yaml", cand, cache)
    if not Path(argv[0]).exists():  # recorded from a worktree since removed: this interpreter
        argv[0] = sys.executable
    if not cand.exists():
        r = subprocess.run(argv, capture_output=True, text=True)
        (a.out / "train.log").write_text(r.stdout + r.stderr)
        if r.returncode:
            raise SystemExit(f"training failed ({r.returncode}): see {a.out / 'train.log'}")
    return cand


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = time.monotonic()
    cand = train(a)
    print(f"trained in {time.monotonic() - t0:.0f} s: {cand}", flush=True)
    from bench.teacher import replies
    from clawflow.base_model import base_model_dir
    from clawflow.config import load_config
    from clawflow.envs.evaluation import hit_rate, load_held_out
    from clawflow.envs.personas import load_personas
    from clawflow.helpfulness import load_model, load_questions
    from clawflow.policy.gate import evaluate_doses
    from tasks.policy import helpfulness_cache

    cfg = load_config(a.home / "bench-config.yaml")
    taught = json.loads((cand / "preferences.json").read_text())["taught"]
    (persona,), _ = load_personas(cfg.envs.personas_file, [a.persona])
    prompts = load_held_out(LEARNING_BENCH, persona=a.persona).eval_prompts[:32]
    facts_qs = load_questions(FACTS_BENCH)
    rows = {}
    for dose in [float(d) for d in a.doses.split(",")]:
        t0 = time.monotonic()
        gate = cfg.gate.model_copy(update={"doses": [dose], "dose_refinements": 0})
        v = evaluate_doses(gate, str(cand), a.champion, a.out / "doses", None, base_model_dir(cfg),
                           helpfulness_cache(cfg), taught)
        m = v.per_dose[dose]
        model, tok = load_model(str(cand) if dose == 1.0 else str(a.out / "doses" / f"dose-{dose:g}"))
        mine = replies(model, tok, prompts, None, 0, "plain", a.max_tokens, 0)
        answers = replies(model, tok, [q.prompt for q in facts_qs], None, 0, "plain",
                          cfg.gate.helpfulness.max_new_tokens, 0)
        rows[dose] = {"passed": v.passed, "pref_gain": m.get("pref_gain"), "facts": m.get("help_facts_rate"),
                      "hit_rate": hit_rate(persona, mine),
                      "facts_bench": sum(q.stated_in(x) for q, x in zip(facts_qs, answers)) / len(answers),
                      "reason": v.reason}
        print(f"dose {dose:g} ({time.monotonic() - t0:.0f} s): " + json.dumps(rows[dose]), flush=True)
    (a.out / "result.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
