"""The engine's append-in-place KV layer (serving/kv_cache.py): the same keys and values as
transformers' DynamicLayer through appends, outside replacements (padding, rows leaving) and
growth; no copy per step; views handed out earlier never change; the model's outputs are identical."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from clawflow.serving import kv_cache
from clawflow.serving.kv_cache import AppendLayer, new_cache


def test_appends_match_dynamic_layer_and_copy_once_per_slack(monkeypatch):
    monkeypatch.setattr(kv_cache, "SLACK", 4)
    ours, ref = AppendLayer(), DynamicLayer()
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(2, 3, 5, 8, generator=gen)
    ours.update(first, -first)
    ref.update(first, -first)
    prefix = ours.keys  # as the prefix cache keeps it
    kept = prefix.clone()
    buffers = set()
    for step in range(10):
        k = torch.randn(2, 3, 1, 8, generator=gen)
        if step == 6:  # the batcher slices a finished row out: a new tensor, adopted on the next update
            for layer in (ours, ref):
                layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]
        if step >= 6:
            k = k[[1]]
        got, want = ours.update(k, -k), ref.update(k, -k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        buffers.add(ours._kbuf.data_ptr())
    assert torch.equal(prefix, kept)  # never written over
    assert 3 <= len(buffers) <= 4  # grown every SLACK steps (and once after the slice), not every step


def test_model_outputs_identical_to_dynamic_cache(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 4093, 28, 2683, 30, 314]])
    with torch.inference_mode():
        out = {}
        for name, cache in (("append", new_cache()), ("dynamic", DynamicCache())):
            logits = [model(ids[:, :6], cache=cache, use_cache=True).logits[:, -1]]
            for i in range(6, ids.shape[1]):
                logits.append(model(ids[:, i:i + 1], cache=cache, use_cache=True).logits[:, -1])
            out[name] = torch.cat(logits)
        assert isinstance(cache.layers[0], DynamicLayer)
    assert torch.equal(out["append"], out["dynamic"])
