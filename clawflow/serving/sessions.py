"""Which session a request belongs to, and which messages it added since that session's last turn.

With `X-Session-Id` the client says so. Without it (most OpenAI clients) the session is inferred:
a request whose messages start with an earlier turn's messages plus that turn's reply continues
that session. Missing headers never mean "nothing trains".

Sessions belong to users (the API key's owner, recorded as the turn's `user`): the tracker keys
each remembered history by its user too, so a request of user B whose messages extend user A's
turn starts a session of its own. An explicit `X-Session-Id` is recorded as the client sent it;
a session is the pair (user, session_id), and the catalog pairs turns within that pair only
(clawflow/store/queries.py), so two users who happen to send the same id stay apart.

`turn_index` is the number of assistant messages in the request, so it survives restarts and
needs no server state. `new_messages` are the messages after the last assistant message: the
previous turn's next state (a user reply, tool results).
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import OrderedDict
from typing import Any

from clawflow.contracts.turn import DEFAULT_USER
from clawflow.envelopes import normalize_text
from clawflow.serving.protocol import tool_arguments


def _canon(msg: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that identify it (clients re-send history with cosmetic changes, and
    an agent's envelope may change between re-sends, e.g. OpenClaw's runtime line)."""
    calls = msg.get("tool_calls") or []
    content = msg.get("content") or ""
    if msg.get("role") == "user":
        content = normalize_text(content)
    return {
        "role": msg.get("role"),
        "content": content.strip(),
        "tool_calls": [[c["function"]["name"], tool_arguments(c["function"].get("arguments"))] for c in calls],
    }


def history_key(messages: list[dict[str, Any]], user: str = DEFAULT_USER) -> str:
    """The identity of `user`'s conversation `messages` (the same messages of another user differ)."""
    blob = json.dumps([user, [_canon(m) for m in messages]], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def split_new_messages(messages: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """(turn_index, messages added after the last assistant message)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    turn_index = sum(1 for m in messages if m.get("role") == "assistant")
    return turn_index, messages[last + 1 :]


class SessionTracker:
    """Remembers (user, history + reply) → session for the most recent `capacity` turns."""

    def __init__(self, capacity: int = 10_000):
        self._by_history: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def resolve(self, messages: list[dict[str, Any]], header_session: str | None, *, user: str) -> str:
        if header_session:
            return header_session
        # Try the longest prefix that ends in an assistant reply: that is the turn we continue.
        for end in range(len(messages), 0, -1):
            if messages[end - 1].get("role") != "assistant":
                continue
            with self._lock:
                found = self._by_history.get(history_key(messages[:end], user))
            if found:
                return found
        return f"inferred-{uuid.uuid4().hex}"

    def remember(self, session_id: str, messages: list[dict[str, Any]], reply: dict[str, Any], *,
                 user: str) -> None:
        key = history_key([*messages, reply], user)
        with self._lock:
            self._by_history[key] = session_id
            self._by_history.move_to_end(key)
            while len(self._by_history) > self._capacity:
                self._by_history.popitem(last=False)
