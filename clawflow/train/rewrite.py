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

import torch


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
