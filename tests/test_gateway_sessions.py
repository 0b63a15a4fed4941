"""Sessions: the X-Session-Id header, sessions inferred from the conversation when the client sends
no header, X-Turn-Type and X-Session-Done; the user every turn is recorded under, and sessions that
never join two users."""

from __future__ import annotations

import json

import httpx

from _gateway_helpers import MODEL, assert_error_json, client_for, only_turn, sealed_turns, user
from conftest import running_gateway


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


# -- users ---------------------------------------------------------------------------------------
def test_turns_carry_their_user_and_sessions_never_join_two_users(make_config):
    """Every turn is recorded under the owner of the key it came with (serving.user); a conversation
    one user continues from another user's turn, or an X-Session-Id both send, never becomes one
    session for training: the catalog pairs each user's turns with their own next turns only."""
    cfg = make_config(serving={"user": "alice"})
    with running_gateway(cfg) as app:
        client = client_for(cfg)

        def chat(messages, **headers):
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=1,
                                               extra_headers=headers)
            return [*messages, {"role": "assistant", "content": r.choices[0].message.content}]

        a1 = chat([{"role": "user", "content": "Alice asks: pick a colour."}])
        chat([{"role": "user", "content": "Alice, explicit session."}], **{"X-Session-Id": "shared-7"})
        # the same key, now owned by bob: the ownership of a key is read on every request
        # (clawflow/users.py KeyResolver; tests/test_users.py gives each user a key of their own)
        app.state.gateway.cfg.serving.user = "bob"
        b1 = chat([*a1, {"role": "user", "content": "Bob extends Alice's turn."}])
        b2 = chat([*b1, {"role": "user", "content": "Bob goes on."}])
        chat([{"role": "user", "content": "Bob, explicit session."}, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "Bob's second turn."}], **{"X-Session-Id": "shared-7"})
        app.state.gateway.cfg.serving.user = "alice"
        chat([*b2, {"role": "user", "content": "Alice replays Bob's conversation."}])
        turns = {json.loads(t["messages"])[-1]["content"]: t for t in sealed_turns(cfg)}

    alice_1, alice_explicit = turns["Alice asks: pick a colour."], turns["Alice, explicit session."]
    bob_1, bob_2 = turns["Bob extends Alice's turn."], turns["Bob goes on."]
    bob_explicit, alice_2 = turns["Bob's second turn."], turns["Alice replays Bob's conversation."]
    assert [t["user"] for t in (alice_1, alice_explicit, alice_2)] == ["alice"] * 3
    assert [t["user"] for t in (bob_1, bob_2, bob_explicit)] == ["bob"] * 3
    assert bob_1["session_id"] != alice_1["session_id"] and bob_1["turn_index"] == 1  # a session of his own
    assert bob_2["session_id"] == bob_1["session_id"]  # inference still joins one user's turns
    # alice's replay extends bob's turns, and her own first turn: only hers counts
    assert alice_2["session_id"] == alice_1["session_id"] != bob_2["session_id"]
    assert alice_explicit["session_id"] == bob_explicit["session_id"] == "shared-7"  # as the clients sent it

    from clawflow.store.catalog import Catalog  # the training batch: pairs within one user only

    pairs = Catalog.for_config(cfg).select_batch("run", max_turns=99)
    assert [(p.turn_id, p.user) for p in pairs] == [(bob_1["turn_id"], "bob")]
    assert json.loads(pairs[0].next_state) == [{"role": "user", "content": "Bob goes on."}]
