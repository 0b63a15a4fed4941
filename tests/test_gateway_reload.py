"""Hot reload through POST /admin/reload: bad checkpoints are refused while serving goes on, and a
good one swaps the weights while an in-flight stream finishes on the version it started on."""

from __future__ import annotations

import shutil
import threading
import time
from datetime import UTC, datetime

import httpx

from _gateway_helpers import (FIXED, MODEL, assert_error_json, client_for, close, fixed_score, logprobs_under,
                              metrics, only_turn, user)
from conftest import admin, policy_version, running_gateway


# -- hot reload --------------------------------------------------------------------------------
def test_reload_refuses_bad_checkpoints_and_keeps_serving(gateway, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, app = gateway
    url = cfg.gateway_url
    before = fixed_score(app)
    client = client_for(cfg)

    def still_serving_v0():
        assert policy_version(cfg) == 0
        assert httpx.get(f"{url}/admin/policy", headers=admin(cfg)).json()["path"] == tiny_model_dir
        assert fixed_score(app) == before  # the very same weights
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                           max_tokens=2, seed=1)
        assert r.usage.completion_tokens == 2

    err = assert_error_json(httpx.post(f"{url}/admin/reload", headers=admin(cfg),
                                       json={"path": str(tmp_path / "nowhere"), "version": 3}), 400)
    assert "nowhere" in err["message"]
    still_serving_v0()

    def broken(name, spoil):
        d = tmp_path / name
        shutil.copytree(tiny_model_dir, d)
        spoil(d)
        return str(d)

    garbage = broken("garbage-config", lambda d: (d / "config.json").write_text("{this is not json"))
    truncated = broken("truncated", lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:100_000]))

    def drop_a_tensor(d):
        weights = load_file(d / "model.safetensors")
        del weights[next(k for k in weights if "layers.1.mlp.down_proj" in k)]
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})

    incomplete = broken("missing-tensor", drop_a_tensor)
    for path in (garbage, truncated, incomplete):
        r = httpx.post(f"{url}/admin/reload", headers=admin(cfg), json={"path": path, "version": 3}, timeout=60)
        err = assert_error_json(r, 400)
        assert "still serving version 0" in err["message"], path
        still_serving_v0()

    # a registry version that does not exist (no registry version at all yet) → 404
    err = assert_error_json(httpx.post(f"{url}/admin/reload", headers=admin(cfg), json={"version": 99}, timeout=60),
                            404)
    assert "99" in err["message"]
    assert_error_json(httpx.post(f"{url}/admin/reload", headers=admin(cfg), json={}), 400)
    assert_error_json(httpx.post(f"{url}/admin/reload", headers=admin(cfg), content=b"{", timeout=10), 400)
    still_serving_v0()

    # a path without a version gets the next version number
    r = httpx.post(f"{url}/admin/reload", headers=admin(cfg), json={"path": tiny_model_dir}, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == 1
    assert policy_version(cfg) == 1


def test_reload_swaps_weights_and_in_flight_request_keeps_its_version(gateway, tiny_model_dir, perturbed_model_dir):
    cfg, app = gateway
    engine = app.state.gateway.engine
    before = fixed_score(app)
    client = client_for(cfg)
    messages = [{"role": "user", "content": "Tell me everything you know."}]

    first_content = threading.Event()
    streamed: dict = {"chunks": []}

    def consume():
        try:
            for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, seed=3,
                                                    stream=True, extra_headers={"X-Session-Id": "in-flight"}):
                streamed["chunks"].append(c)
                if c.choices and c.choices[0].delta.content:
                    first_content.set()
        except BaseException as exc:  # surfaced by the main thread
            streamed["error"] = exc
            first_content.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert first_content.wait(120)
    r = httpx.post(f"{cfg.gateway_url}/admin/reload", headers=admin(cfg),
                   json={"path": perturbed_model_dir, "version": 7}, timeout=120)
    reloaded_at = datetime.now(UTC)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 7 and r.json()["path"] == perturbed_model_dir
    thread.join(300)
    assert not thread.is_alive() and "error" not in streamed

    assert policy_version(cfg) == 7
    assert httpx.get(f"{cfg.gateway_url}/admin/policy", headers=admin(cfg)).json()["path"] == perturbed_model_dir
    assert not close(fixed_score(app), before, 1e-3)  # the served weights changed
    assert close(fixed_score(app), logprobs_under(perturbed_model_dir, engine.encode_chat(FIXED),
                                                  engine.tokenizer.encode("Hello there! How can I help?",
                                                                          add_special_tokens=False)))

    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "And now?"}],
                                           max_tokens=5, seed=1, extra_headers={"X-Session-Id": "after-reload"})
    assert after.system_fingerprint == "policy-v7"
    new_turn = only_turn(cfg, "after-reload")
    assert new_turn["policy_version"] == 7
    assert close(new_turn["response_logprobs"], engine.score(new_turn["prompt_token_ids"],
                                                             new_turn["response_token_ids"]))

    old_turn = only_turn(cfg, "in-flight")
    assert old_turn["created_at"] > reloaded_at, "the streaming request finished before the reload: not in flight"
    assert old_turn["policy_version"] == 0
    text = "".join(c.choices[0].delta.content or "" for c in streamed["chunks"] if c.choices)
    assert text == old_turn["response_text"]
    assert streamed["chunks"][-1].choices[0].finish_reason == old_turn["finish_reason"]
    # decoded on the old weights from the first token to the last, not a mix
    old = logprobs_under(tiny_model_dir, old_turn["prompt_token_ids"], old_turn["response_token_ids"])
    assert close(old_turn["response_logprobs"], old)
    new = logprobs_under(perturbed_model_dir, old_turn["prompt_token_ids"], old_turn["response_token_ids"])
    assert not close(old_turn["response_logprobs"][-50:], new[-50:], 1e-3)

    raw = httpx.get(f"{cfg.gateway_url}/v1/models", headers=user(cfg)).json()
    assert raw["data"][0]["policy_version"] == 7
    assert metrics(cfg)["clawflow_policy_version"] == 7
    assert metrics(cfg)["clawflow_reloads_total"] == 1


