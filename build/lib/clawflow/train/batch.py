"""The training batch: samples read from a Parquet file, collated into padded tensors.

A sample is one assistant turn with its judgment: the prompt token ids, the response token ids and
their logprobs exactly as the engine sampled them, the reward, and (for OPD) a hindsight hint plus
the request's messages so the trainer can build the hint-augmented teacher prompt.

Layout after `collate` (prompts left-padded, responses right-padded, so every response starts at
the same column and the model only needs logits for the last R + 1 positions):

    input_ids      x  p0 p1 p2 r0 r1 x       [B, L]   L = P_max + R_max
    position_ids   0  0  1  2  3  4  4       [B, L]   counts real tokens only
    targets                 r0 r1 x          [B, R]   logits at columns P_max-1 .. L-2 predict these
    mask                    1  1  0          [B, R]   response tokens
    rollout                 l0 l1 0          [B, R]   logprobs recorded by the engine
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch import Tensor

REQUIRED = ("prompt_token_ids", "response_token_ids", "response_logprobs", "reward")
OPTIONAL = ("turn_id", "hint", "messages", "tools", "group_id", "policy_version")


@dataclass(slots=True)
class Sample:
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    reward: float
    hint: str | None = None
    messages: list[dict] | None = None  # the request, for the hint-augmented teacher prompt
    tools: list[dict] | None = None
    group_id: str | None = None
    policy_version: int = 0
    turn_id: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("sample has an empty prompt (the first response token needs one)")
        if len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"sample has {len(self.response_token_ids)} response tokens but "
                f"{len(self.response_logprobs)} logprobs"
            )


def _json(value):
    return json.loads(value) if isinstance(value, str) and value else None


def load_samples(parquet_path: str | Path) -> list[Sample]:
    """Read the training columns of a Parquet file (missing optional columns get defaults)."""
    names = set(pq.read_schema(parquet_path).names)
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise ValueError(f"{parquet_path} lacks columns {missing}")
    table = pq.read_table(parquet_path, columns=list(REQUIRED) + [c for c in OPTIONAL if c in names])
    samples = []
    for row in table.to_pylist():
        samples.append(Sample(
            prompt_token_ids=list(row["prompt_token_ids"]),
            response_token_ids=list(row["response_token_ids"]),
            response_logprobs=[float(x) for x in row["response_logprobs"]],
            reward=float(row["reward"] or 0.0),
            hint=(row.get("hint") or "").strip() or None,
            messages=_json(row.get("messages")),
            tools=_json(row.get("tools")),
            group_id=row.get("group_id") or None,
            policy_version=int(row.get("policy_version") or 0),
            turn_id=row.get("turn_id"),
        ))
    return samples


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
