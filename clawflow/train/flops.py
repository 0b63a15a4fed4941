"""Training FLOPs and a measured matmul peak, for an honest MFU (model FLOP utilization).

Per real (non-padding) token the model's matmuls cost 2 * N_body FLOPs forward (N_body = weights
outside the embedding), attention 4 * n_layers * hidden * context forward (QK^T and AV: 2 * hidden
multiply-adds per key and layer each), and the LM head 2 * V * hidden forward but only at the
positions whose logits the loss reads. `context` is the mean number of keys a query attends to:
under the causal mask the token at position i sees i + 1, so a sequence of L tokens averages
(L + 1) / 2, not L (`causal_context`; PaLM's appendix B formula counts the full L, i.e. also the
masked half that a causal kernel skips). Backward is 2x forward for full fine-tuning; with frozen
weights (LoRA) their weight gradients are skipped, so frozen matmuls cost 2x forward in total
instead of 3x. The peak is measured, not taken from a datasheet: the best of a few square
matmuls in the training dtype on this device with the current thread count.
"""

from __future__ import annotations

import resource
import time

import torch
from torch import nn


def param_counts(model: nn.Module) -> dict[str, int]:
    """{"body", "body_trainable", "embed"}: parameters outside/inside the input embedding."""
    embed = model.get_input_embeddings().weight
    seen, body, trainable = {id(embed)}, 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        body += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"body": body, "body_trainable": trainable, "embed": embed.numel()}


def causal_context(lengths) -> float:
    """Mean keys attended per query under a causal mask, over sequences of these real lengths:
    sum L(L+1)/2 / sum L; (L + 1) / 2 for one sequence. The `context` of `train_flops`."""
    lengths = [int(n) for n in lengths if n > 0]
    return sum(n * (n + 1) / 2 for n in lengths) / sum(lengths) if lengths else 0.0


def train_flops(counts: dict[str, int], n_layers: int, hidden: int, vocab: int, tokens: int,
                context: float, logit_tokens: int, head_trainable: bool = True) -> float:
    """FLOPs of one forward + backward over `tokens` real tokens whose queries attend to `context`
    keys on average (`causal_context` of their sequence lengths for causal attention)."""
    frozen = counts["body"] - counts["body_trainable"]
    body = tokens * (6 * counts["body_trainable"] + 4 * frozen)
    attention = tokens * 3 * 4 * n_layers * hidden * context
    head = logit_tokens * (6 if head_trainable else 4) * vocab * hidden
    return float(body + attention + head)


def matmul_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                      n: int = 1024, seconds: float = 1.0, clock=time.perf_counter) -> float:
    """Best FLOP/s of n x n matmuls over ~`seconds` (the denominator of MFU). With
    `clock=time.process_time` it is FLOP per CPU-second of this process (all its threads)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b  # warm up
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = clock()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n**3 / max(clock() - t0, 1e-9))
    return best


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
