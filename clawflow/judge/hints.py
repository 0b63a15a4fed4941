"""Hindsight hints from a user's correction, without an LLM: keep the sentences that say what
should have been done ("no, …", "please …", "I prefer …", "next time …", imperatives).

A hint is an instruction the policy could have followed when writing the turn; on-policy
distillation conditions the teacher on it. Heuristic by design: it lifts the user's own words,
it does not rephrase them, and it returns None rather than a vague hint.
"""

from __future__ import annotations

import re

_SENTENCES = re.compile(r"(?<=[.!?])\s+|\n+")
_CORRECTIVE = re.compile(
    r"^(no\b|nope\b|not\b|please\b|pls\b|i (prefer|'d prefer|would prefer|said|asked|meant|wanted|need)\b|"
    r"next time\b|instead\b|make\b|keep\b|use\b|write\b|give\b|add\b|remove\b|drop\b|put\b|answer\b|reply\b|"
    r"don'?t\b|do not\b|stop\b|avoid\b|try\b|include\b|mention\b|swap\b|change\b|shorten\b|translate\b|"
    r"be\b|look\b|ask\b|only\b|always\b|never\b|it'?s\b|that'?s\b|it should\b|should\b|you (should|need to|forgot)\b)"
    r"|\b(instead|should|rather than|not .{1,40}, |too (long|short|formal|casual|vague|early|late)|"
    r"\w+ (please|pls)\W*$)",
    re.IGNORECASE)
_FILLER = re.compile(r"^(no|nope|ugh|hmm|wow|ok|okay)\W*$", re.IGNORECASE)
_LEAD = re.compile(r"^(no|nope)[,!.:;]*\s+", re.IGNORECASE)


def hint_sentences(text: str) -> list[str]:
    """The message's sentences (fillers like a bare "No!" dropped) when at least one is corrective,
    else []: the sentence around a correction often carries the fact ("I have 20 minutes")."""
    sentences = [_LEAD.sub("", s.strip()) for s in _SENTENCES.split(text.strip())
                 if s.strip() and not _FILLER.match(s.strip())]
    return sentences if any(_CORRECTIVE.search(s) for s in sentences) else []


def extract_hint(text: str, min_chars: int = 10, max_sentences: int = 3, max_chars: int = 300) -> str | None:
    """The corrective part of a user message as a hint, or None."""
    hint = " ".join(hint_sentences(text)[:max_sentences]).strip()
    if len(hint) < min_chars:
        return None
    hint = hint[0].upper() + hint[1:]
    return hint if len(hint) <= max_chars else hint[:max_chars].rsplit(" ", 1)[0] + "…"
