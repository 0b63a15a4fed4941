"""Non-streamed chat completions through the real `openai` SDK: usage, max_tokens, seeds and greedy
decoding, logprobs, `n`, and the recorded turn (token in, token out) read back from the sealed shards."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from _gateway_helpers import MODEL, client_for, close, logprob_table, only_turn, turns_of


# -- chat completions: non-streaming -----------------------------------------------------------
def test_sdk_non_streaming_reply_usage_and_record(served):
    cfg, _ = served
    client = client_for(cfg)
    messages = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=11,
                                       extra_headers={"X-Session-Id": "non-stream"})
    assert r.object == "chat.completion" and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.message.role == "assistant"
    assert choice.finish_reason in {"stop", "length"}

    turn = only_turn(cfg, "non-stream")
    assert choice.message.content == turn["response_text"]
    assert choice.finish_reason == turn["finish_reason"]
    assert r.usage.completion_tokens == len(turn["response_token_ids"]) >= 1
    assert r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens == len(turn["prompt_token_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_max_tokens_caps_the_reply_with_finish_length(served):
    cfg, _ = served
    client = client_for(cfg)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}],
                                       max_tokens=3, seed=0, extra_headers={"X-Session-Id": "max-tokens"})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    turn = only_turn(cfg, "max-tokens")
    assert len(turn["response_token_ids"]) == 3 and turn["finish_reason"] == "length"

    # max_completion_tokens (the newer name) works the same way
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                       max_completion_tokens=2, seed=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_same_seed_same_reply_and_temperature_zero_is_greedy(served, tiny_model_dir):
    cfg, app = served
    client = client_for(cfg)
    messages = [{"role": "user", "content": "Tell me a story."}]

    def reply(**kw) -> str:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **kw)
        return r.choices[0].message.content

    a, b = reply(seed=1234, temperature=1.0), reply(seed=1234, temperature=1.0)
    assert a == b
    assert reply(seed=4321, temperature=1.0) != a  # the seed really drives the sampling

    g1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                        extra_headers={"X-Session-Id": "greedy-1"})
    g2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, seed=99,
                                        extra_headers={"X-Session-Id": "greedy-2"})
    assert g1.choices[0].message.content == g2.choices[0].message.content
    t1, t2 = only_turn(cfg, "greedy-1"), only_turn(cfg, "greedy-2")
    assert t1["response_token_ids"] == t2["response_token_ids"]
    # greedy: every sampled token is the argmax of the model at its position
    table = logprob_table(tiny_model_dir, t1["prompt_token_ids"], t1["response_token_ids"])
    assert t1["response_token_ids"] == table.argmax(-1).tolist()


# -- token-in/token-out record -----------------------------------------------------------------
def test_recorded_turn_is_token_in_token_out(served):
    cfg, app = served
    engine = app.state.gateway.engine
    client = client_for(cfg)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Define entropy."}]
    started = datetime.now(UTC)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=5, temperature=0.7,
                                       extra_headers={"X-Session-Id": "t-io"})
    turn = only_turn(cfg, "t-io")

    assert turn["prompt_token_ids"] == engine.encode_chat(messages)
    assert len(turn["response_logprobs"]) == len(turn["response_token_ids"]) == r.usage.completion_tokens
    # the policy's own log-probs of the sampled ids (temperature 1, the trainer's π_old), no re-tokenizing
    assert close(turn["response_logprobs"], engine.score(turn["prompt_token_ids"], turn["response_token_ids"]))
    assert all(lp <= 0 for lp in turn["response_logprobs"])
    assert turn["response_text"] == r.choices[0].message.content
    if turn["finish_reason"] == "length":
        assert turn["response_text"] == engine.decode(turn["response_token_ids"])
    assert turn["policy_version"] == 0
    assert turn["turn_index"] == 0 and turn["turn_type"] == "main" and turn["source"] == "live"
    assert turn["group_id"] is None and turn["session_done"] is False and turn["env_reward"] is None
    assert json.loads(turn["messages"]) == messages
    assert json.loads(turn["new_messages"]) == messages  # first turn: everything is new
    assert turn["tools"] is None and turn["tool_calls"] is None
    assert len(turn["turn_id"]) == 32
    assert started - timedelta(seconds=5) <= turn["created_at"] <= datetime.now(UTC)


# -- logprobs, n -------------------------------------------------------------------------------
def test_logprobs_match_the_recorded_ones(served):
    cfg, app = served
    tok = app.state.gateway.engine.tokenizer
    client = client_for(cfg)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Logprobs please."}],
                                       max_tokens=6, seed=8, logprobs=True, extra_headers={"X-Session-Id": "lp"})
    content = r.choices[0].logprobs.content
    turn = only_turn(cfg, "lp")
    assert len(content) == len(turn["response_token_ids"]) == r.usage.completion_tokens
    assert close([c.logprob for c in content], turn["response_logprobs"], 1e-5)
    assert [c.token for c in content] == [tok.decode([t]) for t in turn["response_token_ids"]]

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "No logprobs."}],
                                       max_tokens=2, seed=8)
    assert r.choices[0].logprobs is None


def test_n_choices_are_recorded_as_one_group(served):
    cfg, _ = served
    client = client_for(cfg)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me a name."}],
                                       max_tokens=6, seed=3, n=2, extra_headers={"X-Session-Id": "group"})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content  # seeds 3 and 4
    turns = turns_of(cfg, "group")
    assert len(turns) == 2
    assert turns[0]["group_id"] is not None and turns[0]["group_id"] == turns[1]["group_id"]
    assert turns[0]["turn_id"] != turns[1]["turn_id"]
    assert sorted(t["response_text"] for t in turns) == sorted(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == sum(len(t["response_token_ids"]) for t in turns)
