"""bf16-weights (policy/bf16_weights.py): only the Linear weights become bf16; embeddings, norms,
attention and the KV cache stay fp32; the tied lm_head is untied without touching the embedding;
the model's outputs stay close to fp32's; and an engine serves and reloads in it."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from clawflow.policy.bf16_weights import BF16Linear, bf16_weights
from clawflow.serving.engine import SamplingParams, TorchEngine


def test_only_linear_weights_become_bf16_and_outputs_stay_close(tiny_model_dir):
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    mixed = bf16_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())
    linears = [m for m in mixed.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is BF16Linear and m.weight.dtype == torch.bfloat16 for m in linears)
    embed = mixed.get_input_embeddings().weight
    assert embed.dtype == torch.float32 and mixed.lm_head.weight.data_ptr() != embed.data_ptr()
    assert all(p.dtype == torch.float32 for n, p in mixed.named_parameters() if "norm" in n)

    ids = torch.tensor([[1, 9690, 198, 2683, 314, 4093, 28]])
    with torch.inference_mode():
        cache = DynamicCache()
        got = torch.log_softmax(mixed(ids, cache=cache, use_cache=True).logits, -1)
        want = torch.log_softmax(fp32(ids).logits, -1)
    assert got.dtype == torch.float32
    assert cache.layers[0].keys.dtype == torch.float32  # attention and the KV cache stay fp32
    diff = (got - want).abs()
    assert 0 < float(diff.max()) < 0.1, float(diff.max())  # bf16-rounded, but close


def test_engine_serves_and_reloads_in_bf16_weights(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, dtype="bf16-weights", prefix_cache_tokens=0)
    ref = TorchEngine(tiny_model_dir, prefix_cache_tokens=0)
    try:
        assert engine.dtype == "bf16-weights" and isinstance(engine._policy.model.lm_head, BF16Linear)
        prompt = engine.encode_chat([{"role": "user", "content": "hi"}])
        g = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0))
        assert len(g.token_ids) >= 1 and all(lp <= 0 for lp in g.logprobs)
        exact = ref.score(prompt, g.token_ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, exact)) < 0.1  # what TIS corrects: small
        engine.reload(tiny_model_dir, 1)
        assert engine.policy_version == 1 and isinstance(engine._policy.model.lm_head, BF16Linear)
    finally:
        engine.close()
        ref.close()
