"""Many adapters on one base in one forward (clawflow/serving/multi_lora.py): every row gets what
its own adapter (or the base) computes alone, in transformers' forward and in the fused step, and
a bad adapter is refused without touching the loaded ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from _adapters import make_adapters
from clawflow.serving import fused_step
from clawflow.serving.kv_cache import new_cache
from clawflow.serving.multi_lora import AdapterError, MultiLora, read_adapter

def _base(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))


def _reference(tiny_model_dir, adapter, ids: torch.Tensor) -> torch.Tensor:
    """Logits of `ids` [1, T] on the base alone (adapter None) or with one peft adapter attached."""
    model = _base(tiny_model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        return model(input_ids=ids).logits[0]


def test_rows_of_different_adapters_match_each_alone(tiny_model_dir, adapters):
    base = _base(tiny_model_dir)
    multi = MultiLora(base)
    for key, path in adapters.items():
        assert multi.load(key, read_adapter(path)) > 0
    ids = torch.randint(5, 2000, (5, 9), generator=torch.Generator().manual_seed(0))
    per_row = ["a0", None, "a1", "a2", "a0"]
    with torch.inference_mode(), multi.route(per_row, [ids.shape[1]] * len(per_row)):
        logits = base(input_ids=ids).logits
    for row, adapter in enumerate(per_row):
        want = _reference(tiny_model_dir, adapters.get(adapter), ids[row:row + 1])
        assert torch.allclose(logits[row], want, atol=1e-4), (row, adapter, (logits[row] - want).abs().max())
    # the same rows outside a route: the base alone, the adapters loaded but not asked for
    with torch.inference_mode():
        plain = base(input_ids=ids).logits
    assert torch.allclose(plain[2], _reference(tiny_model_dir, None, ids[2:3]), atol=1e-5)
    assert not torch.allclose(logits[0], plain[0], atol=1e-3)  # the adapter does change its rows


def test_fused_step_decode_rows_and_prompt_chunks_take_their_own_adapters(tiny_model_dir, adapters):
    """The serving path: decode rows and a prompt chunk in one flat forward, each on its adapter."""
    base = _base(tiny_model_dir)
    assert fused_step.supports(base)
    multi = MultiLora(base)
    for key in ("a0", "a1"):
        multi.load(key, read_adapter(adapters[key]))
    prompt = list(range(40, 52))
    # one chunk on a1 and one on the base, no decode rows
    chunks = [fused_step.Chunk(prompt, 0, new_cache()), fused_step.Chunk(prompt, 0, new_cache())]
    empty = torch.zeros(0, dtype=torch.long)
    with torch.inference_mode(), multi.route(["a1", None], [len(prompt), len(prompt)]):
        _, last = fused_step.forward(base, empty, empty, None, None, chunks)
    assert torch.allclose(last[0], _reference(tiny_model_dir, adapters["a1"], torch.tensor([prompt]))[-1], atol=1e-4)
    assert torch.allclose(last[1], _reference(tiny_model_dir, None, torch.tensor([prompt]))[-1], atol=1e-4)
    # next step: chunk 0's prompt decodes one token on a1 (a decode row) while a new prompt's chunk
    # rides along on a0, in the same forward
    cache, tok, other = chunks[0].cache, 77, list(range(300, 307))
    ride = fused_step.Chunk(other, 0, new_cache())
    with torch.inference_mode(), multi.route(["a1", "a0"], [1, len(other)]):
        rows, last = fused_step.forward(base, torch.tensor([tok]), torch.tensor([len(prompt)]),
                                        torch.ones(1, len(prompt) + 1, dtype=torch.long), cache, [ride])
    want = _reference(tiny_model_dir, adapters["a1"], torch.tensor([prompt + [tok]]))[-1]
    assert torch.allclose(rows[0], want, atol=1e-4), (rows[0] - want).abs().max()
    assert torch.allclose(last[0], _reference(tiny_model_dir, adapters["a0"], torch.tensor([other]))[-1], atol=1e-4)


def test_a_bad_adapter_is_refused_and_the_loaded_ones_keep_serving(tiny_model_dir, adapters, tmp_path):
    base = _base(tiny_model_dir)
    multi = MultiLora(base)
    multi.load("a0", read_adapter(adapters["a0"]))
    ids = torch.tensor([[11, 12, 13, 14]])
    with torch.inference_mode(), multi.route(["a0"], [4]):
        before = base(input_ids=ids).logits
    # a truncated weights file, a foreign module, a wrong shape, DoRA, a key already loaded
    broken = tmp_path / "broken"
    shutil.copytree(adapters["a1"], broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match="cannot read adapter"):
        read_adapter(broken)
    deltas = read_adapter(adapters["a1"])
    name = next(iter(deltas))
    with pytest.raises(AdapterError, match="does not have"):
        multi.load("x", {"model.layers.99.self_attn.q_proj": deltas[name]})
    wrong = dict(deltas)
    wrong["model.layers.0.mlp.down_proj"] = deltas[name]  # an attention projection's delta: 64 in, not 128
    with pytest.raises(AdapterError, match="the base's Linear"):
        multi.load("y", wrong)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["a1"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter(dora)
    with pytest.raises(AdapterError, match="already loaded"):
        multi.load("a0", deltas)
    with pytest.raises(ValueError, match="once"):
        MultiLora(base)  # wrapping the wrappers would route every delta twice
    assert multi.keys() == {"a0"}
    with pytest.raises(KeyError, match="not loaded"):
        with multi.route(["y"], [4]):
            pass
    with torch.inference_mode(), multi.route(["a0"], [4]):
        after = base(input_ids=ids).logits
    assert torch.equal(before, after)


def test_unloading_one_adapter_leaves_the_others_rows_unchanged(tiny_model_dir, adapters):
    base = _base(tiny_model_dir)
    multi = MultiLora(base)
    for key, path in adapters.items():
        multi.load(key, read_adapter(path))
    ids = torch.randint(5, 2000, (3, 6), generator=torch.Generator().manual_seed(1))
    route = (["a0", "a1", "a2"], [6, 6, 6])
    with torch.inference_mode(), multi.route(*route):
        before = base(input_ids=ids).logits
    multi.unload("a1")
    assert multi.keys() == {"a0", "a2"}
    with torch.inference_mode(), multi.route(["a0", None, "a2"], [6, 6, 6]):
        after = base(input_ids=ids).logits
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert torch.allclose(after[1], _reference(tiny_model_dir, None, ids[1:2]), atol=1e-5)


def test_decode_rows_of_many_adapters_match_each_row_alone(tiny_model_dir, adapters):
    """Decode rows, one per user, over adapters of several ranks and target modules (stacked per
    shape, serving/multi_lora.py `_singles`): each row as its adapter computes it alone."""
    base = _base(tiny_model_dir)
    multi = MultiLora(base)
    for key, path in adapters.items():
        multi.load(key, read_adapter(path))
    doubled = {k: type(d)(d.a_t * 2, d.b_t * -0.25) for k, d in read_adapter(adapters["a0"]).items()}
    multi.load("a0x2", doubled)  # a0's shape, half its delta negated: in the slot beside a0's
    multi.load("a0x3", {k: type(d)(d.a_t, d.b_t * 3) for k, d in doubled.items()})  # a third: the 2 slots grow
    ids = torch.randint(5, 2000, (8, 1), generator=torch.Generator().manual_seed(2))

    def check(per_row):
        with torch.inference_mode(), multi.route(per_row):
            logits = base(input_ids=ids).logits[:, -1]
        for row, key in enumerate(per_row):
            with torch.inference_mode(), multi.route([key]):
                alone = base(input_ids=ids[row:row + 1]).logits[0, -1]
            assert torch.allclose(logits[row], alone, atol=1e-5), (row, key, (logits[row] - alone).abs().max())
        want = _reference(tiny_model_dir, adapters["a0"], ids[5:6])[-1]
        assert torch.allclose(logits[5], want, atol=1e-4)  # a0's rows are a0's, as peft computes them
        return logits

    logits = check(["a0", "a1", None, "a0x2", "a2", "a0", "a1", "a0x3"])
    assert not torch.allclose(logits[0], logits[3], atol=1e-3)  # a0 and a0x2 differ
    multi.unload("a0x2")  # its slot is freed and taken by the next load, the others untouched
    multi.load("a0x4", {k: type(d)(d.a_t, -d.b_t) for k, d in doubled.items()})
    check(["a0", "a0x4", "a0x3", "a0x3", "a2", "a0", None, "a0x4"])
    for i in range(3):  # past the first 4 slots: they grow, and every loaded adapter keeps its delta
        multi.load(f"g{i}", {k: type(d)(d.a_t, d.b_t * (i + 5)) for k, d in doubled.items()})
    check(["g2", "a0x4", "a0x3", "g0", "a1", "a0", None, "g1"])
    multi.unload("g0")  # its slot goes to an adapter of q_proj only: the other Linears' slot is zeroed
    multi.load("q_only", {k: d for k, d in doubled.items() if k.endswith("q_proj")})
    check(["q_only", "a0x4", "g1", "a0", "a0", "a0", None, "q_only"])
