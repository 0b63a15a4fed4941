"""Rehearsal for context distillation (`train.rehearsal`): the user's hints, practised on general questions.

A run of `distill` learns from the few turns the user corrected. On SmolLM2-135M, learning a
preference from ~10 such turns at a rate that moves it also moved what the model knows: facts the
base states ("the Pacific", "1945") were lost one by one, version after version (issue #15). So next
to the corrected turns, the policy with one of their hints in its system prompt answers a few general
questions with known key facts (configs/train/rehearsal.yaml, none of them the gate's held-out
questions); an answer that still states its fact is learned from the plain prompt, one that lost it
is left out. The preference is then practised on more than the requests that drew it, on targets
that are right. Rehearsal prompts are plain chat (no system prompt or tools): cheap to prefill even
when the user's agent sends 8k-token prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

from clawflow.config import REPO_ROOT
from clawflow.helpfulness import Question, load_questions

DEFAULT_FILE = REPO_ROOT / "configs" / "train" / "rehearsal.yaml"


def load_rehearsal(path: str | Path | None = None) -> list[Question]:
    """The rehearsal questions (helpfulness format); a ValueError naming the file and line if malformed."""
    return load_questions(path or DEFAULT_FILE)


def pair_with_hints(questions: list[Question], hints: list[str], n: int, seed: int) -> list[tuple[Question, str]]:
    """`n` distinct questions (a seeded sample, so each run rehearses others) each with one of the
    distinct `hints`, in turn. Nothing when there is no hint: rehearsal only repeats a stated wish."""
    distinct = sorted({h.strip() for h in hints if h and h.strip()})
    if not distinct or n <= 0:
        return []
    chosen = random.Random(seed).sample(questions, min(n, len(questions)))
    return [(q, distinct[k % len(distinct)]) for k, q in enumerate(chosen)]
