"""The SGLang engine adapter against a RECORDED HTTP CONTRACT, not a real SGLang server.

SGLang cannot run here (CUDA, or a CPU with AMX; its wheels pin their own torch). This test runs a
small real FastAPI app that answers SGLang's native routes with payloads shaped like SGLang's
(`python/sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`: `/generate` with
`input_ids`, `sampling_params`, `return_logprob`, streamed `data:` chunks with cumulative
`meta_info.output_token_logprobs` of `[logprob, token_id, null]`, `finish_reason.type`,
`weight_version`; `/update_weights_from_disk` and `/load_lora_adapter` answering `success`), and
checks what the adapter sends and what the gateway records. README says how to run it for real.

Logprob kind (SGLang's `Sampler`/`add_logprob_values`): with `SGLANG_RETURN_ORIGINAL_LOGPROB` unset,
returned logprobs (and `output_top_logprobs`, `[[logprob, token_id, null], ...]` per position) are
log_softmax(logits / temperature); with it set, log_softmax(logits). `/get_server_info` reports
server args, scheduler info and version, not that environment variable, so the adapter measures it.
The fake computes its top logprobs from fixed logits either way.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from conftest import admin, free_port, running_gateway
from _gateway_helpers import MODEL, client_for, sealed_turns

REPLY_IDS = [19556, 28, 905, 17]  # what the recorded server "samples"
REPLY_LPS = [-0.25, -1.5, -0.125, -2.0]


LOGITS = {19556: 2.0, 28: 1.0, 905: 0.5, 17: 0.0}  # next-token logits behind the top logprobs


def top_entry(temperature: float, original: bool) -> list:
    """SGLang's `[logprob, token_id, null]` of the top token: raw or after temperature."""
    scale = 1.0 if original or temperature == 0 else 1.0 / temperature
    norm = math.log(sum(math.exp(v * scale) for v in LOGITS.values()))
    tok = max(LOGITS, key=LOGITS.get)
    return [LOGITS[tok] * scale - norm, tok, None]


def fake_sglang(original: bool = True) -> tuple[FastAPI, list[tuple[str, dict]]]:
    """`original`: the server was started with SGLANG_RETURN_ORIGINAL_LOGPROB=1."""
    app, seen, state = FastAPI(), [], {"version": "0"}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        seen.append(("/generate", body))
        n = min(body["sampling_params"]["max_new_tokens"], len(REPLY_IDS))
        entries = [[lp, tok, None] for lp, tok in zip(REPLY_LPS[:n], REPLY_IDS[:n])]
        finish = {"type": "length", "length": n} if n < len(REPLY_IDS) else {"type": "stop", "matched": 2}
        top = [top_entry(body["sampling_params"].get("temperature", 1.0), original)] \
            if body.get("top_logprobs_num") else None

        def meta(k: int) -> dict:
            return {"id": "r1", "prompt_tokens": len(body["input_ids"]), "completion_tokens": k,
                    "cached_tokens": 0, "weight_version": state["version"], "output_token_logprobs": entries[:k],
                    "finish_reason": finish if k == n else None,
                    **({"output_top_logprobs": [top] * k} if top else {})}

        if not body.get("stream"):
            return {"text": "", "output_ids": REPLY_IDS[:n], "meta_info": meta(n)}

        def chunks():
            for k in range(1, n + 1):  # SGLang's default: cumulative output_ids and logprobs
                yield f"data: {json.dumps({'text': '', 'output_ids': REPLY_IDS[:k], 'meta_info': meta(k)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        body = await request.json()
        seen.append(("/update_weights_from_disk", body))
        if "missing" in body["model_path"]:
            return JSONResponse({"success": False, "message": "Failed to get weights iterator"}, status_code=400)
        state["version"] = body.get("weight_version") or state["version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/load_lora_adapter")
    async def lora(request: Request):
        body = await request.json()
        seen.append(("/load_lora_adapter", body))
        if "broken" in body["lora_path"]:  # SGLang's LoadLoRAAdapterReqOutput on a failed load
            return JSONResponse({"success": False, "error_message": "Failed to load LoRA adapter",
                                 "loaded_adapters": {}}, status_code=400)
        return {"success": True, "error_message": "", "loaded_adapters": {body["lora_name"]: body["lora_path"]}}

    @app.post("/unload_lora_adapter")
    async def unload(request: Request):
        body = await request.json()
        seen.append(("/unload_lora_adapter", body))
        return {"success": True, "error_message": "", "loaded_adapters": {}}

    return app, seen


