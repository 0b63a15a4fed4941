"""The serving gateway over real HTTP: a real uvicorn server, the `openai` SDK and httpx as clients,
real forward passes of the tiny random-weight model, turns read back from the sealed Parquet shards.

Most tests share one gateway (module scope, policy version 0 throughout) and tell their turns apart
by `X-Session-Id` or by unique message text; tests that reload weights or stop the server get their
own.
"""

from __future__ import annotations

import json
import shutil
import threading
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from openai import OpenAI

from clawflow.config import REPO_ROOT, load_config
from conftest import admin, free_port, policy_version, running_gateway

MODEL = "clawflow-tiny"


# -- helpers -----------------------------------------------------------------------------------
def client_for(cfg, key: str | None = None) -> OpenAI:
    return OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=key or cfg.serving.api_key, max_retries=0, timeout=120)


def user(cfg) -> dict:
    return {"Authorization": f"Bearer {cfg.serving.api_key}"}


def shard_rows(home: Path) -> list[dict]:
    files = sorted((Path(home) / "shards").rglob("*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def sealed_turns(cfg) -> list[dict]:
    """Seal everything through the admin route, then read every shard the gateway wrote."""
    r = httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg), timeout=60)
    assert r.status_code == 200, r.text
    return shard_rows(cfg.home)


def turns_of(cfg, session_id: str) -> list[dict]:
    return sorted((t for t in sealed_turns(cfg) if t["session_id"] == session_id), key=lambda t: t["created_at"])


def only_turn(cfg, session_id: str) -> dict:
    turns = turns_of(cfg, session_id)
    assert len(turns) == 1, f"expected one turn in session {session_id}, got {len(turns)}"
    return turns[0]


def assert_error_json(r: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if type_:
        assert err["type"] == type_
    return err


def plain(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def logprob_table(path: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), vocab] log-softmax of the model at `path` over each response position."""
    logits = hf_model(path)(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def logprobs_under(path: str, prompt: list[int], response: list[int]) -> list[float]:
    table = logprob_table(path, prompt, response)
    return table.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


FIXED = [{"role": "user", "content": "Say hello."}]


def fixed_score(app) -> list[float]:
    engine = app.state.gateway.engine
    prompt = engine.encode_chat(FIXED)
    reply = engine.tokenizer.encode("Hello there! How can I help?", add_special_tokens=False)
    return engine.score(prompt, reply)


def metrics(cfg) -> dict[str, float]:
    r = httpx.get(f"{cfg.gateway_url}/metrics")
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """One gateway on the tiny model for the read-mostly tests of this module (never reloaded)."""
    tmp = tmp_path_factory.mktemp("served")
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp / "home")
    raw["model"] = {"name": MODEL, "path": tiny_model_dir}
    raw["serving"]["port"] = free_port()
    (tmp / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "config.yaml")
    with running_gateway(cfg) as app:
        yield cfg, app


@pytest.fixture(scope="module")
def perturbed_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A valid checkpoint: the tiny model with noise added to every weight (tokenizer copied)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ckpt") / "perturbed"
    shutil.copytree(tiny_model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return str(out)


# SmolLM2's byte-level BPE has one token per raw byte; "€" is the three bytes E2 82 AC.
def _byte_token_names() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def euro_model_dir(tmp_path_factory, tiny_model_dir) -> tuple[str, list[int]]:
    """A crafted checkpoint that always answers with the bytes of "€€€…", one byte token at a time.

    Every layer's output projection is zeroed, so the last hidden state depends only on the current
    token (a bigram model); the untied lm_head maps "\\n" (end of the generation prompt) → E2 → 82
    → AC → E2 … with logits so large that sampling at any temperature picks them.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    names = _byte_token_names()
    e2, x82, ac = (tok.convert_tokens_to_ids(names[b]) for b in b"\xe2\x82\xac")
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    assert len({e2, x82, ac, newline, tok.unk_token_id}) == 5

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        basis = torch.eye(config.hidden_size)
        for i, t in enumerate((newline, e2, x82, ac)):
            emb[t] = basis[i]
        head.zero_()
        head[e2] = 10 * (basis[0] + basis[3])  # after "\n" or AC comes E2
        head[x82] = 10 * basis[1]  # after E2 comes 82
        head[ac] = 10 * basis[2]  # after 82 comes AC
    out = tmp_path_factory.mktemp("ckpt") / "euro"
    shutil.copytree(tiny_model_dir, out)
    model.save_pretrained(out)
    return str(out), [e2, x82, ac]


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


# -- models, metrics ---------------------------------------------------------------------------
def test_models_and_metrics(served):
    cfg, _ = served
    r = client_for(cfg).models.list()
    assert [m.id for m in r.data] == [MODEL]
    raw = httpx.get(f"{cfg.gateway_url}/v1/models", headers=user(cfg)).json()
    assert raw["object"] == "list" and raw["data"][0]["policy_version"] == 0

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
