"""Shared helpers and fixtures of the gateway tests (tests/test_gateway_*.py, test_serving_batch.py).

The fixtures are imported into tests/conftest.py, so every test file shares one `served` gateway
(session scope, policy version 0 throughout): tests tell their turns apart by `X-Session-Id` or by
unique message text; tests that reload weights or stop the server start their own (`gateway`,
`running_gateway`).
"""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from openai import OpenAI

from clawflow.config import REPO_ROOT, load_config
from conftest import admin, free_port, running_gateway

MODEL = "clawflow-tiny"


# -- helpers -----------------------------------------------------------------------------------
def client_for(cfg, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=key or cfg.serving.api_key, max_retries=0, timeout=120)


def user(cfg) -> dict:
    return {"Authorization": f"Bearer {cfg.serving.api_key}"}


def shard_rows(home: Path) -> list[dict]:
    files = sorted((Path(home) / "shards").rglob("*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def sealed_turns(cfg) -> list[dict]:
    """Seal everything through the admin route, then read every shard the gateway wrote."""
    r = httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg), timeout=60)
    assert r.status_code == 200, r.text
    return shard_rows(cfg.home)


def turns_of(cfg, session_id: str) -> list[dict]:
    return sorted((t for t in sealed_turns(cfg) if t["session_id"] == session_id), key=lambda t: t["created_at"])


def only_turn(cfg, session_id: str) -> dict:
    turns = turns_of(cfg, session_id)
    assert len(turns) == 1, f"expected one turn in session {session_id}, got {len(turns)}"
    return turns[0]


def assert_error_json(r: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if type_:
        assert err["type"] == type_
    return err


def plain(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def logprob_table(path: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), vocab] log-softmax of the model at `path` over each response position."""
    logits = hf_model(path)(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def logprobs_under(path: str, prompt: list[int], response: list[int]) -> list[float]:
    table = logprob_table(path, prompt, response)
    return table.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


FIXED = [{"role": "user", "content": "Say hello."}]


def fixed_score(app) -> list[float]:
    engine = app.state.gateway.engine
    prompt = engine.encode_chat(FIXED)
    reply = engine.tokenizer.encode("Hello there! How can I help?", add_special_tokens=False)
    return engine.score(prompt, reply)


def metrics(cfg) -> dict[str, float]:
    r = httpx.get(f"{cfg.gateway_url}/metrics")
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def served(tmp_path_factory, tiny_model_dir):
    """One gateway on the tiny model shared by the read-mostly gateway tests (never reloaded, version 0)."""
    tmp = tmp_path_factory.mktemp("served")
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp / "home")
    raw["model"] = {"name": MODEL, "path": tiny_model_dir}
    raw["serving"]["port"] = free_port()
    (tmp / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "config.yaml")
    with running_gateway(cfg) as app:
        yield cfg, app


@pytest.fixture(scope="session")
def perturbed_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A valid checkpoint: the tiny model with noise added to every weight (tokenizer copied)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ckpt") / "perturbed"
    shutil.copytree(tiny_model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return str(out)


# SmolLM2's byte-level BPE has one token per raw byte; "€" is the three bytes E2 82 AC.
def _byte_token_names() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="session")
def euro_model_dir(tmp_path_factory, tiny_model_dir) -> tuple[str, list[int]]:
    """A crafted checkpoint that always answers with the bytes of "€€€…", one byte token at a time.

    Every layer's output projection is zeroed, so the last hidden state depends only on the current
    token (a bigram model); the untied lm_head maps "\\n" (end of the generation prompt) → E2 → 82
    → AC → E2 … with logits so large that sampling at any temperature picks them.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    names = _byte_token_names()
    e2, x82, ac = (tok.convert_tokens_to_ids(names[b]) for b in b"\xe2\x82\xac")
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    assert len({e2, x82, ac, newline, tok.unk_token_id}) == 5

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        basis = torch.eye(config.hidden_size)
        for i, t in enumerate((newline, e2, x82, ac)):
            emb[t] = basis[i]
        head.zero_()
        head[e2] = 10 * (basis[0] + basis[3])  # after "\n" or AC comes E2
        head[x82] = 10 * basis[1]  # after E2 comes 82
        head[ac] = 10 * basis[2]  # after 82 comes AC
    out = tmp_path_factory.mktemp("ckpt") / "euro"
    shutil.copytree(tiny_model_dir, out)
    model.save_pretrained(out)
    return str(out), [e2, x82, ac]
