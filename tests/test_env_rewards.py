"""Outcome rewards reach training: an episode's env_reward rows (Parquet beside the turns) join
onto the catalog's pairs in DuckDB and into the reward the trainer uses (judge score + outcome).

The policy's replies are scripted here (a tiny random model never calls a tool); the episode is
the real TerminalEnv in a real sandbox, the turns go through the real WAL and sealer into
Parquet shards, and the pairs come from the real catalog query."""

from __future__ import annotations

import dataclasses
import json
import random
from functools import partial

import pytest

from clawflow.config import EnvConfig
from clawflow.envs.base import _reward_row
from clawflow.envs.rewards import write_env_rewards
from clawflow.envs.terminal import TerminalEnv, load_tasks
from clawflow.feedback import judge_pairs, training_samples
from clawflow.judge import RuleJudge
from clawflow.judge.stats import combine_reward
from clawflow.store.catalog import Catalog
from clawflow.contracts.turn import TurnRecord
from clawflow.store.sealer import Sealer
from clawflow.store.wal import SegmentWriter
from _store_helpers import pending_pairs


@pytest.fixture(autouse=True)
def _no_prefect(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def record(session: str, index: int, messages: list[dict], reply: dict, new: list[dict], **kw) -> TurnRecord:
    """The turn as the gateway records it (token ids are placeholders: only text matters here)."""
    return TurnRecord(session_id=session, turn_index=index, policy_version=0, messages=list(messages),
                      prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5, 6], response_logprobs=[-0.1] * 3,
                      response_text=reply.get("content") or "", finish_reason="stop", new_messages=new,
                      tool_calls=reply.get("tool_calls"), source=kw.pop("source", "terminal"), **kw)


def seal(home, records: list[TurnRecord]) -> Catalog:
    writer = SegmentWriter(home / "wal", fsync=False)
    for rec in records:
        writer.append(rec)
    writer.rotate()
    Sealer(writer, home / "shards", interval_s=1).seal_all()
    return Catalog(home / "catalog.duckdb", home / "shards", home=home)


def test_terminal_outcome_reaches_pair_and_combined_reward(tmp_path):
    home = tmp_path / "home"
    env = TerminalEnv([t for t in load_tasks() if t.name == "sort-names"], EnvConfig())
    rng = random.Random(0)
    ep = env.start(rng)
    session = "terminal-e2e"
    call = {"id": "c1", "type": "function",
            "function": {"name": "run_shell", "arguments": json.dumps({"command": "sort names.txt > sorted.txt"})}}
    replies = [{"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "assistant", "content": "Done: sorted.txt has the names in order."}]
    records, new = [], list(ep.messages)
    for i, reply in enumerate(replies):  # the runner's loop, with the policy's replies scripted
        records.append(record(session, i, ep.messages, reply, new, session_done=i == 1))
        ep.messages.append(reply)
        step = env.step(ep, reply, rng)
        ep.messages.extend(step.messages)
        new = step.messages
    assert json.loads(records[0].tool_calls[0]["function"]["arguments"])["command"].startswith("sort")
    outcome = env.outcome(ep)
    env.close(ep)
    assert outcome == 1.0  # the real check on the real sandbox
    write_env_rewards(home, [_reward_row(env, session, 1, replies[1], outcome)])
    cat = seal(home, records)

    [pair] = pending_pairs(cat, 10)  # turn 0 (the tool call), paired with the tool result
    assert pair.turn_index == 0 and pair.next_role == "tool" and "[exit code 0]" in pair.next_state
    assert pair.env_reward == 1.0  # the episode's outcome, joined from env_rewards/*.parquet
    [closed] = cat.closed_without_next_state(idle_s=3600)
    assert closed.turn_index == 1 and closed.env_reward == 1.0

    [j] = judge_pairs(RuleJudge(), [pair], combine=partial(combine_reward, mode="add", weight=0.5))
    assert j.score == 1 and j.reward == 1.5  # tool succeeded (+1) + 0.5 x outcome
    [j] = judge_pairs(RuleJudge(), [pair], combine=partial(combine_reward, mode="replace"))
    assert j.reward == 1.0
    [sample] = training_samples([pair], [j])
    assert sample.reward == 1.0


def test_group_members_get_their_own_reward_and_stay_in_the_batch(tmp_path):
    home = tmp_path / "home"
    session, prompt = "persona-g", [{"role": "user", "content": "Why is the sky blue?"}]
    texts = ["Rayleigh scattering.", "word " * 40, "Blue light scatters more."]
    feedback = [{"role": "user", "content": "Perfect, thanks. Next one: Explain compound interest simply."}]
    records = [record(session, 0, prompt, {"content": t}, prompt, source="persona", group_id="g1") for t in texts]
    records.append(record(session, 1, prompt + [{"role": "assistant", "content": texts[0]}] + feedback,
                          {"content": "Interest on interest."}, feedback, source="persona", session_done=True))
    rows = [{"session_id": session, "turn_index": 0, "response_text": t, "env_reward": float(len(t) < 60),
             "source": "persona"} for t in texts]
    rows.append({"session_id": session, "turn_index": 1, "response_text": "Interest on interest.",
                 "env_reward": 0.5, "source": "persona"})  # the episode outcome: not a group member's
    write_env_rewards(home, rows[:2])
    write_env_rewards(home, rows[2:])  # several files are read together
    cat = seal(home, records)

    pairs = pending_pairs(cat, 10)
    assert sorted((p.response_text, p.env_reward) for p in pairs) == sorted(
        [(texts[0], 1.0), (texts[1], 0.0), (texts[2], 1.0)])
    judgments = judge_pairs(RuleJudge(), pairs)  # "Perfect, thanks" → +1 for every member
    by_text = {p.response_text: j.reward for p, j in zip(pairs, judgments)}
    assert by_text == {texts[0]: 2.0, texts[1]: 1.0, texts[2]: 2.0}
    # A member whose combined reward is 0 still trains: it is below its siblings.
    judgments = judge_pairs(RuleJudge(), pairs, combine=lambda s, e: float(e))
    assert len(training_samples(pairs, judgments)) == 3
    same = [dataclasses.replace(j, reward=0.0, hint=None) for j in judgments]  # no signal at all: nothing trains
    assert training_samples(pairs, same) == []
