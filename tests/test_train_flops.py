"""The MFU numerator (clawflow/train/flops.py) on cases worked by hand, and against the multiply-adds
torch really performs (FlopCounterMode) on a tiny Llama: causal attention counts the keys each
query sees (i + 1 at position i), not the full square."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from clawflow.train.flops import causal_context, param_counts, train_flops


def test_causal_context_by_hand():
    assert causal_context([3]) == 2.0  # keys seen: 1 + 2 + 3 = 6 over 3 queries
    assert causal_context([4]) == 2.5  # (L + 1) / 2
    assert causal_context([1, 3]) == 1.75  # (1) + (1 + 2 + 3) = 7 keys over 4 queries
    assert causal_context([256] * 8) == 128.5  # bench/train.py's batch: not 256
    assert causal_context([0, 3]) == 2.0 and causal_context([]) == 0.0  # padding rows see nothing


def test_train_flops_by_hand():
    """2 layers, hidden 4, vocab 5, one sequence of 3 tokens, logits at 2 positions, 10 body weights.
    Forward: body 2*10 per token; attention per layer 4 * hidden * (keys seen: 1 + 2 + 3 = 6) = 96;
    head 2 * 5 * 4 per logit position. Training: 3x forward for what is trained, 2x for what is frozen."""
    ctx = causal_context([3])
    full = train_flops({"body": 10, "body_trainable": 10, "embed": 20}, 2, 4, 5, 3, ctx, 2)
    body, attention, head = 3 * 6 * 10, 3 * (2 * 96), 2 * 6 * 5 * 4
    assert full == body + attention + head == 180 + 576 + 240
    # LoRA: 4 of the 10 body weights trained, the (tied) head frozen; attention's backward is the same
    lora = train_flops({"body": 10, "body_trainable": 4, "embed": 20}, 2, 4, 5, 3, ctx, 2, head_trainable=False)
    assert lora == 3 * (6 * 4 + 4 * 6) + 576 + 2 * 4 * 5 * 4 == 880
    # counting the full square (context L = 3) would add the 3 masked keys per layer: 9 vs 6
    assert train_flops({"body": 10, "body_trainable": 10, "embed": 20}, 2, 4, 5, 3, 3.0, 2) - full == 576 / 2


def causal_attention_by_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[heads, L, d] attention where query i is multiplied with keys 0..i only, as a causal kernel does."""
    out = []
    for i in range(q.shape[1]):
        s = q[:, i : i + 1] @ k[:, : i + 1].transpose(-1, -2) / q.shape[-1] ** 0.5
        out.append(torch.softmax(s, -1) @ v[:, : i + 1])
    return torch.cat(out, 1)


def test_attention_term_matches_the_multiply_adds_of_a_causal_attention():
    heads, d, L = 3, 8, 7
    q, k, v = (torch.randn(heads, L, d) for _ in range(3))
    with FlopCounterMode(display=False) as fc:
        causal_attention_by_query(q, k, v)
    # one layer, forward: the attention term of train_flops / 3 (training = 3x forward), nothing else
    counted = train_flops({"body": 0, "body_trainable": 0, "embed": 0}, 1, heads * d, 1, L, causal_context([L]), 0) / 3
    assert fc.get_total_flops() == counted == 4 * heads * d * L * (L + 1) / 2


def test_forward_terms_match_a_real_model():
    """A tiny Llama in eager attention (which multiplies the full L x L square, masked half included):
    the body, LM head and full-square attention terms add up to what torch counts, to the norms'
    weights (counted in N_body, no matmul)."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "eager"
    B, L = 2, 5
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=torch.randint(0, 64, (B, L)))
    counts = param_counts(model)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    forward = train_flops(counts, 2, 16, 64, B * L, L, B * L) / 3 - 2 * norms * B * L
    assert fc.get_total_flops() == pytest.approx(forward, rel=1e-9)
    # a causal kernel skips the masked half: the attention term at causal_context, (L + 1) / 2 of L
    square = train_flops(counts, 2, 16, 64, B * L, L, 0) - train_flops(counts, 2, 16, 64, B * L, 0, 0)
    causal = train_flops(counts, 2, 16, 64, B * L, causal_context([L] * B), 0) - train_flops(counts, 2, 16, 64,
                                                                                            B * L, 0, 0)
    assert causal / square == pytest.approx((L + 1) / (2 * L))
