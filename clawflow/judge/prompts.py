"""Judge prompts: versioned text files in `clawflow/judge/prompts/`, rendered from a JudgeInput.

A prompt's version is its file name (`prm_v1`); change the wording → add `prm_v2` and point
`judge.prm_prompt` at it, so every stored judgment says which prompt produced it. Templates use
`$placeholders` (string.Template) so the `\\boxed{...}` braces in the text need no escaping.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Any

from clawflow.judge.base import JudgeInput

PLACEHOLDERS = ("context", "turn", "next_role", "next_state")


@dataclass(frozen=True)
class Prompt:
    version: str
    template: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.template.encode()).hexdigest()[:12]


def load_prompt(name: str) -> Prompt:
    path = resources.files("clawflow.judge") / "prompts" / f"{name}.txt"
    if not name.replace("_", "").isalnum() or not path.is_file():
        raise ValueError(f"no judge prompt named {name!r} in clawflow/judge/prompts/")
    text = path.read_text(encoding="utf-8")
    missing = [p for p in PLACEHOLDERS if f"${p}" not in text]
    if missing:
        raise ValueError(f"judge prompt {name!r} lacks ${', $'.join(missing)}")
    return Prompt(name, text)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[… {len(text) - limit} characters cut …]\n{text[-half:]}"


def format_message(m: dict[str, Any], limit: int = 2000) -> str:
    role = m.get("role", "?")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    lines = [f"[{role}] {_clip(str(content or ''), limit)}".rstrip()]
    for call in m.get("tool_calls") or []:
        fn = call.get("function", {})
        lines.append(f"[{role} calls tool] {fn.get('name')}({_clip(str(fn.get('arguments', '')), 500)})")
    return "\n".join(lines)


def render(prompt: Prompt, item: JudgeInput, include_request: bool = True, context_messages: int = 6) -> str:
    context = item.context[-context_messages:] if context_messages > 0 else []
    ctx = "\n".join(format_message(m) for m in context) if include_request and context else "(not shown)"
    turn = format_message({"role": "assistant", **item.turn})
    nxt = "\n".join(format_message(m) for m in item.next_state) or "(empty)"
    return Template(prompt.template).substitute(context=ctx, turn=turn, next_role=item.next_role, next_state=nxt)


def messages(prompt: Prompt, item: JudgeInput, include_request: bool = True, context_messages: int = 6) -> list[dict]:
    """The chat messages sent to the judge model (one user message)."""
    return [{"role": "user", "content": render(prompt, item, include_request, context_messages)}]


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]
