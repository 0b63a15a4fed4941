"""The turn record: one row per assistant turn, used by the WAL, the Parquet shards and the trainer.

Written down once here. JSON-typed fields (`messages`, `tools`, `tool_calls`, `new_messages`) are
stored as JSON text so any Parquet reader sees plain strings. Every shard carries
`clawflow.schema_version` in its Parquet metadata. Changing a column means: bump `SCHEMA_VERSION`
and say in `ADDED` how the new columns derive from older rows; readers then upgrade old shards
on read (`upgrade_table` for Arrow, `sql_columns` for DuckDB, `upgrade_row` for dicts) and
compaction rewrites them in the current version.

History: v1 (walking skeleton); v2 adds `prompt_tokens`/`response_tokens`, so token budgets and
stats read two small integer columns instead of the token lists; v3 adds `user`, the owner of the
API key the turn came in with (config `serving.user`), so rows of older versions are `"default"`,
the owner of the single key every gateway had before users existed; v4 adds `adapter_version`, the
version (in its user's registry line) of the user's own adapter that decoded the turn, null when the
shared policy did (every row before v4), so a user's trainer knows which policy sampled it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 4
VERSION_KEY = b"clawflow.schema_version"
DEFAULT_USER = "default"  # the owner of turns recorded before v3 (and config serving.user's default)

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
        ("prompt_tokens", pa.int32()),  # v2
        ("response_tokens", pa.int32()),  # v2
        ("user", pa.string()),  # v3: the API key's owner
        ("adapter_version", pa.int64()),  # v4: the user's own adapter that decoded it; null: the shared policy
    ],
    metadata={VERSION_KEY: str(SCHEMA_VERSION).encode()},
)

# version -> columns it added: (DuckDB expression, Arrow function) computing them from older rows
ADDED: dict[int, dict[str, tuple[str, Any]]] = {
    2: {
        "prompt_tokens": ("len(prompt_token_ids)::INTEGER",
                          lambda t: pc.list_value_length(t["prompt_token_ids"]).cast(pa.int32())),
        "response_tokens": ("len(response_token_ids)::INTEGER",
                            lambda t: pc.list_value_length(t["response_token_ids"]).cast(pa.int32())),
    },
    3: {  # `user` is a keyword in SQL: quoted wherever DuckDB names it
        "user": (f"'{DEFAULT_USER}'::VARCHAR",
                 lambda t: pa.array([DEFAULT_USER] * t.num_rows, pa.string())),
    },
    4: {
        "adapter_version": ("NULL::BIGINT", lambda t: pa.nulls(t.num_rows, pa.int64())),
    },
}


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
    user: str = DEFAULT_USER  # who sent it: the API key's owner (the gateway always sets it)
    adapter_version: int | None = None  # the version of the user's own adapter that decoded it; None: shared
    turn_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def to_row(self) -> dict[str, Any]:
        """A dict with exactly the Arrow schema's columns (JSON fields as text)."""
        row = {name: getattr(self, name) for name in _FIELD_NAMES}  # shallow: asdict deep-copies every list
        for name in JSON_FIELDS:
            row[name] = None if row[name] is None else json.dumps(row[name], ensure_ascii=False)
        row["prompt_tokens"] = len(self.prompt_token_ids)
        row["response_tokens"] = len(self.response_token_ids)
        return row

    def to_json(self) -> str:
        row = self.to_row()
        row["created_at"] = self.created_at.isoformat()
        return json.dumps(row, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "TurnRecord":
        row = upgrade_row(dict(row))
        for name in JSON_FIELDS:
            if isinstance(row.get(name), str):
                row[name] = json.loads(row[name])
        if isinstance(row.get("created_at"), str):
            row["created_at"] = datetime.fromisoformat(row["created_at"])
        return cls(**{f.name: row.get(f.name) for f in fields(cls) if f.name in row})


JSON_FIELDS = ("messages", "tools", "tool_calls", "new_messages")
_FIELD_NAMES = tuple(f.name for f in fields(TurnRecord))


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """Fill columns that older schema versions lack."""
    row.setdefault("session_done", False)
    row.setdefault("env_reward", None)
    row.setdefault("group_id", None)
    if row.get("prompt_tokens") is None:
        row["prompt_tokens"] = len(row.get("prompt_token_ids") or [])
    if row.get("response_tokens") is None:
        row["response_tokens"] = len(row.get("response_token_ids") or [])
    if row.get("user") is None:
        row["user"] = DEFAULT_USER
    row.setdefault("adapter_version", None)
    return row


def schema_version(schema: pa.Schema) -> int:
    """The version a shard was written with (1 for a clawflow Parquet file without the key)."""
    raw = (schema.metadata or {}).get(VERSION_KEY)
    try:
        return int(raw) if raw is not None else 1
    except ValueError as exc:
        raise ValueError(f"unreadable schema version {raw!r}") from exc


def upgrade_table(table: pa.Table) -> pa.Table:
    """A shard's table in the current schema (columns added since its version derived)."""
    version = schema_version(table.schema)
    if version > SCHEMA_VERSION:
        raise ValueError(f"written by schema v{version}, newer than this clawflow (v{SCHEMA_VERSION})")
    for v in range(version + 1, SCHEMA_VERSION + 1):
        for name, (_, derive) in ADDED.get(v, {}).items():
            if name not in table.column_names:
                table = table.append_column(name, derive(table))
    return table.select(ARROW_SCHEMA.names).cast(ARROW_SCHEMA)


def sql_columns(version: int) -> str:
    """DuckDB select list that reads a shard of `version` as the current schema."""
    extra = [f'{expr} AS "{name}"' for v in range(version + 1, SCHEMA_VERSION + 1)
             for name, (expr, _) in ADDED.get(v, {}).items()]
    return ", ".join(["*", *extra])


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
