"""LoRA end to end: an adapter-only checkpoint (KBs, not the model), the next run continuing the
champion's adapter and AdamW state, the embedded engine serving it on the weights it already
holds (no copy), and the merge-to-full export."""

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clawflow.config import REPO_ROOT, load_config
from clawflow.serving.engine import TorchEngine

import _recipe_here as recipe_here

PROMPTS = [[1, 9690, 198, 2683, 314], [1, 4093, 28, 2683, 30, 314]]
REWARDS = [1.0, -1.0]
pytestmark = pytest.mark.slow  # two training runs (in this process), a merge subprocess and a gateway


def response_logprob(model, prompt, response) -> float:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return float(lp.gather(-1, torch.tensor(response)[:, None]).sum())


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows = []
    for prompt, reward in zip(PROMPTS, REWARDS):
        response = [100 + 7 * len(prompt) + k for k in range(6)]
        rows.append({"prompt_token_ids": prompt, "response_token_ids": response, "reward": reward,
                     "response_logprobs": [-10.0] * 6})
    pq.write_table(pa.Table.from_pylist(rows), tmp / "samples.parquet")
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp / "home")
    raw["train"].update(lr=2e-2, epochs=2, micro_batch=2, lora={"r": 4, "alpha": 8})
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "cfg.yaml")
    recipe_here.train(tmp / "cfg.yaml", cfg, Path(tiny_model_dir), tmp / "samples.parquet", tmp / "v1")
    return tmp, base, rows, cfg


def test_lora_checkpoint_is_the_adapter_and_learns(tiny_model_dir, lora_run):
    tmp, base, rows, cfg = lora_run
    out = tmp / "v1"
    names = {f.name for f in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names)
    full = sum(f.stat().st_size for f in Path(tiny_model_dir).glob("*.safetensors"))
    assert (out / "adapter_model.safetensors").stat().st_size < full / 20
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      out).eval()
    for row in rows:
        before = response_logprob(base, row["prompt_token_ids"], row["response_token_ids"])
        after = response_logprob(tuned, row["prompt_token_ids"], row["response_token_ids"])
        assert (after - before) * row["reward"] > 0, (row["reward"], before, after)

    # the next run starts from this adapter (the champion) and its AdamW state
    recipe_here.train(tmp / "cfg.yaml", cfg, out, tmp / "samples.parquet", tmp / "v2", parent_version=1)
    log = (tmp / "v2.log").read_text()
    assert f"AdamW state from {out}" in log
    v2 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                   tmp / "v2").eval()
    row = rows[0]
    assert response_logprob(v2, row["prompt_token_ids"], row["response_token_ids"]) > \
        response_logprob(tuned, row["prompt_token_ids"], row["response_token_ids"])


def test_engine_serves_the_adapter_on_its_own_weights_and_merge_matches(tiny_model_dir, lora_run):
    tmp, _, rows, _ = lora_run
    engine = TorchEngine(tiny_model_dir)
    served = engine._policy.model
    embed = served.get_input_embeddings().weight
    engine.reload(str(tmp / "v1"), 1)
    assert engine.policy_version == 1 and engine._policy.model is not served
    new = engine._policy.model
    assert new.get_input_embeddings().weight.data_ptr() == embed.data_ptr()  # no weight copy
    assert not hasattr(served, "clawflow_multi_lora")  # the old object, still serving in-flight requests, is untouched
    row = rows[0]
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                     tmp / "v1").eval()
    got = sum(engine.score(row["prompt_token_ids"], row["response_token_ids"]))
    assert got == pytest.approx(response_logprob(want, row["prompt_token_ids"], row["response_token_ids"]), abs=1e-4)
    engine.reload(str(tmp / "v1"), 2)  # another adapter version: the same base tensors again
    assert engine._policy.model.get_input_embeddings().weight.data_ptr() == embed.data_ptr()

    merged = tmp / "merged"
    subprocess.run([sys.executable, "-m", "clawflow.train.lora", str(tmp / "v1"), str(merged)], check=True,
                   capture_output=True, timeout=120)
    m = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert response_logprob(m, row["prompt_token_ids"], row["response_token_ids"]) == pytest.approx(got, abs=1e-4)
    bad = subprocess.run([sys.executable, "-m", "clawflow.train.lora", tiny_model_dir, str(tmp / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is not a LoRA adapter directory" in bad.stderr


def test_bf16_weights_engine_serves_the_adapter_in_fp32_on_bf16_base_weights(tiny_model_dir, lora_run):
    from clawflow.policy.bf16_weights import BF16Linear

    tmp, _, rows, _ = lora_run
    engine = TorchEngine(tiny_model_dir, dtype="bf16-weights", prefix_cache_tokens=0)
    try:
        engine.reload(str(tmp / "v1"), 1)
        model = engine._policy.model
        multi = model.clawflow_multi_lora  # the adapter is the default of the per-row LoRA path
        layers = [layer for layer in multi.layers.values() if multi.default in layer.deltas]
        deltas = [layer.deltas[multi.default] for layer in layers]
        # the adapter as the trainer holds it (fp32), on bf16 base weights
        assert deltas and all(d.a_t.dtype == d.b_t.dtype == torch.float32 for d in deltas)
        assert all(isinstance(x.base, BF16Linear) and x.base.weight.dtype == torch.bfloat16 for x in layers)
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                         tmp / "v1").eval()
        row = rows[0]
        got = sum(engine.score(row["prompt_token_ids"], row["response_token_ids"]))
        exact = response_logprob(want, row["prompt_token_ids"], row["response_token_ids"])
        assert got != exact and got == pytest.approx(exact, abs=0.1 * len(row["response_token_ids"]))
    finally:
        engine.close()


def test_gateway_reloads_an_adapter_directory(make_config, lora_run):
    import httpx

    from conftest import admin, running_gateway

    tmp = lora_run[0]
    cfg = make_config()
    with running_gateway(cfg):
        r = httpx.post(f"{cfg.gateway_url}/admin/reload", json={"path": str(tmp / "v1"), "version": 7},
                       headers=admin(cfg), timeout=120)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{cfg.gateway_url}/admin/policy", headers=admin(cfg)).json()["version"] == 7
        chat = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {cfg.serving.api_key}"},
                          json={"model": cfg.model.name, "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 3})
        assert chat.status_code == 200 and chat.json()["system_fingerprint"] == "policy-v7"


def test_lora_adapter_rides_on_the_packed_base(tiny_model_dir, lora_run):
    from clawflow.policy.packed_linear import PackedLinear

    tmp, _, rows, _ = lora_run
    engine = TorchEngine(tiny_model_dir, prefix_cache_tokens=0, linear_kernel="onednn")
    try:
        engine.reload(str(tmp / "v1"), 1)
        multi = engine._policy.model.clawflow_multi_lora
        bases = [layer.base for layer in multi.layers.values() if multi.default in layer.deltas]
        assert bases and all(type(b) is PackedLinear for b in bases)
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                         tmp / "v1").eval()
        row = rows[0]
        got = sum(engine.score(row["prompt_token_ids"], row["response_token_ids"]))  # under inference mode
        exact = response_logprob(want, row["prompt_token_ids"], row["response_token_ids"])
        assert got == pytest.approx(exact, abs=1e-3)  # fp32 either way
    finally:
        engine.close()
