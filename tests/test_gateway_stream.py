"""Streaming (SSE) chat completions: token-by-token deltas, stop strings never leaked, multi-byte
characters split across tokens, streamed logprobs and top_logprobs equal to the recorded ones."""

from __future__ import annotations

import pytest

from _gateway_helpers import MODEL, client_for, close, only_turn
from conftest import running_gateway


# -- streaming ---------------------------------------------------------------------------------
def test_sdk_streaming_deltas_match_the_recorded_turn(served):
    cfg, _ = served
    client = client_for(cfg)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a short poem."}], max_tokens=12, seed=5,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "stream"},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # token by token, not one blob
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in {"stop", "length"}
    assert chunks.index(finish[0]) > chunks.index(content_chunks[-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1

    text = "".join(c.choices[0].delta.content for c in content_chunks)
    turn = only_turn(cfg, "stream")
    assert text == turn["response_text"]
    assert finish[0].choices[0].finish_reason == turn["finish_reason"]
    assert usage_chunk.usage.completion_tokens == len(turn["response_token_ids"])
    assert usage_chunk.usage.prompt_tokens == len(turn["prompt_token_ids"])
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens

    # without stream_options there is no usage chunk; same seed → same text as the non-streamed reply
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a short poem."}], max_tokens=12, seed=5, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a short poem."}],
                                       max_tokens=12, seed=5)
    assert r.choices[0].message.content == text


def test_stop_string_across_tokens_is_never_streamed(served):
    """A stop string that spans two tokens: the first token's tail must not leak into the stream."""
    cfg, app = served
    tok = app.state.gateway.engine.tokenizer
    client = client_for(cfg)
    for attempt in range(6):
        messages = [{"role": "user", "content": f"Continue the list, attempt {attempt}."}]
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=attempt,
                                       extra_headers={"X-Session-Id": f"stop-probe-{attempt}"})
        ids = only_turn(cfg, f"stop-probe-{attempt}")["response_token_ids"]
        texts = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
        for k in range(1, len(ids) - 1):  # stop = last char of token k + first char of token k+1
            prev, cur, nxt = texts[k - 1], texts[k], texts[k + 1]
            if not (cur.startswith(prev) and nxt.startswith(cur) and len(cur) > len(prev) and len(nxt) > len(cur)):
                continue
            if "\ufffd" in nxt:
                continue
            stop = cur[-1] + nxt[len(cur)]
            if stop in cur or stop.strip() != stop:
                continue
            break
        else:
            continue
        break
    else:
        pytest.fail("no reply had a usable token boundary")
    expected = cur[:-1]

    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=attempt, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=attempt,
                                                 stop=[stop], stream=True,
                                                 extra_headers={"X-Session-Id": f"stop-stream-{attempt}"}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    turn = only_turn(cfg, f"stop-stream-{attempt}")
    assert turn["response_text"] == expected
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    # several stop strings that first show up in the same token: the reply is cut at the earliest
    for j in range(len(ids)):
        before, piece = texts[j], texts[j + 1][len(texts[j]):]
        if texts[j + 1].startswith(before) and len(piece) >= 2 and piece[0] != piece[1] \
                and piece[0] not in before and piece[1] not in before and "\ufffd" not in piece[:2]:
            break
    else:
        pytest.fail("no token added two new characters")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=attempt,
                                       stop=[piece[1], piece[0]])
    assert r.choices[0].message.content == before
    assert r.choices[0].finish_reason == "stop"


def test_streaming_multibyte_characters_split_across_tokens(make_config, euro_model_dir):
    """"€" arrives as three byte tokens: the stream must carry "€", never a replacement char."""
    path, euro_ids = euro_model_dir
    cfg = make_config(model={"path": path})
    with running_gateway(cfg):
        client = client_for(cfg)
        messages = [{"role": "user", "content": "Price?"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, seed=1)
        assert r.choices[0].message.content == "€€€"

        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=9, seed=1, stream=True, logprobs=True,
            extra_headers={"X-Session-Id": "euro"}))
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(deltas) == "€€€"
        assert all("\ufffd" not in d for d in deltas)
        streamed_lps = [lp for c in chunks if c.choices and c.choices[0].logprobs
                        for lp in c.choices[0].logprobs.content]
        assert len(streamed_lps) == 9  # one logprob per sampled token, also for the held-back bytes

        turn = only_turn(cfg, "euro")
        assert turn["response_token_ids"] == euro_ids * 3
        assert turn["response_text"] == "€€€"
        assert close([lp.logprob for lp in streamed_lps], turn["response_logprobs"], 1e-5)


def test_streamed_top_logprobs_match_the_non_streamed_reply_and_the_record(served):
    cfg, app = served
    tok = app.state.gateway.engine.tokenizer
    client = client_for(cfg)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Top logprobs, streamed."}], max_tokens=8, seed=21,
               logprobs=True, top_logprobs=3)
    chunks = list(client.chat.completions.create(**ask, stream=True, extra_headers={"X-Session-Id": "top-stream"}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content  # same seed: same tokens
    turn = only_turn(cfg, "top-stream")

    assert len(streamed) == len(whole) == len(turn["response_token_ids"]) >= 2
    assert [e.token for e in streamed] == [tok.decode([t]) for t in turn["response_token_ids"]]
    assert close([e.logprob for e in streamed], turn["response_logprobs"], 1e-5)
    for s, w, lp in zip(streamed, whole, turn["response_logprobs"]):
        assert len(s.top_logprobs) == 3
        assert [t.token for t in s.top_logprobs] == [t.token for t in w.top_logprobs]
        assert close([t.logprob for t in s.top_logprobs], [t.logprob for t in w.top_logprobs], 1e-5)
        assert s.top_logprobs[0].logprob >= lp - 1e-6  # the most likely token is at least as likely as the sampled one
        assert all(a.logprob >= b.logprob for a, b in zip(s.top_logprobs, s.top_logprobs[1:]))
        assert s.bytes == list(s.token.encode())
