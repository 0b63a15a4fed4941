"""Which hint the rewriting policy reads, and which of its rewrites a run learns (`train.objective: distill`).

Two choices the recipe makes before training, on the start-of-run weights (rank 0; the recipe
broadcasts the result):

- `strongest_hint` (`train.rewrite_hints: strongest`): the run's distinct hints measured by how
  much each would change the policy's answers to a few rehearsal questions (train/rewrite.py
  `hint_strength`); every rewrite then reads the strongest ("Answer in no more than 30 words."
  rather than "That's way too long.", which a 135M model ignores).
- `best_of_n` (`train.rewrite_samples`, `rewrite_select`, `rewrite_guidance`): per request, the
  greedy rewrite and n samples (train/rewrite.py `sample_candidates`), and the usable one the
  selection prefers (`usable_rewrite`: says something, answers the request, states a rehearsal
  question's key fact), among those that show what the hint asks when any does (prefs/shows.py).
"""

from __future__ import annotations

import torch

from clawflow.config import TrainConfig
from clawflow.helpfulness import Question, loops
from clawflow.policy.logprobs import response_logprobs
from clawflow.prefs.shows import cannot_show, checkable, unshown
from clawflow.train.plan import Item
from clawflow.train.rehearsal import load_rehearsal
from clawflow.train.rewrite import addresses, adds_to, choose, eos_token_ids, generate_rewrites, hint_strength, sample_candidates
from clawflow.train.teacher import chat_prompt_ids, teacher_prompt_ids

REWRITE_GROUP = 8  # prompts sampled together (each with 1 + train.rewrite_samples rows)
HINT_PROBE_TOKENS = 48  # greedy tokens per probe question when hints are compared
HINT_PROBES = 4  # rehearsal questions answered when hints are compared


def usable_rewrite(it: Item, tokens: list[int], text: str, eos: set[int]) -> bool:
    """A rewrite (`tokens`, decoded `text`) is learned only if it says something, still answers the
    request (train/rewrite.py), says something the request did not (`adds_to`), does not loop
    (helpfulness.loops) and, for a rehearsal question, still states its key fact (train/rehearsal.py)."""
    if not any(t not in eos for t in tokens) or not addresses(it.request, text):
        return False
    if loops(text) or (it.request and not adds_to(it.request, text)):
        return False
    return not it.facts or Question(it.request, list(it.facts)).stated_in(text)


def strongest_hint(model, tok, hints: list[str], cfg: TrainConfig, pad_id: int,
                   device: torch.device) -> tuple[str, dict[str, float]]:
    """(the hint that changes the policy's greedy answers most, every hint's strength). The plain
    answers are generated once and scored, by the one reply scorer, under the plain prompt and
    under each hint."""
    probes = [[{"role": "user", "content": q.prompt}] for q in load_rehearsal(cfg.rehearsal_prompts)[:HINT_PROBES]]
    in_system = cfg.rewrite_hint == "system"
    plain = [chat_prompt_ids(tok, m) for m in probes]
    answers = generate_rewrites(model, plain, HINT_PROBE_TOKENS, eos_token_ids(model), pad_id)
    prompts = plain + [teacher_prompt_ids(tok, m, h, in_system=in_system) for h in hints for m in probes]
    with torch.inference_mode():  # the plain answers under the plain prompt, then under each hint
        lp = response_logprobs(model.eval(), prompts, answers * (1 + len(hints)), pad_id, device)
    n = len(probes)
    sums = [float(lp[i, : len(answers[i % n])].sum()) for i in range(len(prompts))]
    strength = {h: hint_strength(sums[:n], sums[n * (k + 1) : n * (k + 2)]) for k, h in enumerate(hints)}
    return max(hints, key=lambda h: strength[h]), strength


def degenerate_hints(model, tok, hints: list[str], cfg: TrainConfig, pad_id: int) -> dict[str, str]:
    """{hint: why} for each hint whose teacher (the policy with it in the system prompt) answers most
    of a few rehearsal questions with nothing or off the question: distilled, it would teach that."""
    probes = [q.prompt for q in load_rehearsal(cfg.rehearsal_prompts)[:HINT_PROBES]]
    if not hints or not probes:
        return {}
    eos = eos_token_ids(model)
    prompts = [teacher_prompt_ids(tok, [{"role": "user", "content": q}], h, in_system=True) for h in hints for q in probes]
    answers = generate_rewrites(model, prompts, HINT_PROBE_TOKENS, eos, pad_id)
    texts = [tok.decode([t for t in a if t not in eos], skip_special_tokens=True) for a in answers]
    n = len(probes)
    return {h: why for k, h in enumerate(hints) if (why := degenerate(probes, texts[k * n : (k + 1) * n]))}


def degenerate(questions: list[str], answers: list[str]) -> str | None:
    """Why a teacher's `answers` to `questions` would teach nothing good (most are empty, off the
    question, or one and the same answer), or None. Pure."""
    bad = sum(not a.strip() or not addresses(q, a) for q, a in zip(questions, answers, strict=True))
    n = len(questions)
    if 2 * bad > n:
        return f"{bad} of {n} of its teacher's answers to general questions were empty or off the question"
    if n > 2 and len({a.strip().lower() for a in answers}) == 1:
        return f"its teacher gave one answer to {n} different questions"
    return None


def best_of_n(model, tok, items: list[Item], cfg: TrainConfig, pad_id: int) -> tuple[dict[int, list[int]], float]:
    """({item index: the chosen rewrite's tokens}, share of candidates usable). Per item the usable
    candidate chosen by `cfg.rewrite_select`, else the greedy one (left out afterwards as unusable).
    Sampling is seeded by the run seed and the item."""
    eos, chosen, usable_share = eos_token_ids(model), {}, []
    ordered = sorted(items, key=lambda it: len(it.teacher_prompt))  # similar lengths pad less
    for g in range(0, len(ordered), REWRITE_GROUP):
        group = ordered[g : g + REWRITE_GROUP]
        stances = [checkable(it.hint) for it in group]
        # with `verify_stances` a candidate that can no longer show what its teacher read is left out:
        # stop writing it (a 30-word limit ends every row by ~30 words instead of rewrite_max_tokens)
        stop = (lambda i, toks: cannot_show(stances[i], tok.decode(toks, skip_special_tokens=True))) \
            if cfg.verify_stances and any(stances) else None
        per_item = sample_candidates(model, [it.teacher_prompt for it in group], [it.prompt for it in group],
                                     cfg.rewrite_samples, cfg.rewrite_max_tokens, cfg.rewrite_temperature, eos,
                                     pad_id, seed=cfg.seed * 100_003 + group[0].index, guidance=cfg.rewrite_guidance,
                                     stop=stop)
        for it, cands in zip(group, per_item):
            texts = [tok.decode(c.tokens, skip_special_tokens=True) for c in cands]
            ok = [usable_rewrite(it, c.tokens, t, eos) for c, t in zip(cands, texts)]
            shown = [not unshown(it.hint, t) for t in texts] if cfg.verify_stances else None
            k = choose(cands, ok, cfg.rewrite_select, shown)
            usable_share.append(sum(ok) / len(ok))
            chosen[it.index] = cands[0 if k is None else k].tokens
    return chosen, sum(usable_share) / max(len(usable_share), 1)
