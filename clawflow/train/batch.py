"""The training batch: samples read from a Parquet file, collated into padded tensors.

A sample (clawflow/contracts/sample.py) is one assistant turn with its judgment: the prompt token
ids, the response token ids and their logprobs exactly as the engine sampled them, the reward, and
(for OPD) a hindsight hint plus the request's messages for the hint-augmented teacher prompt.

Layout after `collate` (prompts left-padded, responses right-padded, so every response starts at
the same column and the model only needs logits for the last R + 1 positions):

    input_ids      x  p0 p1 p2 r0 r1 x       [B, L]   L = P_max + R_max
    position_ids   0  0  1  2  3  4  4       [B, L]   counts real tokens only
    targets                 r0 r1 x          [B, R]   logits at columns P_max-1 .. L-2 predict these
    mask                    1  1  0          [B, R]   response tokens
    rollout                 l0 l1 0          [B, R]   logprobs recorded by the engine
"""

from __future__ import annotations

import torch
from torch import Tensor

# The sample file's one schema, record and reader live with the writer's (clawflow/contracts/sample.py).
from clawflow.contracts.sample import OPTIONAL, REQUIRED, Sample, read_samples  # noqa: F401 - re-exported

load_samples = read_samples  # the trainer's name for the contract's reader


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
