"""Sessions: the X-Session-Id header, sessions inferred from the conversation when the client sends
no header, X-Turn-Type and X-Session-Done."""

from __future__ import annotations

import json

import httpx

from _gateway_helpers import MODEL, assert_error_json, client_for, only_turn, sealed_turns, user


# -- sessions ----------------------------------------------------------------------------------
def test_session_header_inference_and_turn_type(served):
    cfg, _ = served
    client = client_for(cfg)

    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Header session."}],
                                   max_tokens=4, seed=1, extra_headers={"X-Session-Id": "my-session-42"})
    assert only_turn(cfg, "my-session-42")["turn_index"] == 0

    # no headers: the follow-up that extends turn 1's messages + reply continues that session
    first = [{"role": "user", "content": "Inferred session: pick a fruit."}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, seed=2)
    follow_up = {"role": "user", "content": "No, a different one."}
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content}, follow_up]
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6, seed=3)
    other = [{"role": "user", "content": "Unrelated: what is two plus two?"}]
    client.chat.completions.create(model=MODEL, messages=other, max_tokens=6, seed=4)

    by_msgs = {t["messages"]: t for t in sealed_turns(cfg)}
    t1, t2, t3 = (by_msgs[json.dumps(m, ensure_ascii=False)] for m in (first, second, other))
    assert t1["session_id"].startswith("inferred-")
    assert t2["session_id"] == t1["session_id"]
    assert (t1["turn_index"], t2["turn_index"]) == (0, 1)
    assert json.loads(t2["new_messages"]) == [follow_up]
    assert t2["response_text"] == r2.choices[0].message.content
    assert t3["session_id"] not in (t1["session_id"], "my-session-42")
    assert t3["turn_index"] == 0

    # X-Turn-Type: side is recorded as such (served, never trained); X-Session-Done marks the end
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Eval probe."}],
                                       max_tokens=3, seed=1,
                                       extra_headers={"X-Session-Id": "side-1", "X-Turn-Type": "side",
                                                      "X-Session-Done": "true"})
    assert r.choices[0].message.content is not None
    side = only_turn(cfg, "side-1")
    assert side["turn_type"] == "side" and side["session_done"] is True

    bad = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", headers={**user(cfg), "X-Turn-Type": "bogus"},
                     json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    err = assert_error_json(bad, 400, "invalid_request_error")
    assert "X-Turn-Type" in err["message"]
