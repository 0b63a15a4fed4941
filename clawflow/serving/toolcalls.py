"""Parse tool calls out of a reply in the Hermes/Qwen style the ChatML templates use:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the calls, OpenAI-style tool_calls); malformed calls stay in the content."""
    calls: list[dict[str, Any]] = []

    def _take(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
            name = obj["name"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return match.group(0)
        args = obj.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
        })
        return ""

    content = _CALL.sub(_take, text).strip()
    return content, calls