@contextlib.contextmanager
def serving_fake(original: bool = True, port: int | None = None):
    app, seen = fake_sglang(original)
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def sglang_server():
    with serving_fake() as served:
        yield served


def test_gateway_over_sglang_records_its_ids_and_logprobs(make_config, sglang_server, tmp_path, tiny_model_dir):
    url, seen = sglang_server
    cfg = make_config(serving={"engine": "sglang", "sglang_url": url})
    with running_gateway(cfg) as app:
        engine = app.state.gateway.engine
        assert engine.logprobs_kind == "raw"  # measured at connect: top token at T=1 and T=0.5
        probes = [b for route, b in seen if route == "/generate" and b.get("top_logprobs_num") == 1]
        assert [b["sampling_params"]["temperature"] for b in probes] == [1.0, 0.5]
        client = client_for(cfg)
        msgs = [{"role": "user", "content": "over sglang"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=5, temperature=0.5,
                                           extra_headers={"X-Session-Id": "sg-1"})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(REPLY_IDS)
        assert r.choices[0].message.content == engine.decode(REPLY_IDS)
        route, body = seen[-1]
        assert route == "/generate" and body["input_ids"] == engine.encode_chat(msgs)
        assert body["return_logprob"] is True and body["stream"] is True
        assert {"max_new_tokens": 8, "temperature": 0.5, "sampling_seed": 5}.items() <= body["sampling_params"].items()

        chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, stream=True,
                                                     extra_headers={"X-Session-Id": "sg-2"}))
        assert chunks[-1].choices[0].finish_reason == "length"

        ckpt = tmp_path / "ckpt-v1"
        ckpt.mkdir()
        bad = httpx.post(f"{cfg.gateway_url}/admin/reload", headers=admin(cfg),
                         json={"path": str(tmp_path / "missing"), "version": 9})
        assert bad.status_code == 400 and engine.policy_version == 0
        ok = httpx.post(f"{cfg.gateway_url}/admin/reload", headers=admin(cfg), json={"path": str(ckpt), "version": 1})
        assert ok.status_code == 200, ok.text
        assert seen[-1] == ("/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "1"})
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, extra_headers={"X-Session-Id": "sg-3"})

        lora = tmp_path / "adapter-v2"
        lora.mkdir()
        (lora / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_model_dir}))
        ok = httpx.post(f"{cfg.gateway_url}/admin/reload", headers=admin(cfg), json={"path": str(lora), "version": 2})
        assert ok.status_code == 200 and seen[-1] == ("/load_lora_adapter", {"lora_name": "v2", "lora_path": str(lora)})
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, extra_headers={"X-Session-Id": "sg-4"})
        assert seen[-1][1]["lora_path"] == "v2"
        turns = {t["session_id"]: t for t in sealed_turns(cfg)}

    assert turns["sg-1"]["response_token_ids"] == REPLY_IDS and turns["sg-1"]["response_logprobs"] == REPLY_LPS
    assert turns["sg-2"]["response_token_ids"] == REPLY_IDS[:3] and turns["sg-2"]["finish_reason"] == "length"
    assert turns["sg-1"]["policy_version"] == 0 and turns["sg-3"]["policy_version"] == 1
    assert turns["sg-4"]["policy_version"] == 2


