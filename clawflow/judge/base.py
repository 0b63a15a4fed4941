"""The judge interface: one async callable, one signature, any backend.

    judgment = await judge(JudgeInput(context=[...], turn={...}, next_state=[...], next_role="user"))

`context` is the request's messages, `turn` the assistant message (content and tool calls),
`next_state` the messages that followed it (the user's reply or tool results) and `next_role`
the role of the first of them. The score is the majority of the votes; a tie or no valid vote
is 0 (no training signal), never a guess. A hint (1–3 sentences of hindsight for on-policy
distillation) comes back when the judge was configured to give hints and the next state has one.

A judge that cannot answer (endpoint down, budget spent) raises `JudgeUnavailable`: the turn
stays unjudged and is judged on a later run; a failure is never turned into a score.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from clawflow.envelopes import normalize_messages


@dataclass(frozen=True)
class JudgeInput:
    context: list[dict[str, Any]]
    turn: dict[str, Any]
    next_state: list[dict[str, Any]]
    next_role: str

    def __post_init__(self) -> None:
        # Every backend, hint and feature reads the user's words, not the client's envelope
        # (OpenClaw's timestamp and runtime line): normalized once, here, for all of them.
        object.__setattr__(self, "context", normalize_messages(self.context))
        object.__setattr__(self, "next_state", normalize_messages(self.next_state))


@dataclass(frozen=True)
class Judgment:
    score: int  # +1 progress, −1 wrong / redo / correction / error, 0 ambiguous
    votes: list[int | None]  # None = an invalid vote
    rationale: str
    hint: str | None = None
    judge: str = ""  # the backend's name
    extra: dict[str, Any] = field(default_factory=dict)
    judge_version: str = ""  # changes whenever the same turn could be scored differently
    prompt_version: str | None = None  # prompt files used (LLM judge), None otherwise


class JudgeUnavailable(RuntimeError):
    """The judge could not answer for this turn (transport, budget); retry on a later run."""


class Judge(Protocol):
    name: str
    version: str

    async def __call__(self, item: JudgeInput) -> Judgment: ...


def majority(votes: list[int | None]) -> int:
    valid = Counter(v for v in votes if v in (-1, 0, 1) and not isinstance(v, bool))
    if not valid:
        return 0
    (top, n), *rest = valid.most_common()
    return 0 if rest and rest[0][1] == n else top


async def judge_many(judge: Judge, items: list[JudgeInput], concurrency: int = 8) -> list[Judgment | None]:
    """Judge `items` concurrently (bounded), results in input order; None where the judge was
    unavailable for that item. Other exceptions (bugs) propagate. A judge with a
    `judge_batch(items)` method (the embedded one: one batched forward for several turns) gets
    the items `concurrency` at a time instead."""
    batch = getattr(judge, "judge_batch", None)
    if batch is not None:
        return [j for at in range(0, len(items), concurrency) for j in batch(items[at:at + concurrency])]
    sem = asyncio.Semaphore(concurrency)

    async def one(item: JudgeInput) -> Judgment | None:
        async with sem:
            try:
                return await judge(item)
            except JudgeUnavailable:
                return None

    return list(await asyncio.gather(*(one(i) for i in items)))
