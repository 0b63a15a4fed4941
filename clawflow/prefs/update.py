"""Folding a run's hints into a user's standing preferences. Pure: the embedding similarity is
handed in (store.py gives MiniLM's cosine), so tests can check every rule on plain strings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from clawflow.prefs.axes import agrees, contradicts, refuse_reason, stance
from clawflow.prefs.record import ACTIVE, SUPERSEDED, Preference, Variant

SIMILAR = 0.8  # MiniLM cosine at which two free-form preferences ("always ...") say the same thing


@dataclass(frozen=True, slots=True)
class NewHint:
    """A hint of a turn judged −1, as the flow hands it over."""

    user: str
    text: object  # whatever the judge produced: refused unless it is usable text
    session_id: str | None
    turn_id: str
    created_at: str  # ISO, UTC


def fold(prefs: list[Preference], hints: list[NewHint], similarity: Callable[[str, str], float] | None = None,
         threshold: float = SIMILAR) -> tuple[list[Preference], list[str]]:
    """(the preferences after `hints`, one log line per hint: what became of it). Hints are taken
    oldest first, so a later one supersedes an earlier one whatever order they came in."""
    prefs = [p for p in prefs]
    log: list[str] = []
    for h in sorted(hints, key=lambda h: h.created_at):
        if why := refuse_reason(h.text):
            log.append(f"hint of turn {h.turn_id} refused: {why}")
            continue
        text = h.text.strip()
        st = stance(text)
        if st is None:
            log.append(f"hint of turn {h.turn_id} is not a standing preference (content or vague): {text[:60]!r}")
            continue
        variant = Variant(text, h.session_id, h.turn_id, h.created_at)
        mine = [p for p in prefs if p.user == h.user and p.status == ACTIVE]
        same = next((p for p in mine if agrees(p.stance, st)), None)
        if same is None and st.axis in ("other", "wording") and similarity is not None:
            close = [(similarity(p.text, text), p) for p in mine if p.axis == st.axis]
            best = max(close, key=lambda c: c[0], default=(0.0, None))
            same = best[1] if best[0] >= threshold else None
        if same is not None:
            if all(v.text != text or v.session_id != h.session_id for v in same.variants):
                same.variants.append(variant)
            same.number = same.number if st.number is None else st.number
            same.updated_at = max(same.updated_at, h.created_at)
            log.append(f"hint of turn {h.turn_id} merged into {same.pref_id} ({same.axis}/{same.pole})")
            continue
        new = Preference(Preference.new_id(h.user, h.turn_id, text), h.user, st.axis, st.pole, st.number,
                         h.created_at, h.created_at, [variant])
        for old in mine:
            if contradicts(old.stance, st):
                old.status, old.superseded_by, old.updated_at = SUPERSEDED, new.pref_id, h.created_at
                log.append(f"{old.pref_id} ({old.text[:40]!r}) superseded by {new.pref_id} ({text[:40]!r})")
        prefs.append(new)
        log.append(f"new preference {new.pref_id} ({st.axis}/{st.pole}): {text[:60]!r}")
    return prefs, log


def forget_session(prefs: list[Preference], session_id: str) -> tuple[list[Preference], list[str]]:
    """Without the variants `session_id` gave; a preference left with none is gone (came only from it)."""
    kept, dropped = [], []
    for p in prefs:
        p.variants = [v for v in p.variants if v.session_id != session_id]
        (kept if p.variants else dropped).append(p)
    return kept, [p.pref_id for p in dropped]


def set_strengths(prefs: list[Preference], user: str, strengths: dict[str, float]) -> int:
    """Write measured strengths (hint text → strength) onto the user's variants; how many were set."""
    n = 0
    for p in prefs:
        if p.user != user:
            continue
        for v in p.variants:
            if v.text in strengths:
                v.strength, n = float(strengths[v.text]), n + 1
    return n


def teacher_text(texts: list[str], limit: int = 4) -> str:
    """What the teacher reads: the preferences' words (strongest first), at most `limit`, as sentences."""
    said = [t.strip() for t in texts if t and t.strip()][:limit]
    return " ".join(t if t[-1] in ".!?" else t + "." for t in said)
