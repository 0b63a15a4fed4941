"""Agents' envelopes around the user's words: metadata, not words. Pure functions, one per client.

Recorded turns keep the bytes as received; whatever *reads* the user's words (the judge, its
hints, session inference) reads them through `normalize_text` / `normalize_messages`.

OpenClaw (verified against openclaw 2026.9.6's source and its requests to a capturing server):
- every user message starts with `[Fri 2026-12-04 04:11 UTC] `: `buildTimestampPrefix` =
  `[` + `formatZonedTimestamp(date, {timeZone, displayWeekday: true})` + `] `, i.e. en-US short
  weekday, `YYYY-MM-DD HH:MM` (h23), then the zone's short name (`UTC`, `EST`, `GMT+5:30`) when
  Intl gives one, in the user's timezone (`agents.defaults.userTimezone`, else the host's);
- the system prompt's runtime facts are relocated to the end of the *first* user message as
  `\\n\\nRuntime: agent=main | session=… | sessionId=… | host=… | … | model=… | shell=bash`
  (`buildRuntimeLine`: ` | `-joined `key=value` fields, each optional; the line is re-sent on
  that message every turn).

Another client's envelope is another pair of patterns added to `_CLIENTS`; bump `VERSION` when
what is stripped changes, since judges put it in their version (a turn is then judged again).
"""

from __future__ import annotations

import re
from typing import Any

VERSION = "1"

_OPENCLAW_STAMP = re.compile(
    r"\A\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})?(?: [A-Za-z0-9+\-:]{1,12})?\] ")
# The runtime line ends the message; it always has `agent=` (only `name=` may precede it), so a
# user's own "Runtime: 3 s" stays. Its "\n\n" is absent when content parts were joined (OpenClaw
# then sends the line as a text part of its own).
_OPENCLAW_RUNTIME = re.compile(r"(?:\n\n)?Runtime: (?:name=[^\n]*? \| )?agent=[^\n]*\Z")

_CLIENTS: dict[str, tuple[re.Pattern[str], ...]] = {
    "openclaw": (_OPENCLAW_STAMP, _OPENCLAW_RUNTIME),
}


def strip_openclaw(text: str) -> str:
    """`text` without OpenClaw's timestamp prefix and trailing runtime line (else unchanged)."""
    for pattern in _CLIENTS["openclaw"]:
        text = pattern.sub("", text, count=1)
    return text


def normalize_text(text: str) -> str:
    """The user's words without any known client's envelope."""
    for patterns in _CLIENTS.values():
        for pattern in patterns:
            text = pattern.sub("", text, count=1)
    return text


def normalize_content(content: Any) -> Any:
    """A message's `content` (a string or OpenAI content parts) with its text normalized."""
    if isinstance(content, str):
        return normalize_text(content)
    if isinstance(content, list):
        return [{**p, "text": normalize_text(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
                else p for p in content]
    return content


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of a user message without envelopes; other roles are returned as they are."""
    if message.get("role") != "user" or "content" not in message:
        return message
    content = normalize_content(message["content"])
    return message if content == message["content"] else {**message, "content": content}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [normalize_message(m) if isinstance(m, dict) else m for m in messages]
