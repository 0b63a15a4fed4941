"""The judge interface: one async callable, one signature, any backend.

    judgment = await judge(JudgeInput(context=[...], turn={...}, next_state=[...], next_role="user"))

`context` is the request's messages, `turn` the assistant message (content and tool calls),
`next_state` the messages that followed it (the user's reply or tool results) and `next_role`
the role of the first of them. The score is the majority of the votes; a tie or no valid vote
is 0 (no training signal), never a guess.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class JudgeInput:
    context: list[dict[str, Any]]
    turn: dict[str, Any]
    next_state: list[dict[str, Any]]
    next_role: str


@dataclass(frozen=True)
class Judgment:
    score: int  # +1 progress, −1 wrong / redo / correction / error, 0 ambiguous
    votes: list[int | None]  # None = an invalid vote
    rationale: str
    hint: str | None = None
    judge: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Judge(Protocol):
    name: str

    async def __call__(self, item: JudgeInput) -> Judgment: ...


def majority(votes: list[int | None]) -> int:
    valid = Counter(v for v in votes if v in (-1, 0, 1))
    if not valid:
        return 0
    (top, n), *rest = valid.most_common()
    return 0 if rest and rest[0][1] == n else top


async def judge_many(judge: Judge, items: list[JudgeInput], concurrency: int = 8) -> list[Judgment]:
    """Judge `items` concurrently (bounded), results in input order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(item: JudgeInput) -> Judgment:
        async with sem:
            return await judge(item)

    return list(await asyncio.gather(*(one(i) for i in items)))
