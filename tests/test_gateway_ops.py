"""Operations: /v1/models, /metrics, a clean stop that seals every turn, and clients that disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from _gateway_helpers import MODEL, client_for, metrics, sealed_turns, shard_rows, user
from conftest import running_gateway


# -- models, metrics ---------------------------------------------------------------------------
def test_models_and_metrics(served):
    cfg, _ = served
    r = client_for(cfg).models.list()
    assert [m.id for m in r.data] == [MODEL]
    raw = httpx.get(f"{cfg.gateway_url}/v1/models", headers=user(cfg)).json()
    assert raw["object"] == "list" and raw["data"][0]["policy_version"] == 0
    # the context length, under both names clients look for: the tiny model's 2048 positions
    assert raw["data"][0]["context_length"] == raw["data"][0]["max_model_len"] == 2048

    resp = httpx.get(f"{cfg.gateway_url}/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    before = metrics(cfg)
    assert before["clawflow_policy_version"] == 0
    httpx.post(f"{cfg.gateway_url}/v1/chat/completions", headers=user(cfg), timeout=60,
               json={"messages": [{"role": "user", "content": "count me"}], "max_tokens": 2})
    after = metrics(cfg)
    assert after["clawflow_requests_total"] == before["clawflow_requests_total"] + 1
    assert after["clawflow_completion_tokens_total"] == before["clawflow_completion_tokens_total"] + 2
    assert after["clawflow_turns_recorded_total"] == before["clawflow_turns_recorded_total"] + 1
    assert after["clawflow_prompt_tokens_total"] > before["clawflow_prompt_tokens_total"]


# -- clean stop --------------------------------------------------------------------------------
def test_clean_stop_seals_every_turn(make_config):
    cfg = make_config(store={"segment_max_age_s": 3600, "seal_interval_s": 3600})  # only the stop seals
    with running_gateway(cfg):
        client = client_for(cfg)
        msgs = [{"role": "user", "content": "Keep me."}]
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=1,
                                       extra_headers={"X-Session-Id": "stop-a"})
        list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=2, stream=True,
                                            extra_headers={"X-Session-Id": "stop-b"}))
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, seed=3, n=2,
                                       extra_headers={"X-Session-Id": "stop-c"})
        assert shard_rows(cfg.home) == []  # nothing sealed yet: the stop has to do it
        assert list((cfg.home / "wal").glob("*.open.jsonl"))

    rows = shard_rows(cfg.home)
    assert sorted(r["session_id"] for r in rows) == ["stop-a", "stop-b", "stop-c", "stop-c"]
    assert len({r["turn_id"] for r in rows}) == 4
    assert all(len(r["response_token_ids"]) == 3 for r in rows)
    assert list((cfg.home / "wal").rglob("*.jsonl")) == []


# -- disconnects -------------------------------------------------------------------------------
def test_non_streaming_client_that_disconnects_frees_its_slot(make_config, euro_model_dir):
    """A non-streamed request whose client goes away mid-decode leaves the batch (the euro model never
    emits EOS, so without the abort it would decode ~2,000 tokens) and records nothing."""
    path, _ = euro_model_dir
    cfg = make_config(model={"path": path}, serving={"max_concurrency": 1, "max_queue": 0})
    with running_gateway(cfg) as app:
        engine = app.state.gateway.engine
        before = metrics(cfg)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Price?"}], "seed": 1,
                "max_tokens": engine.context_length - 64}

        async def leave_mid_decode() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                task = asyncio.create_task(client.post(f"{cfg.gateway_url}/v1/chat/completions", json=body,
                                                       headers={**user(cfg), "X-Session-Id": "walked-away"}))
                deadline = time.monotonic() + 60
                while engine.batcher.active == 0 and not task.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert engine.batcher.active == 1 and not task.done(), "the request never started decoding"
                task.cancel()  # closes the connection
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run(leave_mid_decode())
        deadline = time.monotonic() + 30
        while engine.batcher.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.batcher.active == 0 and engine.batcher.queue_depth == 0
        after = metrics(cfg)
        assert after["clawflow_requests_cancelled_total"] == before["clawflow_requests_cancelled_total"] + 1
        assert after["clawflow_decode_aborted_total"] == before["clawflow_decode_aborted_total"] + 1
        assert after["clawflow_completion_tokens_total"] == before["clawflow_completion_tokens_total"]
        assert after["clawflow_active_requests"] == 0

        # the slot is free (max_concurrency 1, no queue: a held slot would answer 429) and nothing was recorded
        ok = client_for(cfg).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Price?"}],
                                                     max_tokens=3, extra_headers={"X-Session-Id": "next"})
        assert ok.choices[0].message.content == "€"
        sessions = {t["session_id"] for t in sealed_turns(cfg)}
        assert "next" in sessions and "walked-away" not in sessions
