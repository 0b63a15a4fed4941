"""Embedded CPU judge: lexical cues in the next state, no second LLM.

Cheap and transparent, it catches the clear cases: thanks/praise (+1), corrections, "no",
redo requests and error output (−1); anything else is 0. A tool result is progress unless it
reports an error. It also lifts a hint from corrections that state what was wanted ("shorter",
"in French", "use a list"), for OPD. Kept as the transparent baseline
(`judge.backend: rules`); the embedded and LLM judges are more accurate.
"""

from __future__ import annotations

import re

from clawflow.envelopes import VERSION as ENVELOPES_VERSION
from clawflow.judge.base import JudgeInput, Judgment, majority

_NEG = re.compile(
    r"\b(no|nope|wrong|incorrect|not what|that's not|that is not|didn't|doesn't work|does not work|"
    r"try again|redo|instead|shorter|longer|too (long|short|verbose)|i said|i asked|stop|don't|"
    r"error|failed|fails|broken)\b",
    re.IGNORECASE,
)
_POS = re.compile(r"\b(thanks|thank you|thx|great|perfect|awesome|nice|exactly|works|correct|good job|love it)\b",
                  re.IGNORECASE)
_TOOL_ERR = re.compile(r"(traceback \(most recent call last\)|\berror\b|\bexception\b|command not found|"
                       r"no such file|permission denied|exit code [1-9]|non-zero exit)", re.IGNORECASE)
_HINT = re.compile(r"\b(please|make it|should|use|instead|shorter|longer|only|always|never|in \w+)\b", re.IGNORECASE)


def _text(messages: list[dict]) -> str:
    return "\n".join(str(m.get("content") or "") for m in messages)


class RuleJudge:
    name = "rules"
    version = f"v1+env{ENVELOPES_VERSION}"  # env: turns judged before envelopes were stripped are judged again

    async def __call__(self, item: JudgeInput) -> Judgment:
        text = _text(item.next_state)
        if item.next_role == "tool":
            vote = -1 if _TOOL_ERR.search(text) else 1
            why = "tool reported an error" if vote < 0 else "tool call succeeded"
            return Judgment(vote, [vote], why, None, self.name, judge_version=self.version)
        neg, pos = _NEG.search(text), _POS.search(text)
        if neg and not (pos and pos.start() < neg.start()):
            vote, why = -1, f"correction cue {neg.group(0)!r}"
        elif pos:
            vote, why = 1, f"approval cue {pos.group(0)!r}"
        else:
            vote, why = 0, "no clear cue"
        hint = text.strip()[:300] if vote < 0 and _HINT.search(text) else None
        return Judgment(majority([vote]), [vote], why, hint, self.name, judge_version=self.version)
