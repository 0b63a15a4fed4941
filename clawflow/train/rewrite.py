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