def test_gateway_refuses_an_sglang_that_returns_scaled_logprobs(make_config):
    """SGLang started without SGLANG_RETURN_ORIGINAL_LOGPROB=1: the gateway does not start (its
    recorded logprobs would be log_softmax(logits / T), not the policy's)."""
    from clawflow.serving.sglang import LogprobsError

    with serving_fake(original=False) as (url, seen):
        cfg = make_config(serving={"engine": "sglang", "sglang_url": url})
        with pytest.raises(LogprobsError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1") as err:
            with running_gateway(cfg):
                pass
    assert "\n" not in str(err.value)
    assert all(b.get("top_logprobs_num") == 1 for _, b in seen)  # nothing but the probe was sent


@pytest.mark.parametrize("original", [True, False])
def test_sglang_down_at_connect_is_checked_at_the_first_request(tiny_model_dir, original):
    from clawflow.serving.engine import SamplingParams
    from clawflow.serving.sglang import LogprobsError, SGLangEngine

    port = free_port()
    engine = SGLangEngine(f"http://127.0.0.1:{port}", tiny_model_dir, timeout_s=5)
    try:
        assert engine.logprobs_kind is None  # nothing listens yet: undecided, not refused
        with serving_fake(original, port):
            params = SamplingParams(max_new_tokens=4, temperature=0.7)
            if original:
                assert engine.generate([1, 2, 3], params).logprobs == REPLY_LPS
                assert engine.logprobs_kind == "raw"
            else:
                with pytest.raises(LogprobsError):
                    engine.generate([1, 2, 3], params)
                assert engine.logprobs_kind == "scaled"
    finally:
        engine.close()


def test_logprobs_kind_thresholds():
    from clawflow.serving.sglang import _logprobs_kind

    raw, scaled = top_entry(1.0, True)[0], top_entry(0.5, False)[0]
    assert _logprobs_kind(raw, raw + 0.004) == "raw"
    assert _logprobs_kind(raw, scaled) == "scaled" and scaled > raw + 0.1
    assert _logprobs_kind(-1e-5, -1e-6) is None  # a sure top token tells nothing


def test_users_adapters_are_loaded_named_per_request_and_unloaded_when_replaced(sglang_server, tiny_model_dir,
                                                                               tmp_path):
    """Issue #29 on SGLang: each user's adapter version is its own LoRA in SGLang, named in that
    user's requests only; a replaced one is unloaded; a refused one changes nothing."""
    from clawflow.serving.generation import AdapterError, SamplingParams
    from clawflow.serving.sglang import SGLangEngine

    url, seen = sglang_server
    engine = SGLangEngine(url, tiny_model_dir)
    params = SamplingParams(max_new_tokens=4)
    try:
        def sent_lora(user):
            engine.generate([1, 2, 3], params, user=user)
            return [b for r, b in seen if r == "/generate"][-1].get("lora_path")

        first = engine.load_user_adapter("alice", str(tmp_path / "alice-v1"))
        assert seen[-1] == ("/load_lora_adapter",
                            {"lora_name": first["lora_name"], "lora_path": str(tmp_path / "alice-v1")})
        assert sent_lora("alice") == first["lora_name"] and sent_lora("bob") is None and sent_lora(None) is None
        second = engine.load_user_adapter("alice", str(tmp_path / "alice-v2"))
        assert second["lora_name"] != first["lora_name"]
        assert ("/unload_lora_adapter", {"lora_name": first["lora_name"]}) in seen
        assert sent_lora("alice") == second["lora_name"] and engine.user_adapter("alice") == str(tmp_path / "alice-v2")
        with pytest.raises(AdapterError, match="Failed to load LoRA adapter"):
            engine.load_user_adapter("alice", str(tmp_path / "broken"))
        assert sent_lora("alice") == second["lora_name"]
        engine.unload_user_adapter("alice")
        assert ("/unload_lora_adapter", {"lora_name": second["lora_name"]}) in seen and sent_lora("alice") is None
    finally:
        engine.close()