def test_reload_rewarms_while_concurrent_requests_all_succeed(make_config, perturbed_model_dir):
    """Clients keep sending during the whole reload (load, re-warm, swap): every request succeeds, on
    the old or the new version; the reload re-warmed the hot system prompt, so the first request
    after it reuses the new version's KV."""
    cfg = make_config(serving={"rewarm_min_tokens": 16})  # the tiny tokenizer's prompts are short
    with running_gateway(cfg) as app:
        _rewarm_while_serving(cfg, app, perturbed_model_dir)


def _rewarm_while_serving(cfg, app, perturbed_model_dir):
    prefix = app.state.gateway.engine.batcher.prefix
    system = "You answer questions about the shop's opening hours, in one sentence, politely. " * 4
    client = client_for(cfg)

    def ask(q: str, tokens: int = 3):
        return client.chat.completions.create(model=MODEL, max_tokens=tokens, seed=1, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])

    ask("Open on Sunday?")
    ask("Open on Monday?")  # reuses the system prompt: the hottest entry
    stop, results, errors = threading.Event(), [], []

    def client_loop(i: int):
        n = 0
        while not stop.is_set():
            try:
                results.append(ask(f"Client {i}, question {n}?", tokens=2 + i % 3).system_fingerprint)
            except BaseException as exc:
                errors.append(exc)
            n += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    r = httpx.post(f"{cfg.gateway_url}/admin/reload", headers=admin(cfg),
                   json={"path": perturbed_model_dir, "version": 2}, timeout=120)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(120)
    assert r.status_code == 200, r.text
    assert r.json()["rewarm"]["ok"] and r.json()["rewarm"]["prompts"] >= 1, r.json()
    assert not errors, errors[:3]
    assert set(results) <= {"policy-v0", "policy-v2"} and "policy-v2" in results

    hits, reused = prefix.hits, prefix.reused_tokens
    assert ask("Open on a holiday?").system_fingerprint == "policy-v2"
    assert prefix.hits == hits + 1 and prefix.reused_tokens - reused >= 60  # the system prompt, warm
    assert prefix.versions() == {2}
