"""bf16 weights under fp32 activations: the serving fast path on CPUs with native bf16 matmuls.

A decode step on CPU is weight-bound: each step streams every Linear weight through the cores once
(540 MB for SmolLM2-135M in fp32) for a handful of rows. Storing the Linear weights in bf16 halves
that and uses the CPU's bf16 dot-product instructions, while everything else stays fp32: the
embeddings, norms, rotary, attention and the KV cache. Full bf16 is not that: its attention and
KV traffic made a decode step after 4k cached tokens 2x SLOWER on an AVX512-BF16 EPYC, and an
agent's turn is mostly such steps. Measured there (2 threads, bench/dtype.py): decode 1.6x at
batch 1 and 8, 1.9x at 32, 1.3x after 4k cached tokens, prefill 1.4x.

`BF16Linear` is an `nn.Linear`, so peft attaches LoRA adapters to it as to any Linear; the
adapter's own weights are kept fp32 (`fp32_adapters`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class BF16Linear(torch.nn.Linear):
    """A Linear whose weight (and bias) are stored and multiplied in bf16; its input and output keep
    the activations' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def _convert(linear: torch.nn.Linear) -> BF16Linear:
    new = BF16Linear.__new__(BF16Linear)  # Linear.__init__ would allocate and init a weight to drop
    torch.nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    # a new Parameter: a weight tied to the embedding (the lm_head) is untied, the embedding stays fp32
    new.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
    new.bias = None if linear.bias is None else \
        torch.nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)
    return new


def bf16_weights(model: Any) -> Any:
    """`model` (fp32, for inference) with every plain nn.Linear turned into a BF16Linear, in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, _convert(child))
    return model


def fp32_adapters(model: Any) -> Any:
    """peft moves a LoRA adapter to its base layer's dtype; on BF16Linear bases keep it fp32 (it is
    small, and the trainer holds it in fp32)."""
    for name, param in model.named_parameters():
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()
    return model
