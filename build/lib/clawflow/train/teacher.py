"""The OPD teacher's prompt: the request with the judge's hindsight hint added to the last user
message, tokenized with the model's own chat template, so that the recorded response ids can be
scored after it token for token (the response is never re-tokenized).

Format (as OpenClaw-RL's OPD): the last user message's text gets

    <text>\\n\\n[user's hint / instruction]\\n<hint>

appended; a conversation without a user message gets the hint as a new last user message.
Content-part arrays keep their parts and get the hint as one more text part.
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


def teacher_prompt_ids(tokenizer, messages: list[dict], hint: str, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the hint-augmented prompt, ending with the assistant generation prompt."""
    ids = tokenizer.apply_chat_template(hinted_messages(messages, hint), tools=tools or None,
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
