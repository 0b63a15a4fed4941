"""The training batch: samples read from a Parquet file, collated into right-padded tensors.

A sample is one assistant turn with its score: the prompt token ids, the response token ids and
their logprobs exactly as the engine sampled them, and the reward. Layout of one row after
`collate` (P prompt tokens p, R response tokens r, padding x, L = longest P + R):

    input_ids      p0 p1 p2 r0 r1 x          [L]     what the model reads
    targets        p1 p2 r0 r1 x             [L - 1] input shifted by one (next token)
    response_mask  0  0  1  1  0             [L - 1] targets that are response tokens
    old_logprobs   0  0  l0 l1 0             [L - 1] recorded rollout logprobs, same positions
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from torch import Tensor

COLUMNS = ("prompt_token_ids", "response_token_ids", "response_logprobs", "reward")


@dataclass(slots=True)
class Sample:
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    reward: float

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("sample has an empty prompt (the first response token needs one)")
        if len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"sample has {len(self.response_token_ids)} response tokens but "
                f"{len(self.response_logprobs)} logprobs"
            )


def load_samples(parquet_path: str | Path) -> list[Sample]:
    """Read the four training columns of a Parquet file (other columns are ignored)."""
    table = pq.read_table(parquet_path, columns=list(COLUMNS))
    return [
        Sample(
            prompt_token_ids=list(row["prompt_token_ids"]),
            response_token_ids=list(row["response_token_ids"]),
            response_logprobs=[float(x) for x in row["response_logprobs"]],
            reward=float(row["reward"]),
        )
        for row in table.to_pylist()
    ]


def collate(samples: list[Sample], pad_id: int) -> dict[str, Tensor]:
    """Right-pad `samples` into tensors (see the module docstring for the layout).

    Returns input_ids [B, L] long, attention_mask [B, L] long, targets [B, L-1] long,
    response_mask [B, L-1] float, old_logprobs [B, L-1] float, rewards [B] float.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    B = len(samples)
    L = max(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1), dtype=torch.float32)
    old_logprobs = torch.zeros((B, L - 1), dtype=torch.float32)
    for b, s in enumerate(samples):
        P, R = len(s.prompt_token_ids), len(s.response_token_ids)
        input_ids[b, : P + R] = torch.tensor(s.prompt_token_ids + s.response_token_ids)
        attention_mask[b, : P + R] = 1
        # response token k sits at input position P + k, so it is the target at position P - 1 + k
        response_mask[b, P - 1 : P - 1 + R] = 1.0
        old_logprobs[b, P - 1 : P - 1 + R] = torch.tensor(s.response_logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "targets": input_ids[:, 1:].clone(),
        "response_mask": response_mask,
        "old_logprobs": old_logprobs,
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
    }
