"""Attention for short training rows under CPU bf16 autocast (`train.autocast`).

What SDPA picks on a CPU, its flash-attention kernel, ran a 256-token causal forward + backward of
SmolLM2-135M's layer shape (8 rows, 9 query / 3 KV heads) in 33-38 ms under bf16; two bf16 matmuls
with each KV head's query heads stacked onto it and an fp32 softmax between them took 24 ms, which
is 0.3-0.4 s of a 6.5 s training step (bench/train.py). Their scores, B x heads x T^2 floats, are
kept for the backward, so this path is taken only while that stays under MAX_SCORES per layer;
longer rows (an agent's 8k-token prompt), decoding, fp32 and GPUs keep SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "clawflow_cpu_bf16"
MAX_SCORES = 8 * 2**20  # 32 MB of fp32 scores per layer (8 rows x 9 heads x 256^2 is 4.7M)


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, KV, T, D], a
    boolean mask [B or 1, 1, T, T] (True = attend) or None for plain causal; returns [B, T, H, D]."""
    b, h, t, d = query.shape
    kv = key.shape[1]
    if (dropout or t == 1 or key.shape[2] != t or b * h * t * t > MAX_SCORES or query.device.type != "cpu"
            or not torch.is_autocast_enabled("cpu")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    g = h // kv  # query heads i*g .. i*g+g-1 read KV head i (transformers' repeat_kv)
    scores = torch.matmul(query.reshape(b, kv, g * t, d), key.transpose(-1, -2)).float().view(b, kv, g, t, t)
    scores = scores * (scaling if scaling is not None else d ** -0.5)
    keep = attention_mask if attention_mask is not None else \
        torch.ones(t, t, dtype=torch.bool, device=query.device).tril()[None, None]
    # finite fill: a row with nothing to attend to (left padding) gets a uniform softmax, not NaNs
    scores = scores.masked_fill(~keep.view(keep.shape[0], 1, 1, t, t), torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, -1).to(value.dtype).view(b, kv, g * t, t)
    out = torch.matmul(probs, value).view(b, h, t, d)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use(model) -> None:
    """Have `model` (a transformers model, or a peft one around it) attend with `attention`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(NAME)
