"""Held-out probe turns for the eval gate: recent judged turns the candidate did not train on.

With `gate.holdout_fraction` f > 0 a fixed slice of all turns (the first 32 bits of md5(turn_id)
below f · 2³²) is never trained on: the flow judges and consumes those turns like any other but
leaves them out of the samples, so neither the champion nor any candidate ever saw them. The gate
scores the newest judged turns of that slice, up to `gate.judged_probes` per sign. A hash rather
than a random draw: the split is the same on every retry, in SQL and in Python, with no state.

With f = 0 the probe set is the newest judged turns outside the candidate's batch; they may have
trained an ancestor of both models, so the check reads "did this step undo earlier feedback".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar

from clawflow.store import queries
from clawflow.store.catalog import Catalog

_SCALE = 1 << 32


@dataclass(frozen=True, slots=True)
class ProbeTurn:
    """A held-out judged turn as the gate scores it: the recorded prompt and reply token ids."""

    turn_id: str
    score: int  # +1 / −1
    created_at: datetime
    prompt_token_ids: list[int]
    response_token_ids: list[int]


class _Keyed(Protocol):
    turn_id: str


K = TypeVar("K", bound=_Keyed)


def _cut(fraction: float) -> int:
    return round(fraction * _SCALE)


def in_holdout(turn_id: str, fraction: float) -> bool:
    return int(hashlib.md5(turn_id.encode()).hexdigest()[:8], 16) < _cut(fraction)


def split_holdout(judgments: Sequence[K], fraction: float) -> tuple[list[K], list[K]]:
    """(judgments to train on, held-out judgments) by the turn-id hash."""
    held = [j for j in judgments if in_holdout(j.turn_id, fraction)]
    ids = {j.turn_id for j in held}
    return [j for j in judgments if j.turn_id not in ids], held


def held_out_turns(catalog: Catalog, per_sign: int, exclude: list[str], fraction: float,
                   users: list[str] | None = None) -> list[ProbeTurn]:
    """The newest judged (+1 / −1) main turns not in `exclude` (the candidate's batch), at most
    `per_sign` of each score, newest first; from the holdout slice when `fraction` > 0; `users`: only
    theirs (a user's own adapter is gated on that user's turns alone)."""
    if per_sign <= 0:
        return []
    judged, params = queries.judgments_from(catalog.storage)
    slice_ = "AND ('0x' || md5(t.turn_id)[1:8])::UBIGINT < $cut" if fraction > 0 else ""
    sql = f"""
        SELECT t.turn_id, t.path, j.score FROM turn_keys AS t JOIN {judged} AS j USING (turn_id)
        WHERE t.turn_type = 'main' AND j.score <> 0 AND NOT list_contains($exclude, t.turn_id) {slice_}
              {'AND list_contains($users, t."user")' if users is not None else ''}
        QUALIFY row_number() OVER (PARTITION BY sign(j.score) ORDER BY t.created_at DESC, t.turn_id) <= $n
        ORDER BY t.created_at DESC, t.turn_id"""
    args = {**params, "exclude": list(exclude), "n": per_sign, **({"cut": _cut(fraction)} if fraction > 0 else {}),
            **({"users": list(users)} if users is not None else {})}
    with catalog.connect() as con:
        keys = con.execute(sql, args).fetchall()
        rows = queries.full_rows(catalog, con, [k[0] for k in keys], {k[1] for k in keys})
    return [ProbeTurn(tid, int(score), rows[tid]["created_at"], list(rows[tid]["prompt_token_ids"]),
                      list(rows[tid]["response_token_ids"]))
            for tid, _, score in keys if tid in rows]

