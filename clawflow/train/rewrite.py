"""Hindsight rewrites for context distillation (`train.objective: distill`).

A turn the user corrected carries a hindsight hint ("keep it under 30 words"). OPD scores the
student's own reply under the hinted prompt, token by token; that only re-weights tokens the student
already chose, and on SmolLM2-135M it drove the policy into non-answers at any rate that moved it
(issue #15). Context distillation (Snell et al. 2022, "Learning by Distilling Context") instead lets
the policy *with the hint in its prompt* write a new reply, and the student learns that reply from
the plain prompt. The target is a fluent answer of the model itself, so learning it cannot teach
the model to stop answering; and because the teacher is the current policy, each version's
hinted replies start from the last version's habits, so the preference compounds.

Generation runs on the full (unsharded) model before FSDP wraps it: every rank writes the same
greedy replies, and rank 0's are broadcast so that ranks agree token for token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Function words that say nothing about what a request is about (English; a request with no other
# words is never judged off-topic).
_STOP = frozenset("""a an the is are was were be been do does did i im my me mine you your yours we our us it its
this that these those to of for in on at by from with about as and or but if then so not no yes can could
would should will shall may might must what which who whom whose how why when where there here please
tell give make get let just also very more most some any all one two like know want need""".split())
_WORD = re.compile(r"[^\W\d_]{3,}")
_APOLOGY = re.compile(r"^\W*(i'?m sorry|i am sorry|sorry|i apologi[sz]e|my apologies|apologies)\b", re.IGNORECASE)


def content_words(text: str) -> set[str]:
    """Lower-cased words of 3+ letters that are not function words, crudely stemmed (plural -s)."""
    return {w.rstrip("s") for w in _WORD.findall(text.lower()) if w not in _STOP}


def addresses(request: str, reply: str) -> bool:
    """Whether a rewritten reply still answers the request: it shares a content word with it and
    does not open with an apology. A 135M teacher told "too wordy" often answers the complaint
    ("I'm sorry for any confusion.") instead of the question; learned, that became the student's
    answer to everything (issue #15). Pure and lexical: a request with no content words passes."""
    if _APOLOGY.match(reply):
        return False
    asked = content_words(request)
    return not asked or bool(asked & content_words(reply))


# Words a reply can add without adding anything ("Popcorn is made from a type of food called popcorn.")
_FILLER = frozenset("type types kind kinds sort called known thing things something way used use".split())
_TERM = re.compile(r"[^\W_]{2,}|\d")


def _terms(text: str) -> set[str]:
    return {w.rstrip("s") for w in _TERM.findall(text.lower())} - _STOP - _FILLER


def adds_to(request: str, reply: str) -> bool:
    """Whether a reply says something its request did not: a word or number of its own, beyond
    function words and filler ("Au" and "56" count). Learned from a 135M teacher, replies that
    restate the question ("The main ingredient in ketchup is ketchup.", "Humans need to breathe to
    live.") became the student's answers to questions it had answered right (terse v4,
    docs/learning.md). Pure and lexical; as in `addresses`, a request with no words of its own passes."""
    asked = _terms(request)
    return not asked or bool(_terms(reply) - asked)


def generate_rewrites(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
                      batch_size: int = 8) -> list[list[int]]:
    """Greedy replies to `prompts` (token ids), each ending with its EOS token when one was sampled."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    replies: dict[int, list[int]] = {}
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for k in range(0, len(order), batch_size):
            idx = order[k : k + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for row, i in enumerate(idx):  # left padding: every reply starts at column `width`
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                attn[row, width - len(prompts[i]):] = 1
            gen = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=sorted(eos_ids), pad_token_id=pad_id,
                                 use_cache=True)
            for row, i in enumerate(idx):
                replies[i] = cut_at_eos(gen[row, width:].tolist(), eos_ids)
    if was_training:
        model.train()
    return [replies[i] for i in range(len(prompts))]


@dataclass(slots=True)
class Candidate:
    """One rewrite of a request: its tokens and their summed logprobs under the hinted prompt (the
    teacher that wrote it) and under the plain prompt (the student, before training)."""

    tokens: list[int]
    hinted: float
    plain: float


def _left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def _prefill(model, prompts: list[list[int]], rows: int, pad_id: int, device):
    """Left-padded prompts through the model once, their KV cache repeated `rows` times per prompt.
    Returns (last logits, cache, attention mask, next position), each with one row per candidate."""
    ids, mask = _left_padded(prompts, pad_id, device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    out.cache.batch_repeat_interleave(rows)
    return (out.logits[:, -1].float().repeat_interleave(rows, 0), out.cache, mask.repeat_interleave(rows, 0),
            pos[:, -1].repeat_interleave(rows) + 1)


def guided(logp_hinted: torch.Tensor, logp_plain: torch.Tensor, guidance: float) -> torch.Tensor:
    """Log-scores of the next token with the hint's effect amplified: log p_h + γ (log p_h − log p_p)
    (classifier-free guidance, Sanchez et al. 2023, "Stay on topic with classifier-free guidance").
    γ = 0 is the hinted policy itself. A 135M model follows a user's correction only weakly ("Shorter
    please: 30 words at most." in the system message: 0.06 of replies ≤ 30 words); γ = 1 amplifies
    what the hint does change (0.38), with the hint's own direction, for any kind of preference. Pure."""
    return logp_hinted + guidance * (logp_hinted - logp_plain) if guidance else logp_hinted


STOP_EVERY = 8  # decode steps between `stop` checks (a decode per unfinished row each time)


def sample_candidates(model, teacher_prompts: list[list[int]], plain_prompts: list[list[int]], n: int,
                      max_new_tokens: int, temperature: float, eos_ids: set[int], pad_id: int,
                      seed: int, guidance: float = 0.0, stop=None) -> list[list[Candidate]]:
    """Per prompt, the greedy reply and `n` sampled ones to its hinted prompt, each scored under both
    its hinted and its plain prompt. With `guidance` γ > 0 the tokens are chosen by `guided` scores:
    the plain prompt is decoded in lockstep (two forwards per step), which also scores the replies.

    Each prompt is prefilled once and its KV cache repeated for its 1 + n rows, so a long agent
    prompt (OpenClaw sends ~8k tokens) costs one prefill, not 1 + n; prompts are batched with left
    padding. Finished rows decode padding until every row is done. Logprobs are at temperature 1:
    what the model assigns, not what the sampler did. Seeded: the same call gives the same candidates.
    `stop(prompt_index, tokens)`, checked every `STOP_EVERY` steps (not with guidance): true ends that
    row there, without EOS (a candidate that can no longer show what its teacher read is left out
    anyway, and a batch decodes until its last row ends); the other rows come out as without it."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    rows, k = 1 + n, len(teacher_prompts)
    eos = torch.tensor(sorted(eos_ids), device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    greedy_row = (torch.arange(k * rows, device=device) % rows) == 0
    was_training = model.training
    model.eval()
    if guidance:
        with torch.inference_mode():
            cands = _guided_candidates(model, teacher_prompts, plain_prompts, rows, max_new_tokens, temperature,
                                       eos, eos_ids, pad_id, gen, greedy_row, guidance, device)
        if was_training:
            model.train()
        return [cands[i * rows : (i + 1) * rows] for i in range(k)]
    with torch.inference_mode():
        logits, cache, mask, pos = _prefill(model, teacher_prompts, rows, pad_id, device)
        tokens = torch.empty(k * rows, 0, dtype=torch.long, device=device)
        hinted = torch.zeros(k * rows, device=device)
        done = torch.zeros(k * rows, dtype=torch.bool, device=device)
        cut: dict[int, int] = {}  # row -> its length where `stop` ended it
        for _ in range(max_new_tokens):
            logp = F.log_softmax(logits, -1)
            sampled = sample_rows(logits, temperature, gen) if n else logp.argmax(-1)
            nxt = torch.where(greedy_row, logp.argmax(-1), sampled)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            hinted += torch.where(done, 0.0, logp.gather(-1, nxt[:, None])[:, 0])
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            done |= torch.isin(nxt, eos)
            if stop is not None and tokens.shape[1] % STOP_EVERY == 0:
                for r in stopped(stop, tokens, done, rows):
                    cut[r], done[r] = tokens.shape[1], True
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None], cache=cache,
                           use_cache=True).logits[:, -1].float()
            pos = pos + 1
        replies = [cut_at_eos(r[: cut.get(j, len(r))], eos_ids) for j, r in enumerate(tokens.tolist())]
        # The same replies after the plain prompts: one forward over every candidate, right-padded.
        last, cache, mask, pos = _prefill(model, plain_prompts, rows, pad_id, device)
        width = max(len(r) for r in replies)
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in replies], device=device)
        real = torch.tensor([[j < len(r) for j in range(width)] for r in replies], device=device)
        logits = last[:, None]
        if width > 1:
            rest = model(input_ids=ids[:, :-1], attention_mask=torch.cat([mask, real[:, :-1].long()], 1),
                         position_ids=pos[:, None] + torch.arange(width - 1, device=device), cache=cache).logits
            logits = torch.cat([logits, rest.float()], 1)
        plain = (F.log_softmax(logits, -1).gather(-1, ids[:, :, None])[:, :, 0] * real).sum(-1)
    if was_training:
        model.train()
    cands = [Candidate(r, float(h), float(p)) for r, h, p in zip(replies, hinted.tolist(), plain.tolist())]
    return [cands[i * rows : (i + 1) * rows] for i in range(k)]


def stopped(stop, tokens: torch.Tensor, done: torch.Tensor, rows: int) -> list[int]:
    """The unfinished rows `stop` ends now (row r is a candidate of prompt r // rows)."""
    return [r for r in (~done).nonzero()[:, 0].tolist() if stop(r // rows, tokens[r].tolist())]


def sample_rows(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits / temperature): the inverse CDF at one uniform draw per
    row, the distribution torch.multinomial samples, at 2 ms instead of 47 for 40 rows of a 49k
    vocabulary on 2 cores (multinomial draws per element)."""
    cdf = torch.softmax(logits.float() / temperature, -1).cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u)[:, 0].clamp(max=cdf.shape[-1] - 1)


def hint_strength(plain: list[float], hinted: list[float]) -> float:
    """How much a hint would change the policy's answers: for the plain policy's greedy answers to a
    few questions, the mean over them of log p(answer | plain prompt) - log p(answer | hinted prompt),
    summed over each answer's tokens (a one-sample estimate of KL(plain || hinted)). About 0 for a
    hint the policy ignores ("That's way too long."); large for one it follows ("30 words at most":
    the hinted policy would have stopped long before the plain answer does). Summed, not averaged per
    token: the change sits in a few tokens (where to stop, how to open). Pure."""
    gaps = [p - h for p, h in zip(plain, hinted)]
    return sum(gaps) / len(gaps) if gaps else 0.0


def choose(candidates: list[Candidate], usable: list[bool], select: str, shown: list[bool] | None = None) -> int | None:
    """The index of the rewrite to learn among the usable candidates, or None when none is usable;
    among those that also show what the hint asks (`shown`, prefs/shows.py) when any does.

    `plain`: the most likely under the plain prompt (sum of logprobs), i.e. the hinted answer the
    student finds least surprising. On SmolLM2-135M a style hint makes greedy answers lose facts the
    plain model states ("A right angle is approximately 180 degrees"); of the hinted candidates, the
    one the plain model finds most likely keeps them (issue #15, docs/learning.md). `poe`: the most likely
    under both prompts together. `greedy`: the first (greedy) candidate."""
    ok = [k for k, u in enumerate(usable) if u]
    if not ok:
        return None
    if shown is not None:
        ok = [k for k in ok if shown[k]] or ok
    if select == "greedy":
        return ok[0]
    score = {"plain": lambda c: c.plain, "poe": lambda c: c.plain + c.hinted}[select]
    return max(ok, key=lambda k: score(candidates[k]))


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """The reply up to and including its first EOS token (generate pads finished rows after it)."""
    for n, t in enumerate(ids):
        if t in eos_ids:
            return ids[: n + 1]
    return ids


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """The ids that end a reply: the generation config's EOS (one or a list) and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    return ids


def _guided_candidates(model, teacher_prompts, plain_prompts, rows, max_new_tokens, temperature, eos, eos_ids,
                       pad_id, gen, greedy_row, guidance, device) -> list[Candidate]:
    """`sample_candidates` with guidance: both prompts decoded in lockstep, one token stream."""
    import torch.nn.functional as F

    streams = [list(_prefill(model, p, rows, pad_id, device)) for p in (teacher_prompts, plain_prompts)]
    total = streams[0][0].shape[0]
    tokens = torch.empty(total, 0, dtype=torch.long, device=device)
    scores = torch.zeros(2, total, device=device)  # summed logprobs under (hinted, plain)
    done = torch.zeros(total, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logp = [F.log_softmax(s[0], -1) for s in streams]
        score = guided(logp[0], logp[1], guidance)
        greedy = score.argmax(-1)
        nxt = torch.where(greedy_row, greedy,
                          sample_rows(score, temperature, gen))
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        for j in range(2):
            scores[j] += torch.where(done, 0.0, logp[j].gather(-1, nxt[:, None])[:, 0])
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done |= torch.isin(nxt, eos)
        if bool(done.all()):
            break
        for s in streams:  # [logits, cache, mask, pos]
            s[2] = torch.cat([s[2], torch.ones_like(s[2][:, :1])], 1)
            s[0] = model(input_ids=nxt[:, None], attention_mask=s[2], position_ids=s[3][:, None], cache=s[1],
                         use_cache=True).logits[:, -1].float()
            s[3] = s[3] + 1
    replies = [cut_at_eos(r, eos_ids) for r in tokens.tolist()]
    return [Candidate(r, float(h), float(p)) for r, h, p in zip(replies, scores[0].tolist(), scores[1].tolist())]

