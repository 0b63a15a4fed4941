"""Auth and bad input: every refusal is OpenAI error JSON with the right status."""

from __future__ import annotations

import httpx
import openai
import pytest

from _gateway_helpers import MODEL, assert_error_json, client_for, user
from conftest import admin


# -- auth --------------------------------------------------------------------------------------
def test_auth_rejects_missing_and_wrong_keys(served):
    cfg, _ = served
    url = cfg.gateway_url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": cfg.serving.api_key}):
        assert_error_json(httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers), 401,
                          "authentication_error")
        assert_error_json(httpx.get(f"{url}/v1/models", headers=headers), 401, "authentication_error")

    with pytest.raises(openai.AuthenticationError) as exc:
        client_for(cfg, key="wrong-key").chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2)
    assert exc.value.status_code == 401

    # admin routes want the admin key, not the user API key
    for method, path in (("GET", "/admin/policy"), ("POST", "/admin/reload"), ("POST", "/admin/seal")):
        for headers in ({}, user(cfg)):
            assert_error_json(httpx.request(method, f"{url}{path}", headers=headers, json={}), 401)
    assert httpx.get(f"{url}/admin/policy", headers=admin(cfg)).json()["version"] == 0

    health = httpx.get(f"{url}/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"


# -- bad input ---------------------------------------------------------------------------------
def test_bad_input_gets_400_with_openai_error_json(served):
    cfg, _ = served
    url, headers = f"{cfg.gateway_url}/v1/chat/completions", user(cfg)
    msgs = [{"role": "user", "content": "hi"}]

    r = httpx.post(url, headers={**headers, "Content-Type": "application/json"}, content=b'{"messages": [')
    assert_error_json(r, 400, "invalid_request_error")

    err = assert_error_json(httpx.post(url, headers=headers, json={"messages": []}), 400)
    assert "messages" in err["message"]
    err = assert_error_json(httpx.post(url, headers=headers, json={"max_tokens": 2}), 400)
    assert "messages" in err["message"]
    err = assert_error_json(httpx.post(url, headers=headers, json={"messages": msgs, "temperature": 5}), 400)
    assert "temperature" in err["message"]
    err = assert_error_json(httpx.post(url, headers=headers, json={"messages": msgs, "top_p": 0}), 400)
    assert "top_p" in err["message"]
    err = assert_error_json(httpx.post(url, headers=headers, json={"messages": [{"role": "wizard", "content": "x"}]}),
                            400)
    assert "role" in err["message"]
    assert_error_json(httpx.post(url, headers=headers, json={"messages": msgs, "n": 2, "stream": True}), 400)

    r = httpx.post(url, headers=headers, json={"messages": msgs, "max_tokens": 100000})
    err = assert_error_json(r, 400, "invalid_request_error")
    assert "2048" in err["message"] and "context length" in err["message"]
    r = httpx.post(url, headers=headers, json={"messages": msgs, "max_tokens": 100000, "stream": True})
    assert_error_json(r, 400)  # refused before the stream starts

    # vendor extensions are accepted and ignored
    r = httpx.post(url, headers=headers, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}],
        "max_tokens": 2, "metadata": {"k": "v"}, "reasoning_effort": "low", "user": "u-1", "x_custom": [1, 2]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
