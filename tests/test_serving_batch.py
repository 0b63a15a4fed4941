"""Continuous batching, back-pressure, reloads under load and the gateway's ops routes, over real HTTP
with the real `openai` SDK (sync and async) and real forward passes of the tiny model."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from openai import AsyncOpenAI

from clawflow.serving.engine import SamplingParams, TorchEngine
from conftest import admin, running_gateway
from _gateway_helpers import MODEL, assert_error_json, client_for, close, logprobs_under, metrics, sealed_turns, user
from _store_helpers import pending_pairs


def test_batched_engine_matches_a_forward_pass_per_request(tiny_model_dir):
    """Requests of different prompt lengths join a running batch and leave it at different steps;
    every recorded logprob equals a plain full forward pass, and a seeded reply does not depend on
    what else is in the batch."""
    engine = TorchEngine(tiny_model_dir, max_batch=8, max_queue=8)
    try:
        prompts = [engine.encode_chat([{"role": "user", "content": "x " * k}]) for k in (1, 9, 3, 20)]
        futures = []
        for i, p in enumerate(prompts):
            futures.append(engine.submit(p, SamplingParams(max_new_tokens=6 + 5 * i, seed=i, top_logprobs=3)))
            time.sleep(0.05)  # later requests join a batch already decoding
        gens = [f.result(timeout=120) for f in futures]
        for p, g in zip(prompts, gens):
            assert g.finish_reason in ("length", "stop") and g.token_ids
            assert close(g.logprobs, logprobs_under(tiny_model_dir, p, g.token_ids), 1e-4)
            assert len(g.top_logprobs) == len(g.token_ids) and all(len(t) == 3 for t in g.top_logprobs)
            assert all(top[0][1] >= lp - 1e-6 for top, lp in zip(g.top_logprobs, g.logprobs))
        alone = engine.generate(prompts[3], SamplingParams(max_new_tokens=21, seed=3))
        assert alone.token_ids == gens[3].token_ids
        assert engine.batcher.active == 0 and engine.batcher.queue_depth == 0
    finally:
        engine.close()


def a_tokens_during_a_long_prefill(model_dir: str, chunk: int) -> tuple[int, list[int], list[float], list[int]]:
    """Stream A decodes; a long prompt B arrives. (A's tokens between B's submission and B's first
    token, B's prompt, B's logprobs, B's tokens)."""
    engine = TorchEngine(model_dir, max_batch=4, max_queue=4, prefix_cache_tokens=0, prefill_chunk_tokens=chunk)
    events, lock, started = [], threading.Lock(), threading.Event()

    def note(name):
        def on_token(*_):
            with lock:
                events.append(name)
            started.set()
            return True
        return on_token

    try:
        a = engine.submit(engine.encode_chat([{"role": "user", "content": "hi"}]),
                          SamplingParams(max_new_tokens=80, temperature=1.0, seed=1), note("A"))
        assert started.wait(60)
        long_prompt = engine.encode_chat([{"role": "user", "content": "word " * 200}])
        with lock:
            events.append("submit B")
        b = engine.submit(long_prompt, SamplingParams(max_new_tokens=3, seed=2), note("B"))
        gen_b = b.result(timeout=120)
        a.result(timeout=120)
    finally:
        engine.close()
    between = events[events.index("submit B"):events.index("B")]
    return between.count("A"), long_prompt, gen_b.logprobs, gen_b.token_ids


def test_chunked_prefill_keeps_other_streams_decoding_and_is_exact(tiny_model_dir):
    """serving.prefill_chunk_tokens: a long prompt is prefilled a chunk per loop iteration, and the
    running stream decodes a token between chunks; the whole-prompt prefill stalls it. The chunked
    prompt's first token (sampled after its last chunk) and the rest match a plain forward pass."""
    chunked, prompt, logprobs, ids = a_tokens_during_a_long_prefill(tiny_model_dir, 16)
    chunks = -(-len(prompt) // 16)
    assert len(prompt) > 150 and chunked >= chunks - 2, (chunked, chunks)
    assert close(logprobs, logprobs_under(tiny_model_dir, prompt, ids), 1e-4)
    whole, *_ = a_tokens_during_a_long_prefill(tiny_model_dir, 0)
    assert whole <= 2, whole


def test_sixteen_streams_survive_three_reloads(make_config, tiny_model_dir, perturbed_model_dir):
    cfg = make_config(serving={"max_concurrency": 8, "max_queue": 32})
    path_of = {0: tiny_model_dir, 1: perturbed_model_dir, 2: tiny_model_dir, 3: perturbed_model_dir}
    stop, started = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    done: list[tuple[str, str, float]] = []  # (session id, streamed text, time sent)

    with running_gateway(cfg):
        client = client_for(cfg)

        def worker(k: int) -> None:
            for j in range(8):  # at most 8 requests each; keeps going until the third reload is done
                sid = f"load-{k}-{j}"
                try:
                    text, sent = "", time.monotonic()
                    for c in client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": f"client {k} turn {j}"}],
                            max_tokens=12, seed=k * 100 + j, stream=True, extra_headers={"X-Session-Id": sid}):
                        if c.choices and c.choices[0].delta.content:
                            text += c.choices[0].delta.content
                            started.set()
                    done.append((sid, text, sent))
                except BaseException as exc:
                    errors.append(exc)
                    return
                if stop.is_set():
                    return

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        assert started.wait(120)
        for version in (1, 2, 3):
            r = httpx.post(f"{cfg.gateway_url}/admin/reload", headers=admin(cfg),
                           json={"path": path_of[version], "version": version}, timeout=120)
            assert r.status_code == 200, r.text
            at = time.monotonic()
            deadline = at + 120  # the streams keep going: wait for one that was sent after this reload
            while not any(sent > at for _, _, sent in list(done)) and time.monotonic() < deadline and not errors:
                time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert len(done) >= 16
        turns = {t["session_id"]: t for t in sealed_turns(cfg)}
        assert metrics(cfg)["clawflow_reloads_total"] == 3

    versions = set()
    for sid, text, _ in done:
        turn = turns[sid]
        assert turn["response_text"] == text
        v = turn["policy_version"]
        versions.add(v)
        # the version named is the one whose weights produced every recorded logprob
        expected = logprobs_under(path_of[v], turn["prompt_token_ids"], turn["response_token_ids"])
        assert close(turn["response_logprobs"], expected, 1e-4), (sid, v)
    assert len(versions) >= 3, versions


def test_full_queue_gets_429_and_a_disconnect_frees_the_slot(make_config):
    cfg = make_config(serving={"max_concurrency": 1, "max_queue": 0})
    with running_gateway(cfg) as app:
        engine = app.state.gateway.engine
        release = threading.Event()
        # a request whose token callback blocks holds the only slot until released
        held = engine.submit(engine.encode_chat([{"role": "user", "content": "hold"}]),
                             SamplingParams(max_new_tokens=2), lambda *_: release.wait(60))
        r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", headers=user(cfg), timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "me too"}], "stream": True})
        err = assert_error_json(r, 429, "rate_limit_error")
        assert "busy" in err["message"] and r.headers["retry-after"] == "1"
        release.set()
        assert held.result(60).token_ids

        body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "stream": True,
                "max_tokens": engine.context_length - 64}
        with httpx.stream("POST", f"{cfg.gateway_url}/v1/chat/completions", json=body, headers=user(cfg),
                          timeout=60) as first:
            assert first.status_code == 200
            next(first.iter_lines())  # then the client goes away mid-stream
        deadline = time.monotonic() + 60
        while engine.batcher.active and time.monotonic() < deadline:  # its row leaves the batch
            time.sleep(0.05)
        assert engine.batcher.active == 0
        ok = client_for(cfg).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "now"}],
                                                     max_tokens=3)
        assert ok.choices[0].message.content is not None


