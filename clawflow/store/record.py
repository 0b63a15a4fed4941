"""The turn record: one row per assistant turn, used by the WAL, the Parquet shards and the trainer.

Written down once here. JSON-typed fields (`messages`, `tools`, `tool_calls`, `new_messages`) are
stored as JSON text so any Parquet reader sees plain strings. Bump `SCHEMA_VERSION` when a column
changes; readers accept older versions (`upgrade_row`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

ARROW_SCHEMA = pa.schema(
    [
        ("turn_id", pa.string()),
        ("session_id", pa.string()),
        ("turn_index", pa.int32()),
        ("turn_type", pa.string()),  # main | side
        ("source", pa.string()),  # "live" or an environment's name
        ("group_id", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("policy_version", pa.int64()),
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float32())),
        ("response_text", pa.string()),
        ("tool_calls", pa.string()),
        ("finish_reason", pa.string()),
        ("new_messages", pa.string()),
        ("session_done", pa.bool_()),
        ("env_reward", pa.float64()),
    ],
    metadata={b"clawflow.schema_version": str(SCHEMA_VERSION).encode()},
)


@dataclass(slots=True)
class TurnRecord:
    session_id: str
    turn_index: int
    policy_version: int
    messages: list[dict[str, Any]]
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    new_messages: list[dict[str, Any]]
    turn_type: str = "main"
    source: str = "live"
    group_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    session_done: bool = False
    env_reward: float | None = None
    turn_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def to_row(self) -> dict[str, Any]:
        """A dict with exactly the Arrow schema's columns (JSON fields as text)."""
        row = asdict(self)
        for name in _JSON_FIELDS:
            row[name] = None if row[name] is None else json.dumps(row[name], ensure_ascii=False)
        return row

    def to_json(self) -> str:
        row = self.to_row()
        row["created_at"] = self.created_at.isoformat()
        return json.dumps(row, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "TurnRecord":
        row = upgrade_row(dict(row))
        for name in _JSON_FIELDS:
            if isinstance(row.get(name), str):
                row[name] = json.loads(row[name])
        if isinstance(row.get("created_at"), str):
            row["created_at"] = datetime.fromisoformat(row["created_at"])
        return cls(**{f.name: row.get(f.name) for f in fields(cls) if f.name in row})


_JSON_FIELDS = ("messages", "tools", "tool_calls", "new_messages")


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """Fill columns that older schema versions lack with their defaults."""
    row.setdefault("session_done", False)
    row.setdefault("env_reward", None)
    row.setdefault("group_id", None)
    return row


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
