"""The standing-preference record and its Parquet form (one row per preference; `variants`, the
hints it was made from, as JSON text). Pure."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from clawflow.prefs.axes import Stance

SCHEMA_VERSION = 1
SCHEMA = pa.schema([
    ("pref_id", pa.string()), ("user", pa.string()), ("axis", pa.string()), ("pole", pa.string()),
    ("number", pa.int64()), ("status", pa.string()), ("superseded_by", pa.string()),
    ("created_at", pa.string()), ("updated_at", pa.string()), ("variants", pa.string()),
], metadata={b"clawflow.preferences.schema_version": str(SCHEMA_VERSION).encode()})
ACTIVE, SUPERSEDED = "active", "superseded"


@dataclass(slots=True)
class Variant:
    """One hint a preference was made from: its words, where it came from, and its measured strength
    (train/rewrite.py `hint_strength`, written back by the run that measured it)."""

    text: str
    session_id: str | None
    turn_id: str
    created_at: str
    strength: float | None = None


@dataclass(slots=True)
class Preference:
    pref_id: str
    user: str
    axis: str
    pole: str
    number: int | None
    created_at: str
    updated_at: str
    variants: list[Variant] = field(default_factory=list)
    status: str = ACTIVE
    superseded_by: str | None = None

    @staticmethod
    def new_id(user: str, turn_id: str, text: str) -> str:
        return "p-" + hashlib.sha1(f"{user}\0{turn_id}\0{text}".encode()).hexdigest()[:10]

    @property
    def stance(self) -> Stance:
        return Stance(self.axis, self.pole, self.number)

    @property
    def strength(self) -> float | None:
        known = [v.strength for v in self.variants if v.strength is not None]
        return max(known) if known else None

    @property
    def text(self) -> str:
        """The words a teacher reads: the strongest variant measured, else the newest concrete one
        (with a number: "30 words at most" over "too wordy"), else the newest."""
        measured = [v for v in self.variants if v.strength is not None]
        if measured:
            return max(measured, key=lambda v: v.strength).text
        concrete = [v for v in self.variants if any(c.isdigit() for c in v.text)]
        return max(concrete or self.variants, key=lambda v: v.created_at).text

    @property
    def sessions(self) -> list[str]:
        return sorted({v.session_id for v in self.variants if v.session_id})

    def to_row(self) -> dict:
        row = {k: getattr(self, k) for k in ("pref_id", "user", "axis", "pole", "number", "status",
                                             "superseded_by", "created_at", "updated_at")}
        row["variants"] = json.dumps([asdict(v) for v in self.variants], ensure_ascii=False)
        return row

    @classmethod
    def from_row(cls, row: dict) -> Preference:
        variants = [Variant(**v) for v in json.loads(row["variants"] or "[]")]
        return cls(row["pref_id"], row["user"], row["axis"], row["pole"], row["number"], row["created_at"],
                   row["updated_at"], variants, row["status"], row["superseded_by"])


def to_table(prefs: list[Preference]) -> pa.Table:
    return pa.Table.from_pylist([p.to_row() for p in prefs], schema=SCHEMA)


def from_table(table: pa.Table) -> list[Preference]:
    return [Preference.from_row(r) for r in table.to_pylist()]


def ranked(prefs: list[Preference], user: str | None = None) -> list[Preference]:
    """A user's active preferences, strongest first (unmeasured ones after, newest first)."""
    active = [p for p in prefs if p.status == ACTIVE and (user is None or p.user == user)]
    active.sort(key=lambda p: p.updated_at, reverse=True)
    return sorted(active, key=lambda p: p.strength is None)  # stable: measured first, then by recency
