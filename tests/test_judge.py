"""The embedded rule judge and the judge helpers (majority vote, order-preserving concurrent judging)."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from clawflow.config import REPO_ROOT, ConfigError, load_config
from clawflow.judge import JudgeInput, Judgment, RuleJudge, judge_many, majority, make_judge

CONTEXT = [{"role": "user", "content": "Summarize the article in three sentences."}]
TURN = {"role": "assistant", "content": "The article argues that cities should plant more trees. ..."}


def user_reply(text: str) -> JudgeInput:
    return JudgeInput(context=CONTEXT, turn=TURN, next_state=[{"role": "user", "content": text}], next_role="user")


def tool_result(text: str) -> JudgeInput:
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "python run.py"}'}}]}
    return JudgeInput(context=CONTEXT, turn=turn, next_role="tool",
                      next_state=[{"role": "tool", "tool_call_id": "call_1", "content": text}])


def judge(item: JudgeInput) -> Judgment:
    return asyncio.run(RuleJudge()(item))


def test_approval_scores_plus_one():
    j = judge(user_reply("thanks, perfect"))
    assert j.score == 1 and j.votes == [1]
    assert j.hint is None
    assert j.judge == "rules" and j.judge_version == RuleJudge.version and "thanks" in j.rationale


def test_correction_scores_minus_one_with_a_hint():
    text = "No, that's wrong, make it shorter"
    j = judge(user_reply(text))
    assert j.score == -1 and j.votes == [-1]
    assert j.hint == text  # the correction states what was wanted: the hint for OPD
    assert "no" in j.rationale.lower()


def test_correction_without_a_stated_wish_has_no_hint():
    j = judge(user_reply("That is wrong."))
    assert j.score == -1 and j.hint is None


@pytest.mark.parametrize("text", ["What is the capital of France?", "Now list three colors.", ""])
def test_neutral_text_scores_zero(text):
    j = judge(user_reply(text))
    assert j.score == 0 and j.votes == [0] and j.hint is None


def test_tool_error_output_scores_minus_one():
    out = ('Traceback (most recent call last):\n  File "run.py", line 3, in <module>\n'
           "ZeroDivisionError: division by zero")
    j = judge(tool_result(out))
    assert j.score == -1 and j.votes == [-1] and j.hint is None


@pytest.mark.parametrize("out", ["total 8\n-rw-r--r-- 1 root root 12 notes.txt", '{"temperature": 21.5}'])
def test_plain_tool_output_scores_plus_one(out):
    j = judge(tool_result(out))
    assert j.score == 1 and j.votes == [1]


@pytest.mark.parametrize("votes, expected", [
    ([], 0),
    ([None, None], 0),  # no valid vote
    (["yes", 2, 0.5, None], 0),  # invalid values are not votes
    ([1, -1], 0),  # tie
    ([1, -1, 0], 0),  # three-way tie
    ([1, 1, -1], 1),
    ([-1, -1, 1, None], -1),
    ([None, -1], -1),
    ([0, 0, 1], 0),
    ([1], 1),
    ([-1], -1),
    ([1, 1, -1, -1, 0], 0),
    ([1, None, None, None], 1),
])
def test_majority(votes, expected):
    assert majority(votes) == expected


class SlowEcho:
    """A judge whose latency falls with the input index, so answers complete in reverse order."""

    name = "slow-echo"

    def __init__(self, n: int):
        self.n, self.running, self.peak = n, 0, 0

    async def __call__(self, item: JudgeInput) -> Judgment:
        self.running += 1
        self.peak = max(self.peak, self.running)
        index = int(item.next_state[0]["content"])
        await asyncio.sleep(0.002 * (self.n - index))
        self.running -= 1
        return Judgment(1, [1], str(index), None, self.name)


def test_judge_many_preserves_order_and_bounds_concurrency():
    n = 20
    slow = SlowEcho(n)
    items = [user_reply(str(i)) for i in range(n)]
    out = asyncio.run(judge_many(slow, items, concurrency=4))
    assert [j.rationale for j in out] == [str(i) for i in range(n)]
    assert slow.peak == 4

    texts = ["thanks, perfect", "No, that's wrong, make it shorter", "Tell me more about trees."]
    out = asyncio.run(judge_many(RuleJudge(), [user_reply(t) for t in texts]))
    assert [j.score for j in out] == [1, -1, 0]
    assert asyncio.run(judge_many(RuleJudge(), [])) == []


def with_judge(tmp_path, **judge):
    """configs/test.yaml with a different `judge` section, loaded like any config file."""
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["judge"] = judge
    path = tmp_path / "judge.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def test_make_judge_from_config(tmp_path):
    cfg = load_config(REPO_ROOT / "configs" / "test.yaml")
    assert cfg.judge.backend == "rules"
    assert isinstance(make_judge(cfg), RuleJudge)
    # auto: the embedded judge unless an endpoint is configured
    assert load_config(REPO_ROOT / "configs" / "default.yaml").judge.resolved_backend == "embedded"
    llm = with_judge(tmp_path, backend="auto", llm={"base_url": "http://127.0.0.1:9/v1"})
    judge = make_judge(llm)
    assert type(judge).__name__ == "LLMJudge" and judge.prompt_version == "prm_v1+hint_v1"
    assert isinstance(make_judge(llm, "rules"), RuleJudge)
    with pytest.raises(ValueError, match="unknown judge backend 'oracle'"):
        make_judge(llm, "oracle")


def test_judge_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="judge: .*needs judge.llm.base_url"):
        with_judge(tmp_path, backend="llm")
    with pytest.raises(ConfigError, match="judge.votes"):
        with_judge(tmp_path, votes=0)
