"""Does a reply show what a hint asks, where the hint's words say something a reply can be checked
against ("no more than 30 words", "all lowercase", "as a bullet list", "end with a question")? Pure.

Why: a teacher that cannot show a preference still changes its answers when the preference is in
its prompt, only not in the way asked. SmolLM2-135M told "All lowercase please, no capitals." answers
shorter, never in lowercase (0 of 52 rewrites of a bench round): distilled, the student learned to be
brief, and the gate's preference measure (which cannot read the words) promoted it. So the recipe
learns a rewrite only when it shows every checkable stance of the hint its teacher read
(`train.verify_stances`), and prefers such candidates among its best-of-N. A stance read from the
user's own words (prefs/axes.py), not the learning bench's persona checker; a stance with no
check ("be more casual", "more detail") passes, as every rewrite did before.
"""

from __future__ import annotations

import re

from clawflow.prefs.axes import Stance, stances_in

_BULLET = re.compile(r"^\s*[-*•]\s+\S")
_NUMBERED = re.compile(r"^\s*\d+[.)]\s+\S")
_CONTRACTION = re.compile(r"n't\b|'(re|ve|ll|d|m)\b", re.IGNORECASE)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# (axis, pole) -> whether a non-empty reply shows it; a length stance is checkable with a number only
CHECKS = {
    ("length", "short"): lambda t, st: len(t.split()) <= st.number,
    ("length", "long"): lambda t, st: len(t.split()) >= st.number,
    ("case", "lower"): lambda t, st: not any(c.isupper() for c in t),
    ("format", "bullets"): lambda t, st: sum(bool(_BULLET.match(ln)) for ln in _lines(t)) >= 2,
    ("format", "numbered"): lambda t, st: sum(bool(_NUMBERED.match(ln)) for ln in _lines(t)) >= 2,
    ("format", "prose"): lambda t, st: not any(_BULLET.match(ln) or _NUMBERED.match(ln) for ln in _lines(t)),
    ("excitement", "calm"): lambda t, st: "!" not in t,
    ("closing", "question"): lambda t, st: t.rstrip().endswith("?"),
    ("tone", "formal"): lambda t, st: not _CONTRACTION.search(t.replace("’", "'")),
}


# Stances a reply cannot show once a part of it fails them: too many words, a capital, a "!", a
# contraction, a list line stay in every longer text. (A list, a closing question or a minimum length
# may still come.) Sampling stops such a candidate there (train/rewrite.py `sample_candidates`).
FOR_GOOD = {("length", "short"), ("case", "lower"), ("excitement", "calm"), ("tone", "formal"), ("format", "prose")}


def has_check(st: Stance) -> bool:
    return (st.axis, st.pole) in CHECKS and (st.axis != "length" or st.number is not None)


def shows(st: Stance, text: str) -> bool | None:
    """Whether `text` shows stance `st`, or None when the stance has no check. An empty reply shows
    nothing."""
    if not has_check(st):
        return None
    return bool(text.strip()) and CHECKS[st.axis, st.pole](text, st)


def checkable(hint: str) -> list[Stance]:
    """The stances of `hint` (every sentence, every axis it names) that a reply can be checked against."""
    return [st for st in stances_in(hint) if has_check(st)]


def unshown(hint: str, text: str) -> list[Stance]:
    """The checkable stances of `hint` that `text` does not show (none: it shows them all, or has none)."""
    return [st for st in checkable(hint) if not shows(st, text)]


def cannot_show(stances: list[Stance], prefix: str) -> bool:
    """Whether a reply that starts with `prefix` fails one of `stances` whatever follows (`FOR_GOOD`).
    `stances` as `checkable` gives them. Pure."""
    return any((st.axis, st.pole) in FOR_GOOD and not CHECKS[st.axis, st.pole](prefix, st) for st in stances)


def label(st: Stance) -> str:
    """'length/short 30', 'case/lower': how the run's log names a stance."""
    return f"{st.axis}/{st.pole}" + (f" {st.number}" if st.number else "")
