"""Tool calls through the real `openai` SDK: a request with `tools` gets `tool_calls` back
(finish_reason "tool_calls"); the client sends the call and a `tool` message; the gateway answers
in text; both turns land in the sealed shards as one session, the tool message as the first
turn's next state.

A random-weight model never writes `<tool_call>…</tool_call>`, so the served model is the tiny
recipe overfitted (real forward/backward, Adam, tens of steps, seconds) on exactly the two prompts
of the round trip, and decoded greedily. It carries a Hermes/Qwen-style tool template: SmolLM2's
own ChatML template ignores `tools` and drops an assistant's `tool_calls`, so with it the model
would never see the tool list nor its own call.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from _gateway_helpers import MODEL, client_for, sealed_turns, turns_of
from conftest import running_gateway

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Oslo"}}
CALL_TEXT = f"<tool_call>{json.dumps(CALL)}</tool_call>"  # what the model is taught to write
RESULT = '{"city": "Oslo", "sky": "sunny", "celsius": 21}'
ANSWER = "It is sunny in Oslo."

# ChatML with tools in the Hermes/Qwen style that clawflow/serving/toolcalls.py parses; an
# assistant's call is rendered back exactly as the model wrote it, a tool result as a user turn.
TOOL_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou may call these functions:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nTo call one, reply <tool_call>{"name": <name>, "arguments": <args-json-object>}' }}
{{- '</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + m.role + '\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def _overfit(model, pairs: list[tuple[list[int], list[int]]], max_steps: int = 400) -> None:
    """Adam on everything but the embeddings until each reply token has probability > 0.9 after
    its prompt, so greedy decoding reproduces the replies. The (tied) embeddings are frozen and
    redrawn at unit scale: the head can then be decisive, and <|im_end|> (the padding row, zero
    at init) becomes predictable; training the 3M-entry table would cost most of the time."""
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    emb.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(max_steps):
        token_losses = [torch.nn.functional.cross_entropy(
            model(torch.tensor([prompt + reply]), logits_to_keep=len(reply) + 1).logits[0, :-1],
            torch.tensor(reply), reduction="none") for prompt, reply in pairs]
        if max(t.max().item() for t in token_losses) < -torch.log(torch.tensor(0.9)).item():
            return
        opt.zero_grad()
        sum(t.mean() for t in token_losses).backward()
        opt.step()
    raise AssertionError("the tool model did not learn its two replies")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tiny_model_dir) -> dict:
    """The tiny model with the tool template, taught: ASK → CALL_TEXT; ASK + call + result → ANSWER."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("ckpt") / "tools"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(out)
    # the second prompt in the chat-template form (arguments as an object); no id, the template has none
    answered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
                {"role": "tool", "content": RESULT}]
    prompts = [list(tok.apply_chat_template(m, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for m in (ASK, answered)]
    replies = [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in (CALL_TEXT, ANSWER)]
    # what the model wrote is, token for token, what it reads back next turn (the template renders it so)
    assert prompts[1][: len(prompts[0]) + len(replies[0])] == prompts[0] + replies[0]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    _overfit(model, list(zip(prompts, replies)))
    model.save_pretrained(out)
    return {"path": str(out), "prompts": prompts, "replies": replies}


@pytest.fixture
def tool_gateway(make_config, tool_model):
    """A gateway of its own on the tool model: every sealed turn in its home is this test's."""
    cfg = make_config(model={"path": tool_model["path"]})
    with running_gateway(cfg) as app:
        yield cfg, app


def _ask(client, messages: list[dict], session: str | None, stream: bool = False):
    headers = {"X-Session-Id": session} if session else {}
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=64,
                                          stream=stream, extra_headers=headers)


def _answered(call_id: str, arguments: str) -> list[dict]:
    """The second request, as an agent builds it from the first reply."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


def _check_recorded(turns: list[dict], tool_model: dict, call_id: str) -> None:
    """Turn 0 holds the call (tools, exact tokens); turn 1 the call rendered back and the tool result."""
    assert [t["turn_index"] for t in turns] == [0, 1]
    assert turns[0]["session_id"] == turns[1]["session_id"]
    first, second = turns
    assert json.loads(first["tools"]) == TOOLS and json.loads(second["tools"]) == TOOLS
    assert first["finish_reason"] == "tool_calls" and first["response_text"] == CALL_TEXT
    [call] = json.loads(first["tool_calls"])
    assert call["id"] == call_id and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]
    assert first["prompt_token_ids"] == tool_model["prompts"][0]
    assert first["response_token_ids"] == tool_model["replies"][0]

    assert second["finish_reason"] == "stop" and second["response_text"] == ANSWER
    assert second["tool_calls"] is None
    assert second["prompt_token_ids"] == tool_model["prompts"][1]  # the call rendered back as the model wrote it
    assert second["response_token_ids"] == tool_model["replies"][1]
    user_msg, assistant, tool = json.loads(second["messages"])
    assert user_msg == {"role": "user", "content": ASK[0]["content"]}
    assert assistant["role"] == "assistant" and not assistant["content"]
    assert [c["function"] for c in assistant["tool_calls"]] == [CALL]
    assert tool == {"role": "tool", "content": RESULT, "tool_call_id": call_id}
    assert json.loads(second["new_messages"]) == [tool]  # the tool result is turn 0's next state


def test_tool_call_round_trip_through_the_sdk(tool_gateway, tool_model):
    cfg, _ = tool_gateway
    client = client_for(cfg)

    first = _ask(client, ASK, "weather")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]

    second = _ask(client, _answered(call.id, call.function.arguments), "weather")
    choice = second.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == ANSWER and choice.message.tool_calls is None

    _check_recorded(turns_of(cfg, "weather"), tool_model, call.id)


def test_streamed_tool_call_round_trip(tool_gateway, tool_model):
    cfg, _ = tool_gateway
    client = client_for(cfg)

    chunks = list(_ask(client, ASK, "weather-stream", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the call is no text
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0]
    [call] = deltas
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["tool_calls"] and chunks[-1].choices[0].finish_reason == "tool_calls"

    chunks = list(_ask(client, _answered(call.id, call.function.arguments), "weather-stream", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
    assert sum(bool(c.choices[0].delta.content) for c in chunks) > 2  # text streams even when tools are offered
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]

    _check_recorded(turns_of(cfg, "weather-stream"), tool_model, call.id)


# The reply's tool_calls carry `arguments` as a JSON string, the re-sent history (ChatMessage.to_template)
# as an object: sessions.py hashes both in one normal form, or every tool result would start a new session.
def test_tool_result_continues_the_inferred_session(tool_gateway, tool_model):
    """Without X-Session-Id, the request carrying the tool result extends turn 0's messages + reply:
    the session is inferred, so the tool result still pairs with the call as its next state."""
    cfg, _ = tool_gateway
    client = client_for(cfg)
    [call] = _ask(client, ASK, None).choices[0].message.tool_calls
    assert _ask(client, _answered(call.id, call.function.arguments), None).choices[0].message.content == ANSWER

    turns = sorted(sealed_turns(cfg), key=lambda t: t["created_at"])
    assert turns[0]["session_id"].startswith("inferred-")
    _check_recorded(turns, tool_model, call.id)
