"""Hindsight hints from a user's correction, without an LLM: keep the sentences that say what
should have been done ("no, …", "please …", "I prefer …", "next time …", imperatives).

A hint is an instruction the policy could have followed when writing the turn; on-policy
distillation conditions the teacher on it. Heuristic by design: it lifts the user's own words,
it does not rephrase them, and it returns None rather than a vague hint.
"""

from __future__ import annotations

import re

HINTS_VERSION = "2"  # part of the embedded judge's version: new rules re-judge turns

_SENTENCES = re.compile(r"(?<=[.!?])\s+|\n+")
_CORRECTIVE = re.compile(
    r"^(no\b|nope\b|not\b|please\b|pls\b|i (prefer|'d prefer|would prefer|said|asked|meant|wanted|need)\b|"
    r"i('d| would)? like\b|i want\b|next time\b|instead\b|"
    r"(can|could|would|will|can'?t) you\b|"
    r"make\b|keep\b|use\b|write\b|give\b|add\b|remove\b|drop\b|put\b|answer\b|reply\b|cut\b|trim\b|"
    r"skip\b|stick\b|format\b|start\b|finish\b|end\b|lay\b|list\b|focus\b|calm\b|tone\b|"
    r"don'?t\b|do not\b|stop\b|avoid\b|try\b|include\b|mention\b|swap\b|change\b|shorten\b|translate\b|"
    r"(shorter|longer|briefer|simpler|less|more|fewer)\b|"
    r"be\b|look\b|ask\b|only\b|always\b|never\b|it'?s\b|that'?s\b|it should\b|should\b|"
    r"you (should|need to|forgot)\b)"
    r"|\b(instead|should|rather than|not .{1,40}, |too (?!much\b|many\b|bad\b)\w+|a lot to (read|take in)|"
    r"(at most|at least|no more than|fewer than|under) \d+|\w+ (please|pls)\b)",
    re.IGNORECASE)
_FILLER = re.compile(r"^(no|nope|ugh|hmm|wow|ok|okay)\W*$", re.IGNORECASE)
_LEAD = re.compile(r"^(no|nope|hmm|ugh|well)[,!.:;]*\s+", re.IGNORECASE)
# What follows these starts the user's next request: not hindsight about the turn just judged.
_NEXT_REQUEST = re.compile(r"^(next one|another (one|question)|new question|moving on|next question)\b",
                           re.IGNORECASE)


def hint_sentences(text: str) -> list[str]:
    """The message's sentences up to its next request (fillers like a bare "No!" and new questions
    dropped) when at least one is corrective, else []: the sentence around a correction often
    carries the fact ("I have 20 minutes"), while a follow-up question is a new request."""
    sentences: list[str] = []
    for raw in _SENTENCES.split(text.strip()):
        s = raw.strip()
        if _NEXT_REQUEST.match(s):
            break
        if not s or _FILLER.match(s):
            continue
        s = _LEAD.sub("", s)
        if s.endswith("?") and not _CORRECTIVE.search(s):
            continue
        sentences.append(s)
    return sentences if any(_CORRECTIVE.search(s) for s in sentences) else []


def extract_hint(text: str, min_chars: int = 10, max_sentences: int = 3, max_chars: int = 300) -> str | None:
    """The corrective part of a user message as a hint, or None."""
    hint = " ".join(hint_sentences(text)[:max_sentences]).strip()
    if len(hint) < min_chars:
        return None
    hint = hint[0].upper() + hint[1:]
    return hint if len(hint) <= max_chars else hint[:max_chars].rsplit(" ", 1)[0] + "…"