def test_async_sdk_concurrent_and_ops_routes(make_config):
    cfg = make_config()
    with running_gateway(cfg):
        async def main():
            client = AsyncOpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=cfg.serving.api_key, max_retries=0)

            async def one(k: int):
                if k % 2:
                    chunks = [c async for c in await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"async {k}"}], max_tokens=8,
                        stream=True, extra_headers={"X-Session-Id": f"async-{k}"})]
                    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                r = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"async {k}"}], max_tokens=8,
                    logprobs=True, top_logprobs=2, extra_headers={"X-Session-Id": f"async-{k}"})
                lps = r.choices[0].logprobs.content
                assert lps and all(len(e.top_logprobs) == 2 for e in lps)
                assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in lps)
                return r.choices[0].message.content

            out = await asyncio.gather(*(one(k) for k in range(6)))
            await client.close()
            return out

        texts = asyncio.run(main())
        turns = {t["session_id"]: t for t in sealed_turns(cfg)}
        assert [turns[f"async-{k}"]["response_text"] for k in range(6)] == texts

        # the internal route: admin key only, never recorded
        url = f"{cfg.gateway_url}/internal/v1/chat/completions"
        judge = {"model": MODEL, "messages": [{"role": "user", "content": "judge-only-text"}], "max_tokens": 3}
        assert_error_json(httpx.post(url, json=judge, headers=user(cfg), timeout=60), 401)
        r = httpx.post(url, json=judge, headers=admin(cfg) | {"X-Request-Id": "judge-1"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "judge-1"
        assert not [t for t in sealed_turns(cfg) if "judge-only-text" in str(t["messages"])]
        m = metrics(cfg)
        assert m["clawflow_unrecorded_requests_total"] == 1
        assert m["clawflow_request_latency_seconds_count"] == 7 and m["clawflow_queue_depth"] == 0

        # a 10 MB body is refused before it is parsed, declared or chunked
        big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 10_000_000 + b'"}]}'
        r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", content=big, headers=user(cfg), timeout=60)
        assert assert_error_json(r, 413)["code"] == "request_too_large"
        r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", content=iter([big[:5_000_000], big[5_000_000:]]),
                       headers=user(cfg), timeout=60)
        assert_error_json(r, 413)



def test_stock_client_without_headers_trains_as_one_session(make_config):
    """Three turns from a client that sends no session headers: one inferred session, and the
    catalog pairs each turn with the next state (the user's next message)."""
    from clawflow.store.catalog import Catalog

    cfg = make_config()
    with running_gateway(cfg):
        client = client_for(cfg)
        messages: list[dict] = []
        for k in range(3):
            messages.append({"role": "user", "content": f"stock turn {k}"})
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=k)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        turns = sorted((t for t in sealed_turns(cfg) if "stock turn 0" in str(t["messages"])),
                       key=lambda t: t["turn_index"])
    assert len(turns) == 3 and len({t["session_id"] for t in turns}) == 1
    assert [t["turn_index"] for t in turns] == [0, 1, 2]
    cat = Catalog(cfg.home / "catalog.duckdb", cfg.home / "shards")
    pairs = {p.turn_index: p for p in pending_pairs(cat, 99) if p.session_id == turns[0]["session_id"]}
    assert "stock turn 1" in pairs[0].next_state and "stock turn 2" in pairs[1].next_state


def test_a_reload_to_the_same_version_number_never_joins_the_old_batch(tiny_model_dir, perturbed_model_dir):
    """Other weights under the same version number are another model: a request admitted after the
    reload decodes on the new weights while the old batch still runs, in a batch of its own."""
    engine = TorchEngine(tiny_model_dir, max_batch=4, max_queue=4, prefix_cache_tokens=0)
    started = threading.Event()
    try:
        a = engine.submit(engine.encode_chat([{"role": "user", "content": "hi"}]),
                          SamplingParams(max_new_tokens=60, temperature=1.0, seed=1), lambda *_: started.set() or True)
        assert started.wait(60)
        engine.reload(perturbed_model_dir, 0)
        prompt = engine.encode_chat([{"role": "user", "content": "tell me more"}])
        b = engine.submit(prompt, SamplingParams(max_new_tokens=8)).result(timeout=120)
        assert not a.done()  # b ran while the old version's batch was still decoding
        a.result(timeout=120)
    finally:
        engine.close()
    assert close(b.logprobs, logprobs_under(perturbed_model_dir, prompt, b.token_ids), 1e-4)
