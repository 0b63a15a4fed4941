"""The one way to score replies: log pi(response token | prompt, earlier response tokens).

Batched and padding-aware (prompts left-padded, responses right-padded by `collate`);
only the last R + 1 positions get logits (`logits_to_keep`) and the log-softmax over the vocabulary
runs in chunks (`sequence_logprobs`). Both live here, below serving and training, which use them. No `no_grad` here: the trainer's forward keeps its
graph; callers that only evaluate wrap the call in `torch.inference_mode()` (the engine, the gate,
the start-of-run pass in `train.scoring`).
"""

from __future__ import annotations

import torch

from torch import Tensor


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0,
                      device: torch.device | None = None) -> torch.Tensor:
    """[B, R] float32 log pi(response token | prompt, earlier response tokens), R the longest
    response; row b's values past len(responses[b]) are padding. `device`: the model's when None."""
    if device is None:
        device = next(model.parameters()).device
    b = collate(prompts, responses, pad_id)
    # no padding: no mask, so attention takes the plain causal kernel (SDPA is_causal), not a masked one
    mask = None if bool(b["attention_mask"].all()) else b["attention_mask"].to(device)
    out = model(input_ids=b["input_ids"].to(device), attention_mask=mask,
                position_ids=b["position_ids"].to(device), logits_to_keep=b["keep"], use_cache=False)
    return sequence_logprobs(out.logits[:, :-1], b["targets"].to(device))


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
            rollout_logprobs: list[list[float]] | None = None) -> dict[str, Tensor]:
    """Pad one micro-batch (see the module docstring for the layout).

    Returns input_ids, attention_mask, position_ids [B, L] long; targets [B, R] long; mask [B, R]
    float; rollout [B, R] float (recorded logprobs, zeros when not given); and `keep` = R + 1, the number
    of trailing positions whose logits the loss needs.
    """
    if not prompts or len(prompts) != len(responses):
        raise ValueError("collate needs at least one sample and one response per prompt")
    B = len(prompts)
    P, R = max(len(p) for p in prompts), max(len(r) for r in responses)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    targets = torch.full((B, R), pad_id, dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.float32)
    rollout = torch.zeros((B, R), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[b, P - len(p) : P] = torch.tensor(p)
        input_ids[b, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, P - len(p) : P + len(r)] = 1
        targets[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, : len(r)] = 1.0
        if rollout_logprobs is not None:
            rollout[b, : len(r)] = torch.tensor(rollout_logprobs[b], dtype=torch.float32)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "targets": targets, "mask": mask, "rollout": rollout, "keep": R + 1}


def sequence_logprobs(logits: Tensor, targets: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """log softmax(logits)[b, t, targets[b, t]] in float32.  logits: [B, T, V], targets: [B, T].

    Computed as logits[target] - logsumexp(logits) over slices of one row and `chunk_tokens`
    positions, so the float32 [B, T, V] log-softmax never exists at once (only one [chunk, V]
    temporary); logsumexp's backward reuses the logits instead of saving a log-softmax copy, and
    slicing a row never copies a strided view such as `logits[:, :-1]`.
    """
    B, T, _ = logits.shape
    rows = []
    for b in range(B):
        parts = []
        for t in range(0, T, chunk_tokens):
            x = logits[b, t : t + chunk_tokens].float()  # [n, V]
            picked = x.gather(-1, targets[b, t : t + chunk_tokens, None]).squeeze(-1)  # [n]
            parts.append(picked - torch.logsumexp(x, dim=-1))
        rows.append(torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32))
    if not rows:
        return logits.new_zeros((0, T), dtype=torch.float32)
    return torch.stack(rows)  # [B, T]
