"""Eval gate on real checkpoints: normal → passes, NaN → rejected, degraded → rejected."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawflow.config import GateConfig, HelpfulnessGateConfig
from clawflow.policy.gate import evaluate, nonfinite_tensors


def variant(src: str, dst, fn) -> str:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        fn(model)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{src}/{f}", dst / f)
    return str(dst)


@pytest.fixture(scope="module")
def gate():
    # random weights answer nothing: tests/test_helpfulness.py covers that check
    return GateConfig(probes=["What is the capital of France?", "Say hello."], max_new_tokens=8,
                      helpfulness=HelpfulnessGateConfig(enabled=False))


def test_normal_update_passes(tiny_model_dir, tmp_path, gate):
    nudged = variant(tiny_model_dir, tmp_path / "nudged",
                     lambda m: [p.add_(1e-4 * torch.randn_like(p)) for p in m.parameters()])
    result = evaluate(gate, nudged, tiny_model_dir)
    assert result.passed, result.reason
    assert 0 < result.metrics["probe_kl"] < gate.max_kl
    assert result.metrics["probes"] == 2


def test_nan_weights_are_rejected_without_probing(tiny_model_dir, tmp_path, gate):
    broken = variant(tiny_model_dir, tmp_path / "nan", lambda m: m.model.layers[0].mlp.up_proj.weight.fill_(float("nan")))
    assert nonfinite_tensors(broken) == ["model.layers.0.mlp.up_proj.weight"]
    result = evaluate(gate, broken, tiny_model_dir)
    assert not result.passed and "non-finite" in result.reason
    assert "probe_kl" not in result.metrics


def test_degraded_weights_are_rejected(tiny_model_dir, tmp_path, gate):
    # Random tiny models are near-uniform, so noise barely moves them; scaling the (tied) output
    # embedding makes every next-token distribution sharp and wrong, as a diverged run would.
    degraded = variant(tiny_model_dir, tmp_path / "degraded", lambda m: m.model.embed_tokens.weight.mul_(50))
    result = evaluate(gate, degraded, tiny_model_dir)
    assert not result.passed and "KL" in result.reason
    assert result.metrics["probe_kl"] > gate.max_kl


def test_identical_checkpoint_has_zero_drift(tiny_model_dir, gate):
    result = evaluate(gate, tiny_model_dir, tiny_model_dir)
    assert result.passed
    assert result.metrics["probe_kl"] == pytest.approx(0, abs=1e-6)
    assert result.metrics["probe_nll_increase"] == pytest.approx(0, abs=1e-6)
