"""How good a distillation teacher is: the policy with a user's hint in its prompt, before any training.

The student of `train.objective: distill` learns the hinted policy's replies, so their facts and
their hit-rate bound what a version can reach (issue #15). For each hint and each way of choosing a
rewrite (the greedy one, or the best of 1 + n by `train/rewrite.py` `choose`), it reports the
fraction of key facts stated on the gate's questions (configs/eval/helpfulness.yaml, `--fact-tokens`)
and the persona's hit-rate on the held-out prompts (configs/envs/learning_bench.yaml):

    .venv/bin/python bench/teacher.py [--model DIR] [--persona terse] [--hint "..."] [--samples 4]

The plain policy (no hint) is the first row, as the baseline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from clawflow.config import load_config  # noqa: E402
from clawflow.envs.evaluation import hit_rate, load_held_out  # noqa: E402
from clawflow.envs.personas import load_personas  # noqa: E402
from clawflow.helpfulness import load_model, load_questions, score  # noqa: E402
from clawflow.base_model import base_model_dir  # noqa: E402
from clawflow.train.rewrite import choose, eos_token_ids, sample_candidates  # noqa: E402
from clawflow.train.teacher import chat_prompt_ids, teacher_prompt_ids  # noqa: E402

HINTS = {"terse": ["Please keep replies under 30 words.", "That's way too long."],
         "numbered_steps": ["Please give numbered steps (1. 2. 3.), one per line, nothing else."],
         "curious_coach": ["Always end your reply with a question for me."],
         "lowercase_casual": ["Write everything in lowercase, no capital letters at all."]}
GROUP = 8


def replies(model, tok, prompts: list[str], hint: str | None, n: int, select: str, max_tokens: int,
            seed: int, guidance: float = 0.0) -> list[str]:
    """One reply per prompt: the greedy one (n = 0) or the best of 1 + n by `select`."""
    eos, out = eos_token_ids(model, tok), []
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for k in range(0, len(prompts), GROUP):
        msgs = [[{"role": "user", "content": p}] for p in prompts[k : k + GROUP]]
        plain = [chat_prompt_ids(tok, m) for m in msgs]
        hinted = [teacher_prompt_ids(tok, m, hint, in_system=True) for m in msgs] if hint else plain
        for cands in sample_candidates(model, hinted, plain, n, max_tokens, 0.7, eos, pad, seed + k,
                                       guidance=guidance if hint else 0.0):
            texts = [tok.decode(c.tokens, skip_special_tokens=True).strip() for c in cands]
            best = choose(cands, [bool(t) for t in texts], select)
            out.append(texts[0 if best is None else best])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model or adapter directory (default: the base model)")
    ap.add_argument("--persona", default="terse")
    ap.add_argument("--hint", action="append", default=None, help="hint text (repeatable; default: the persona's)")
    ap.add_argument("--samples", type=int, default=4, help="n of best-of-(1 + n)")
    ap.add_argument("--guidance", type=float, default=0.0, help="γ of classifier-free guidance (train.rewrite_guidance)")
    ap.add_argument("--choices", default="greedy,plain,poe", help="which rows per hint: greedy, plain, poe")
    ap.add_argument("--fact-tokens", type=int, default=32)
    ap.add_argument("--hit-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        persona = {p.name: p for p in load_personas()[0]}[args.persona]
    except KeyError:
        print(f"bench/teacher.py: error: unknown persona {args.persona!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model or base_model_dir(load_config()))
    questions = load_questions()
    held_out = list(load_held_out(persona=args.persona).eval_prompts)
    hints = args.hint or HINTS.get(args.persona) or []
    wanted = args.choices.split(",")
    rows = [(None, 0, "greedy")] + [(h, 0 if sel == "greedy" else args.samples, sel) for h in hints
                                    for sel in ("greedy", "plain", "poe") if sel in wanted]
    print(f"teacher bench: persona {args.persona}, {len(questions)} questions, {len(held_out)} held-out prompts, "
          f"guidance {args.guidance}")
    print(f"{'hint':42s} {'choice':14s} {'facts':>6s} {'hit':>5s} {'words':>6s} {'secs':>5s}")
    for hint, n, select in rows:
        t0 = time.monotonic()
        facts = score(questions, replies(model, tok, [q.prompt for q in questions], hint, n, select,
                                         args.fact_tokens, args.seed, args.guidance)).facts_rate
        answers = replies(model, tok, held_out, hint, n, select, args.hit_tokens, args.seed, args.guidance)
        words = sum(len(a.split()) for a in answers) / len(answers)
        choice = "greedy" if n == 0 else f"best of {1 + n}: {select}"
        print(f"{(hint or '(no hint)')[:42]:42s} {choice:14s} {facts:6.3f} {hit_rate(persona, answers):5.2f} "
              f"{words:6.0f} {time.monotonic() - t0:5.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
