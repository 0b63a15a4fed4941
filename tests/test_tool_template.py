"""The tool-calling chat template given to materialized ChatML models whose own template ignores
tools (SmolLM2): plain chats render byte for byte as before, tools reach the prompt, and a call the
model wrote is read back exactly as written."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from clawflow.base_model import tool_template
from clawflow.serving.toolcalls import parse_tool_calls

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Oslo"}}


def render(tok, template, messages, tools=None):
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=True)


def test_plain_chats_render_as_the_models_own_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = tool_template(SMOLLM2)
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "more"}]):
        assert render(tok, ours, messages) == render(tok, SMOLLM2, messages)
    assert tool_template(ours) is None  # already tool-aware: left alone
    assert tool_template("{{ messages[0]['content'] }}") is None  # not ChatML: not ours to replace


def test_tools_calls_and_results_reach_the_prompt(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert "tools" in tok.chat_template  # the materialized tiny model (SmolLM2 tokenizer) got it
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    first = render(tok, None, ask, TOOLS)
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert json.dumps(TOOLS[0]) in first and "<tool_call>" in first
    written = "<tool_call>" + json.dumps(CALL) + "</tool_call>"
    content, calls = parse_tool_calls(written)
    assert content == "" and calls[0]["function"]["name"] == "get_weather"
    answered = [*ask, {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": CALL["arguments"]}}]},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"}]
    second = render(tok, None, answered, TOOLS)
    assert second.startswith(first)  # the history is a prefix: the call is read back as it was written
    assert second[len(first):].startswith(written + "<|im_end|>\n<|im_start|>tool\n<tool_response>\nsunny, 21 C")

    no_default = tool_template(SMOLLM2.replace("You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                                               "")).replace("default_system = \"\"", "default_system = none")
    assert render(tok, no_default, ask, TOOLS).startswith("<|im_start|>system\n# Tools")  # no leading blank lines
