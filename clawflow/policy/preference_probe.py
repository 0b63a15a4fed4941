"""The gate's preference measure, with no checker of the preference (it cannot know "≤ 25 words").

The teacher (the champion with the user's standing preferences in its system prompt) answers
held-out general prompts (configs/eval/preference_prompts.yaml, never trained on), and so does the
champion from the plain prompt. The measure is how much more likely a policy makes the teacher's
answers than the champion does, minus the same for the champion's own plain answers, in nats per
token: a contrast, like DPO's implicit reward margin. A candidate that learned the preference finds
the preferring answers likelier and its old ones less likely; one that only grew surer of its own
answers (training on rewrites a teacher that ignores the preference wrote, i.e. its own) moves
both alike and scores ~0; so does one whose teacher cannot show the preference at all. Both sets
of answers are generated once per (champion, preferences) and kept in the gate's cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from clawflow.config import REPO_ROOT

DEFAULT_FILE = REPO_ROOT / "configs" / "eval" / "preference_prompts.yaml"


def gain(champion: list[float], candidate: list[float]) -> float:
    """Mean over prompts of the candidate's per-token log-likelihood minus the champion's. Pure."""
    if len(champion) != len(candidate):
        raise ValueError("one value per prompt under each model")
    return sum(k - c for c, k in zip(champion, candidate)) / len(champion) if champion else 0.0


def contrast(champion_taught: list[float], candidate_taught: list[float], champion_plain: list[float],
             candidate_plain: list[float]) -> dict[str, float]:
    """The preference measure: the gain on the teacher's answers minus the gain on the champion's
    plain answers (each `gain`), with both parts. Pure."""
    taught, plain = gain(champion_taught, candidate_taught), gain(champion_plain, candidate_plain)
    return {"pref_gain": taught - plain, "pref_gain_taught": taught, "pref_gain_plain": plain}


def load_prompts(path: str | Path | None = None) -> list[str]:
    from clawflow.train.prompts import load_prompts as load

    return [p.prompt for p in load(path or DEFAULT_FILE)]


def teacher_answers(model, tok, prompts: list[str], taught: str, max_new_tokens: int) -> list[list[int]]:
    """The preference-conditioned policy's greedy answers (token ids) to `prompts`; with `taught`
    empty, the plain policy's."""
    from clawflow.train.rewrite import eos_token_ids, generate_rewrites
    from clawflow.train.teacher import chat_prompt_ids, teacher_prompt_ids

    hinted = [teacher_prompt_ids(tok, [{"role": "user", "content": p}], taught, in_system=True) if taught
              else chat_prompt_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
    return generate_rewrites(model, hinted, max_new_tokens, eos_token_ids(model), tok.pad_token_id or 0, batch_size=16)


def answer_loglik(model, tok, prompts: list[str], answers: list[list[int]], batch_size: int = 8) -> list[float]:
    """Mean per-token log-likelihood of each answer from its plain prompt (an empty answer: 0)."""
    import torch

    from clawflow.policy.logprobs import response_logprobs
    from clawflow.train.teacher import chat_prompt_ids

    plain = [chat_prompt_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
    out: list[float] = []
    with torch.inference_mode():
        for k in range(0, len(plain), batch_size):
            rows = [(p, a) for p, a in zip(plain[k : k + batch_size], answers[k : k + batch_size]) if a]
            lp = response_logprobs(model.eval(), [p for p, _ in rows], [a for _, a in rows],
                                   tok.pad_token_id or 0) if rows else None
            r = 0
            for a in answers[k : k + batch_size]:
                if a:
                    out.append(float(lp[r, : len(a)].mean()))
                    r += 1
                else:
                    out.append(0.0)
    return out


def cached_answers(cache_dir: Path | None, champion_dir: str, prompts: list[str], taught: str, max_new_tokens: int,
                   make) -> list[list[int]]:
    """`make()` once per (champion weights, prompts, preferences, budget), then from `cache_dir`."""
    d = Path(champion_dir).resolve()
    stamp = [(f.name, f.stat().st_mtime_ns) for f in sorted(d.glob("*.safetensors"))]
    key = hashlib.sha256(json.dumps([str(d), stamp, prompts, taught, max_new_tokens]).encode()).hexdigest()[:24]
    path = cache_dir / f"teacher-{key}.json" if cache_dir else None
    if path and path.is_file():
        return json.loads(path.read_text())
    answers = make()
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(answers))
        tmp.replace(path)
    return answers
