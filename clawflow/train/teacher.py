"""The OPD teacher's prompt: the request with the judge's hindsight hint added to the last user
message, tokenized with the model's own chat template, so that the recorded response ids can be
scored after it token for token (the response is never re-tokenized).

Format (as OpenClaw-RL's OPD): the last user message's text gets

    <text>\\n\\n[user's hint / instruction]\\n<hint>

appended; a conversation without a user message gets the hint as a new last user message.
Content-part arrays keep their parts and get the hint as one more text part.

Distillation's rewrites put the hint in the system message instead (`system_hinted_messages`):
SmolLM2-135M with a style hint after the question stopped answering it. On the 56 held-out
questions of configs/eval/helpfulness.yaml (base 1.00) the hinted replies stated 0.80 / 0.77 /
0.38 of the facts for a length / numbered-list / ask-back hint after the question, 0.86 / 0.88 /
0.95 with the hint as the system message (issue #15).
"""

from __future__ import annotations

import copy
from typing import Any

HINT_HEADER = "[user's hint / instruction]"


def hinted_messages(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of `messages` with `hint` appended to the last user message."""
    out = copy.deepcopy(messages)
    suffix = f"\n\n{HINT_HEADER}\n{hint.strip()}"
    for m in reversed(out):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = [*content, {"type": "text", "text": suffix.lstrip()}]
        else:
            m["content"] = f"{content or ''}{suffix}"
        return out
    out.append({"role": "user", "content": f"{HINT_HEADER}\n{hint.strip()}"})
    return out


def system_hinted_messages(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of `messages` with `hint` appended to the system message, or as the system message."""
    out = copy.deepcopy(messages)
    if out and out[0].get("role") in ("system", "developer"):
        content = out[0].get("content")
        if isinstance(content, list):
            out[0]["content"] = [*content, {"type": "text", "text": hint.strip()}]
        else:
            out[0]["content"] = f"{content or ''}\n\n{hint.strip()}".lstrip()
        return out
    return [{"role": "system", "content": hint.strip()}, *out]


def teacher_prompt_ids(tokenizer, messages: list[dict], hint: str, tools: list[dict] | None = None,
                       in_system: bool = False) -> list[int]:
    """Token ids of the hint-augmented prompt, ending with the assistant generation prompt."""
    hinted = system_hinted_messages(messages, hint) if in_system else hinted_messages(messages, hint)
    return chat_prompt_ids(tokenizer, hinted, tools)


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` in the chat template, ending with the assistant generation prompt."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
