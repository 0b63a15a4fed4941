"""From catalog pairs to a training batch: judge each turn by its next state, keep the signal.

Judgments are stored (`$CLAWFLOW_HOME/judgments/`) and reused: a turn is judged once per judge
version. A turn the judge could not answer gets no judgment, is not trained on or consumed, and is
judged again on the next run. Pure library logic; the `train-on-new-feedback` flow calls it
through thin tasks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from clawflow.contracts.judgment import Judged, JudgmentRow
from clawflow.contracts.pair import Pair
from clawflow.contracts.sample import Sample
from clawflow.home import Home
from clawflow.judge import Judge, JudgeInput, Judgment, judge_many
from clawflow.judge.stats import combine_reward
from clawflow.judge.store import JudgmentStore
from clawflow.store.storage import ObjectExists, Storage

log = logging.getLogger("clawflow.feedback")


def judge_input(pair: Pair) -> JudgeInput:
    turn = {"role": "assistant", "content": pair.response_text}
    if pair.tool_calls:
        turn["tool_calls"] = json.loads(pair.tool_calls)
    return JudgeInput(
        context=json.loads(pair.messages),
        turn=turn,
        next_state=json.loads(pair.next_state or "[]"),
        next_role=pair.next_role or "user",
    )


def judgment_row(pair: Pair, j: Judgment) -> JudgmentRow:
    """A judgment as the store's row."""
    return JudgmentRow(turn_id=pair.turn_id, session_id=pair.session_id, judge=j.judge, judge_version=j.judge_version,
                       prompt_version=j.prompt_version, score=j.score, votes=list(j.votes), rationale=j.rationale,
                       hint=j.hint)


def judge_pairs(judge: Judge, pairs: Sequence[Pair], concurrency: int = 8,
                store: JudgmentStore | None = None,
                combine: Callable[[int, float | None], float] = combine_reward) -> list[Judged]:
    """Judgments for the pairs the judge answered, in pair order; unjudged pairs are left out.

    Each carries the stored row plus `reward` (score combined with the turn's `env_reward`) and
    `reused` (found in the store for this judge version instead of asked again)."""
    stored = store.lookup([p.turn_id for p in pairs], judge.name, judge.version) if store else {}
    todo = [p for p in pairs if p.turn_id not in stored]
    fresh = asyncio.run(judge_many(judge, [judge_input(p) for p in todo], concurrency)) if todo else []
    rows = [judgment_row(p, j) for p, j in zip(todo, fresh) if j is not None]
    if store:
        store.append(rows)
    by_id = {t: (r, True) for t, r in stored.items()} | {r.turn_id: (r, False) for r in rows}
    return [Judged.of(row, combine(row.score, p.env_reward), reused)
            for p in pairs if p.turn_id in by_id for row, reused in [by_id[p.turn_id]]]


def training_samples(pairs: Sequence[Pair], judgments: Sequence[Judged]) -> list[Sample]:
    """Judged turns with a non-zero reward (binary RL) or a hint (OPD) become samples, and every
    member of a group whose rewards differ (a zero is below or above its siblings: GRPO needs the
    whole group); unjudged turns wait for a later run."""
    by_id = {j.turn_id: j for j in judgments}
    group_rewards: dict[str, set[float]] = {}
    for p in pairs:
        if p.group_id and p.turn_id in by_id:
            group_rewards.setdefault(p.group_id, set()).add(float(by_id[p.turn_id].reward))
    out = []
    for p in pairs:
        j = by_id.get(p.turn_id)
        if j is None:
            continue
        varied = len(group_rewards.get(p.group_id or "", ())) > 1
        if (j.reward != 0 or j.hint or varied) and len(p.response_token_ids) > 0:
            out.append(Sample(turn_id=p.turn_id, prompt_token_ids=list(p.prompt_token_ids),
                              response_token_ids=list(p.response_token_ids),
                              response_logprobs=[float(x) for x in p.response_logprobs], reward=float(j.reward),
                              hint=j.hint, messages=json.loads(p.messages) if p.messages else None,
                              tools=json.loads(p.tools) if p.tools else None, group_id=p.group_id,
                              policy_version=int(p.policy_version or 0)))
    return out


def keep_samples(storage: Storage, run_id: str, path: Path) -> str | None:
    """On an object-store root, a copy of a run's samples file at `runs/<run_id>/samples.parquet`
    beside the shards it came from: what each run trained on outlives the trainer host (the
    trainer reads its local copy). None on a local root, where `path` is already the record."""
    if not storage.remote:
        return None
    try:
        return storage.put_bytes(Path(path).read_bytes(), Home.samples_rel(run_id))
    except ObjectExists:  # a retried run whose samples came out different: the first record stays
        log.warning("%s already exists with other contents; kept", Home.samples_rel(run_id))
        return None
