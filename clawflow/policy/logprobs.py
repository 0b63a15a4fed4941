"""The one way to score replies: log pi(response token | prompt, earlier response tokens).

Batched and padding-aware (prompts left-padded, responses right-padded by `train.batch.collate`);
only the last R + 1 positions get logits (`logits_to_keep`) and the log-softmax over the vocabulary
runs in chunks (`train.loss.sequence_logprobs`). No `no_grad` here: the trainer's forward keeps its
graph; callers that only evaluate wrap the call in `torch.inference_mode()` (the engine, the gate,
the start-of-run pass in `train.scoring`).
"""

from __future__ import annotations

import torch

from clawflow.train.batch import collate
from clawflow.train.loss import sequence_logprobs


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
