"""Reading judge model outputs: the last `\\boxed{}` value, hints between markers, hint choice.

Pure functions. Anything but a clean -1, 0 or +1 in the last box is an invalid vote (None): a
model that rambles, boxes "maybe", or nests LaTeX does not get to cast a vote.
"""

from __future__ import annotations

import re

BOX = "\\boxed{"
HINT_START, HINT_END = "[HINT_START]", "[HINT_END]"
_VOTE = re.compile(r"^\s*([+-]?)\s*([01])\s*$")


def parse_boxed(text: str | None) -> int | None:
    """The value of the last \\boxed{...} in `text` if it is -1, 0 or 1 (+1 and a Unicode minus
    accepted), else None."""
    if not text:
        return None
    start = text.rfind(BOX)
    if start < 0:
        return None
    end = text.find("}", start + len(BOX))
    if end < 0:
        return None
    m = _VOTE.match(text[start + len(BOX):end].replace("\u2212", "-"))
    if not m or "{" in text[start + len(BOX):end]:
        return None
    sign, digit = m.groups()
    if digit == "0":
        return 0
    return -1 if sign == "-" else 1


def extract_hint(text: str | None) -> str | None:
    """The hint between the last [HINT_START]…[HINT_END] pair of a reply that also boxed 1."""
    if not text or parse_boxed(text) != 1:
        return None
    start = text.rfind(HINT_START)
    end = text.find(HINT_END, start + len(HINT_START)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    hint = " ".join(text[start + len(HINT_START):end].split())
    return hint or None


def select_hint(candidates: list[str | None], min_chars: int = 20) -> str | None:
    """The longest valid hint of at least `min_chars` characters (first among equals), or None.
    Longest: the vote that kept the most concrete detail; the length floor drops "Be better."."""
    valid = [c.strip() for c in candidates if c and len(c.strip()) >= min_chars]
    return max(valid, key=len) if valid else None


def rationale(text: str | None, limit: int = 300) -> str:
    """The reasoning before the final box, trimmed, for the judgment record."""
    if not text:
        return ""
    cut = text.rfind(BOX)
    body = " ".join((text[:cut] if cut >= 0 else text).split())
    return body if len(body) <= limit else "…" + body[-limit:]
