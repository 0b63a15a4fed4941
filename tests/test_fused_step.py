"""The fused decode step (clawflow/serving/fused_step.py): a batch's decode step and prompt chunks in
one forward give what transformers' own forward gives them apart, and the engine uses it: a prompt
that arrives while others decode is prefilled inside their steps; a model it does not know is served
by transformers' forward as before. Real forward passes of tiny random-weight models."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from clawflow.serving import fused_step
from clawflow.serving.engine import SamplingParams, TorchEngine
from clawflow.serving.kv_cache import new_cache
from _gateway_helpers import close, logprobs_under


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _tiny(cls, config_cls, **extra):
    torch.manual_seed(0)
    model = cls(config_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: give them values, so they count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A tiny random Mistral with sliding-window attention (which fused_step does not write out), with
    the tiny model's tokenizer."""
    out = tmp_path_factory.mktemp("mistral")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**{**SHAPE, "vocab_size": len(tok)}, sliding_window=4096,
                                     eos_token_id=tok.eos_token_id)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _batch(model, prompts: list[list[int]]):
    """A left-padded batch prefilled by transformers: (cache, mask [B, T], next positions [B])."""
    t = max(map(len, prompts))
    ids = torch.tensor([[0] * (t - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = new_cache()
    model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    return cache, mask, torch.tensor([len(p) for p in prompts])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@torch.inference_mode()
def test_fused_forward_matches_transformers_apart(llama, arch):
    """Three left-padded decode rows, a fresh prompt and the second chunk of a prompt whose first
    chunk is cached: the same logits and the same KV as transformers' forward on each part alone
    (SmolLM2's tiny Llama; a Qwen2 with q/k/v biases; a Mistral without sliding windows)."""
    if arch != "llama":
        llama = _tiny(Qwen2ForCausalLM, Qwen2Config) if arch == "qwen2" else \
            _tiny(MistralForCausalLM, MistralConfig, sliding_window=None)
    assert fused_step.supports(llama)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 3, 12)]
    last = torch.tensor([11, 22, 33])
    fresh = torch.randint(5, 200, (9,), generator=g).tolist()
    head, tail = torch.randint(5, 200, (6,), generator=g).tolist(), torch.randint(5, 200, (5,), generator=g).tolist()

    def reference():
        cache, mask, pos = _batch(llama, prompts)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        rows = llama(last[:, None], attention_mask=mask, position_ids=pos[:, None], cache=cache,
                     use_cache=True).logits[:, -1]
        c1 = new_cache()
        a = llama(torch.tensor([fresh]), cache=c1, use_cache=True).logits[0, -1]
        c2 = new_cache()
        llama(torch.tensor([head]), cache=c2, use_cache=True)
        b = llama(torch.tensor([tail]), cache=c2, use_cache=True, position_ids=torch.arange(6, 11)[None]).logits[0, -1]
        return rows, torch.stack([a, b]), (cache, c1, c2)

    ref_rows, ref_chunks, ref_caches = reference()
    cache, mask, pos = _batch(llama, prompts)
    mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    c1, c2 = new_cache(), new_cache()
    llama(torch.tensor([head]), cache=c2, use_cache=True)
    rows, chunks = fused_step.forward(llama, last, pos, mask, cache,
                                      [fused_step.Chunk(fresh, 0, c1), fused_step.Chunk(tail, 6, c2)])
    assert rows.shape == ref_rows.shape and chunks.shape == ref_chunks.shape
    assert (rows - ref_rows).abs().max() < 1e-4 and (chunks - ref_chunks).abs().max() < 1e-4
    for got, want in zip((cache, c1, c2), ref_caches):
        for lg, lw in zip(got.layers, want.layers):
            assert lg.keys.shape == lw.keys.shape and (lg.keys - lw.keys).abs().max() < 1e-5
            assert (lg.values - lw.values).abs().max() < 1e-5
    # no decode rows: chunks alone (the first prompts of an idle engine, prefilled together)
    none = torch.zeros(0, dtype=torch.long)
    _, alone = fused_step.forward(llama, none, none, None, None, [fused_step.Chunk(fresh, 0, new_cache())])
    assert (alone[0] - ref_chunks[0]).abs().max() < 1e-4


def test_supports_llama_and_its_adapters_not_other_architectures(llama, mistral_dir):
    from peft import LoraConfig, get_peft_model

    assert fused_step.supports(llama)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    assert fused_step.supports(get_peft_model(copy.deepcopy(llama), lora))
    assert not fused_step.supports(AutoModelForCausalLM.from_pretrained(mistral_dir))  # sliding windows
    assert not fused_step.supports(_tiny(Qwen3ForCausalLM, Qwen3Config))  # q/k norms
    assert not fused_step.supports(_tiny(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=True, sliding_window=8,
                                         max_window_layers=0))


def _a_then_b(model_dir: str):
    """Stream A decodes; prompt B arrives meanwhile. (engine, B's prompt, B's generation, B alone)."""
    engine = TorchEngine(model_dir, max_batch=4, max_queue=4, prefix_cache_tokens=0)
    started = threading.Event()
    try:
        a = engine.submit(engine.encode_chat([{"role": "user", "content": "hi"}]),
                          SamplingParams(max_new_tokens=60, temperature=1.0, seed=1),
                          lambda *_: started.set() or True)
        assert started.wait(60)
        prompt = engine.encode_chat([{"role": "user", "content": "tell me " * 12}])
        b = engine.submit(prompt, SamplingParams(max_new_tokens=8, seed=2)).result(timeout=120)
        a.result(timeout=120)
        alone = engine.generate(prompt, SamplingParams(max_new_tokens=8, seed=2))
        return engine.batcher.fused_chunks, prompt, b, alone
    finally:
        engine.close()


def test_a_prompt_rides_in_the_decode_step_exactly(tiny_model_dir):
    fused, prompt, b, alone = _a_then_b(tiny_model_dir)
    assert fused >= 1
    assert b.token_ids == alone.token_ids
    assert close(b.logprobs, logprobs_under(tiny_model_dir, prompt, b.token_ids), 1e-4)


def test_a_model_it_does_not_know_is_served_by_transformers_forward(mistral_dir):
    fused, prompt, b, alone = _a_then_b(mistral_dir)
    assert fused == 0
    assert b.token_ids == alone.token_ids
    assert close(b.logprobs, logprobs_under(mistral_dir, prompt, b.token_ids), 1e-4)


def test_a_bad_prompt_fails_alone_and_the_stream_it_rode_with_goes_on(tiny_model_dir):
    """A prompt with a token id past the vocabulary makes the fused forward raise: every cache is
    rolled back, the parts run apart, and only that request fails; the decoding stream's tokens are
    those it gets alone."""
    engine = TorchEngine(tiny_model_dir, max_batch=4, max_queue=4, prefix_cache_tokens=0)
    started = threading.Event()
    prompt = engine.encode_chat([{"role": "user", "content": "hi"}])
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=1)
    try:
        a = engine.submit(prompt, params, lambda *_: started.set() or True)
        assert started.wait(60)
        bad = engine.submit([5, 6, len(engine.tokenizer) + 1000], SamplingParams(max_new_tokens=4, seed=2))
        with pytest.raises(IndexError):
            bad.result(timeout=120)
        got = a.result(timeout=120)
        assert got.token_ids == engine.generate(prompt, params).token_ids
        assert engine.batcher.active == 0
    finally:
        engine.close()
