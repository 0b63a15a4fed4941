"""The pair: a recorded main turn together with its next state, as the catalog hands it to the judge.

Built by the catalog (clawflow/store/queries.py `batch`) from the turn's shard row and the row of
the turn after it; read by the judge's input builder and by the training-sample builder
(clawflow/feedback.py). In memory only (a flow passes it between tasks): the turn's own columns
keep the shard's encoding (JSON fields as text), documented in clawflow/contracts/turn.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from clawflow.contracts._parquet import columns
from clawflow.contracts.turn import DEFAULT_USER


@dataclass(slots=True)
class Pair:
    turn_id: str
    session_id: str
    turn_index: int
    messages: str  # JSON: the request's messages
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    next_state: str | None  # JSON: the messages that followed the reply (the next turn's new ones)
    next_role: str | None = None  # role of the first next-state message: "user" or "tool"
    tools: str | None = None  # JSON or null
    tool_calls: str | None = None  # JSON or null
    group_id: str | None = None  # samples of one prompt (n > 1): GRPO normalization
    source: str | None = None  # "live" or the environment's name
    policy_version: int | None = None
    env_reward: float | None = None  # the environment's outcome, when one was recorded
    created_at: datetime | None = None
    prompt_tokens: int | None = None  # token counts (derived for shards older than schema v2)
    response_tokens: int | None = None
    user: str = DEFAULT_USER  # who sent the turn (the API key's owner; "default" for shards before turn schema v3)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Pair:
        """From a turn row (extra columns ignored), with `next_state` / `next_role` set."""
        return cls(**{k: row[k] for k in _NAMES if k in row})


_NAMES = tuple(f.name for f in dataclasses.fields(Pair))
COL = columns(Pair)
