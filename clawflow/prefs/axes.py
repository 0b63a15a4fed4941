"""Which standing preference a hint states: an axis (length, format, ...), the pole on it (short or
long), and its number when it has one ("30 words"). Pure and lexical, like the hints themselves
(clawflow/judge/hints.py lifts the user's own words).

Why axes and not only embeddings: "Keep it shorter." and "Give me more detail." are close in any
sentence embedding (both are about length), yet one must supersede the other. The axis says two
hints are about the same thing; the pole says whether they agree. Hints on no axis that still
declare a standing wish ("always ...", "from now on ...") get the axis `other` and are merged by
embedding similarity only (store.py). A hint on no axis is a content correction ("No, Paris.") or a
vague one ("That's wrong."): it stays a hint for its own turn and never becomes a preference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_HINT_CHARS = 400  # longer is not a preference someone stated; refused (a judge's essay, a paste)


@dataclass(frozen=True, slots=True)
class Stance:
    axis: str
    pole: str
    number: int | None = None


# (axis, pole, pattern), first match wins: the "too X" phrases come before the single words they
# contain ("too short" means longer; "too casual" means formal).
_RULES: list[tuple[str, str, str]] = [
    ("length", "long", r"too (short|brief|terse)|longer|more detail|more details|elaborate|expand on|"
                       r"say (a little |a bit )?more|more thorough|in more depth|at least \d+ words?"),
    ("length", "short", r"too (long|wordy|verbose)|wordy|shorter|\bshort (answers?|repl(y|ies))|brief|concise|"
                        r"terse|to the point|long-winded|a lot to (read|take in)|keep it short|"
                        r"(at most|no more than|under|fewer than|less than|max(imum)?( of)?) \d+ words?|"
                        r"\d+ words? (at most|or (less|fewer)|max(imum)?)"),
    ("format", "prose", r"no (bullet|list|numbered)|not as a list|in prose|full sentences|plain paragraphs?"),
    ("format", "bullets", r"bullet|lines? starting with \W{0,2}- |laid out differently|hard to skim"),
    ("format", "numbered", r"numbered|step[- ]by[- ]step|\bsteps\b|what order to do"),
    ("case", "lower", r"lower ?case|no capital|shouty"),
    ("case", "normal", r"proper capitali[sz]ation|use capital letters|capitali[sz]e"),
    ("tone", "formal", r"too (casual|informal|chatty)|formal|professional|no contractions"),
    ("tone", "casual", r"too (formal|stiff)|stiff|casual|relaxed|chatty|friendly tone"),
    ("excitement", "calm", r"exclamation|calm down|excitable|less excited|tone it down"),
    ("closing", "question", r"check in with me|ask me (something|a question)|ask me .{0,12}back|"
                            r"(end|finish)\w* .{0,30}question|follow-up question|to think about next"),
    ("wording", "avoid", r"(never|don'?t|do not|stop|avoid|please avoid)\b.{0,20}\b(use|using|say|saying|write|writing)"
                         r"\b.{0,12}(words?|phrases?|[\"'“])|avoid saying|dislike (a|the) word"),
    ("opening", "start", r"start (your|each|every) (reply|answer) with"),
]
_COMPILED = [(a, p, re.compile(rf"(?:{pat})", re.IGNORECASE)) for a, p, pat in _RULES]
_STANDING = re.compile(r"\b(always|never|from now on|in (the )?future|every time|each time|whenever|"
                       r"every (reply|answer)|all (your )?(replies|answers))\b", re.IGNORECASE)
_NUMBER = re.compile(r"\b(\d{1,4})\b")


def _stance(axis: str, pole: str, text: str) -> Stance:
    """The stance, with the first number of `text` when it is about length ("30 words")."""
    number = _NUMBER.search(text) if axis == "length" else None
    return Stance(axis, pole, int(number.group(1)) if number else None)


def refuse_reason(hint: object) -> str | None:
    """Why `hint` cannot be a preference at all (not text, empty, huge), or None. Pure."""
    if not isinstance(hint, str):
        return f"not text ({type(hint).__name__})"
    if not hint.strip():
        return "empty"
    if len(hint) > MAX_HINT_CHARS:
        return f"{len(hint)} characters (more than {MAX_HINT_CHARS})"
    return None


def stance(hint: str) -> Stance | None:
    """The standing preference `hint` states, or None for a content or vague correction. Pure."""
    for axis, pole, pattern in _COMPILED:
        if pattern.search(hint):
            return _stance(axis, pole, hint)
    if _STANDING.search(hint):
        return Stance("other", "")
    return None


def contradicts(old: Stance, new: Stance) -> bool:
    """Whether `new` overrides `old`: the same axis with another pole, or another number ("under 50
    words" after "under 30 words"). `other` never contradicts: only embeddings relate those."""
    if old.axis != new.axis or old.axis in ("other", "wording"):
        return False
    return old.pole != new.pole or (old.number is not None and new.number is not None and old.number != new.number)


def agrees(old: Stance, new: Stance) -> bool:
    """Same axis and pole, numbers not in conflict: the two say the same thing."""
    return old.axis == new.axis and old.axis not in ("other", "wording") and not contradicts(old, new)


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def stances_in(text: str) -> list[Stance]:
    """Every stance `text` states: each sentence, each axis it names (its first pole there), e.g.
    "Use a bullet list, at most 60 words." -> format/bullets and length/short 60, where `stance` keeps
    only the first. For checking a reply against a teacher's words (prefs/shows.py). Pure."""
    out: list[Stance] = []
    for sentence in _SENTENCE.split(text):
        seen: set[str] = set()
        for axis, pole, pattern in _COMPILED:
            if axis in seen or not pattern.search(sentence):
                continue
            seen.add(axis)
            st = _stance(axis, pole, sentence)
            if st not in out:
                out.append(st)
    return out
