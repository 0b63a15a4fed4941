"""Prepacked fp32 Linears (policy/packed_linear.py): the same Parameters (tied weights stay tied),
oneDNN's packed kernel used under inference mode with fp32 results, the plain path under autograd, a
weight changed in place packed again; an engine that packs serves the same tokens as one that does
not, across a reload; `auto` settles on a kernel (a LoRA adapter on the packed base: test_train_lora.py)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile
from transformers import AutoModelForCausalLM

from clawflow.policy import packed_linear
from clawflow.policy.packed_linear import PackedLinear, pack_linears, unpack_linears
from clawflow.serving.engine import SamplingParams, TorchEngine

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN prepacked linear")

IDS = torch.tensor([[1, 9690, 198, 2683, 314, 4093, 28], [1, 2683, 314, 9690, 198, 28, 4093]])


def _ops(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_packed_model_keeps_its_parameters_and_computes_the_same(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    params = {n: p for n, p in model.named_parameters()}
    with torch.inference_mode():
        want = model(IDS).logits
    n = pack_linears(model)
    assert n == sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)) and n > 0
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert {n: p for n, p in model.named_parameters()} == params  # the very same Parameter objects
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" in _ops(lambda: model(IDS))
        got = model(IDS).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)

    # autograd on (training): the plain path, gradients flow
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: model(IDS).logits.sum().backward())
    assert model.lm_head.weight.grad is not None

    # a weight changed in place is packed again before it is used
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode():
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5)

    unpack_linears(model)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert not any(hasattr(m, "_packed") for m in model.modules())


def test_only_fp32_linears_are_packed(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    assert pack_linears(model) == 0
    assert packed_linear.speedup(model) == 0.0


def test_speedup_is_measured_and_leaves_the_model_unpacked(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gain = packed_linear.speedup(model, reps=1)
    assert gain > 0
    assert not any(type(m) is PackedLinear for m in model.modules())


def test_engine_on_packed_weights_serves_what_aten_serves(tiny_model_dir):
    packed = TorchEngine(tiny_model_dir, prefix_cache_tokens=0, linear_kernel="onednn")
    plain = TorchEngine(tiny_model_dir, prefix_cache_tokens=0, linear_kernel="aten")
    try:
        assert packed.linear_kernel == "onednn" and type(packed._policy.model.lm_head) is PackedLinear
        assert plain.linear_kernel == "aten" and type(plain._policy.model.lm_head) is torch.nn.Linear
        prompt = packed.encode_chat([{"role": "user", "content": "hi there"}])
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        a, b = packed.generate(prompt, params), plain.generate(prompt, params)
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        packed.reload(tiny_model_dir, 1)  # a reload packs the new model too
        assert packed.policy_version == 1 and type(packed._policy.model.lm_head) is PackedLinear
        assert packed.generate(prompt, params).token_ids == b.token_ids
    finally:
        packed.close()
        plain.close()


def test_auto_settles_on_one_kernel(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, prefix_cache_tokens=0, linear_kernel="auto")
    try:
        assert engine.linear_kernel in {"onednn", "aten"}
        packed = type(engine._policy.model.lm_head) is PackedLinear
        assert packed == (engine.linear_kernel == "onednn")
    finally:
        engine.close()



def test_bf16_weights_are_packed_as_bf16(tiny_model_dir):
    from clawflow.policy.bf16_weights import BF16Linear, bf16_weights
    from clawflow.policy.packed_linear import PackedBF16Linear

    model = bf16_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval())
    with torch.inference_mode():
        want = model(IDS).logits
    if not packed_linear.can_pack(torch.bfloat16):  # e.g. an AVX2-only CPU: oneDNN's bf16 path raises
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(model.lm_head.weight.detach(), None)
        assert pack_linears(model) == 0
        assert all(type(m) is BF16Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
        with torch.inference_mode():
            assert torch.equal(model(IDS).logits, want)
        return
    assert pack_linears(model) > 0
    assert all(type(m) is PackedBF16Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" in _ops(lambda: model(IDS))
        got = model(IDS).logits
    assert got.dtype == torch.float32  # activations stay fp32
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)  # the same bf16 products, another accumulation order
    unpack_linears(model)
    assert all(type(m) is BF16Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_bf16_weights_engine_packs_when_told(tiny_model_dir):
    from clawflow.policy.packed_linear import PackedBF16Linear

    engine = TorchEngine(tiny_model_dir, dtype="bf16-weights", prefix_cache_tokens=0, linear_kernel="onednn")
    try:
        if packed_linear.can_pack(torch.bfloat16):
            assert type(engine._policy.model.lm_head) is PackedBF16Linear and engine.linear_kernel == "onednn"
        else:  # this CPU cannot: told onednn, it serves on aten and says so
            assert type(engine._policy.model.lm_head) is not PackedBF16Linear and engine.linear_kernel == "aten"
        prompt = engine.encode_chat([{"role": "user", "content": "hi"}])
        g = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0))
        assert len(g.token_ids) >= 1 and all(lp <= 0 for lp in g.logprobs)
    finally:
        engine.close()


def test_a_dtype_this_cpu_cannot_pack_stays_plain(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(packed_linear, "_can_pack", {torch.float32: False})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert pack_linears(model) == 0 and not any(type(m) is PackedLinear for m in model.modules())
    engine = TorchEngine(tiny_model_dir, prefix_cache_tokens=0, linear_kernel="onednn")
    try:
        assert engine.linear_kernel == "aten" and type(engine._policy.model.lm_head) is not PackedLinear
    finally:
        engine.close()
    monkeypatch.setattr(packed_linear, "_can_pack", {})
    assert packed_linear.can_pack(torch.float32) == packed_linear.available()  # fp32 packs wherever oneDNN is built


def test_pack_if_faster_packs_exactly_when_it_measures_a_gain(tiny_model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    monkeypatch.setattr(packed_linear, "_verdicts", {})
    monkeypatch.setattr(packed_linear, "speedup", lambda m: 1.0)  # not faster here: stays plain
    assert not packed_linear.pack_if_faster(model)
    assert not any(type(m) is PackedLinear for m in model.modules())
    monkeypatch.setattr(packed_linear, "speedup", lambda m: pytest.fail("measured twice"))
    assert not packed_linear.pack_if_faster(model)  # the verdict is kept for this model shape
    monkeypatch.setattr(packed_linear, "_verdicts", {})
    monkeypatch.setattr(packed_linear, "speedup", lambda m: 1.5)
    assert packed_linear.pack_if_faster(model)
    assert type(model.lm_head) is PackedLinear
