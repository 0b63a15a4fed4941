"""The SGLang engine adapter against a RECORDED HTTP CONTRACT, not a real SGLang server.

SGLang cannot run here (CUDA, or a CPU with AMX; its wheels pin their own torch). This test runs a
small real FastAPI app that answers SGLang's native routes with payloads shaped like SGLang's
(`python/sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`: `/generate` with
`input_ids`, `sampling_params`, `return_logprob`, streamed `data:` chunks with cumulative
`meta_info.output_token_logprobs` of `[logprob, token_id, null]`, `finish_reason.type`,
`weight_version`; `/update_weights_from_disk` and `/load_lora_adapter` answering `success`), and
checks what the adapter sends and what the gateway records. README says how to run it for real.
"""

from __future__ import annotations

import json
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


def fake_sglang() -> tuple[FastAPI, list[tuple[str, dict]]]:
    app, seen, state = FastAPI(), [], {"version": "0"}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        seen.append(("/generate", body))
        n = min(body["sampling_params"]["max_new_tokens"], len(REPLY_IDS))
        entries = [[lp, tok, None] for lp, tok in zip(REPLY_LPS[:n], REPLY_IDS[:n])]
        finish = {"type": "length", "length": n} if n < len(REPLY_IDS) else {"type": "stop", "matched": 2}

        def meta(k: int) -> dict:
            return {"id": "r1", "prompt_tokens": len(body["input_ids"]), "completion_tokens": k,
                    "cached_tokens": 0, "weight_version": state["version"], "output_token_logprobs": entries[:k],
                    "finish_reason": finish if k == n else None}

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
        return {"success": True, "error_message": "", "loaded_adapters": {body["lora_name"]: body["lora_path"]}}

    return app, seen


@pytest.fixture
def sglang_server():
    app, seen = fake_sglang()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(10)


def test_gateway_over_sglang_records_its_ids_and_logprobs(make_config, sglang_server, tmp_path, tiny_model_dir):
    url, seen = sglang_server
    cfg = make_config(serving={"engine": "sglang", "sglang_url": url})
    with running_gateway(cfg) as app:
        engine = app.state.gateway.engine
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
