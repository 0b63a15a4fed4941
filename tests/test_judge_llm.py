"""The LLM judge against real OpenAI-compatible servers: clawflow's own gateway with the tiny
model (transport; its random text is never a valid vote), and a small judge server that fails,
stalls, refuses or answers like a judge model (retries, backoff, budget, failure)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import free_port, running_gateway
from judge_server import judge_app, serving

from clawflow.config import JudgeConfig
from clawflow.judge import JudgeInput, JudgeUnavailable, judge_many
from clawflow.judge.llm import LLMJudge


def item(reply_to: str) -> JudgeInput:
    return JudgeInput(context=[{"role": "user", "content": "Translate 'where is the station' into Spanish."}],
                      turn={"role": "assistant", "content": "Où est la gare ?"},
                      next_state=[{"role": "user", "content": reply_to}], next_role="user")


def llm_judge(base_url: str, **llm) -> LLMJudge:
    extra = {k: llm.pop(k) for k in ("votes", "hints") if k in llm}
    return LLMJudge(JudgeConfig(backend="llm", **extra,
                                llm={"base_url": base_url, "backoff_s": 0.01, "model": "judge-model", **llm}))


def run(judge, items, concurrency=8):
    return asyncio.run(judge_many(judge, items, concurrency))


def test_over_clawflow_gateway_random_text_is_invalid_votes_scored_zero(make_config):
    cfg = make_config()
    with running_gateway(cfg):
        judge = llm_judge(f"{cfg.gateway_url}/internal/v1", api_key=cfg.serving.admin_key, model="clawflow-tiny",
                          max_tokens=6, temperature=1.0, votes=3, hints="always")
        j = asyncio.run(judge(item("No, that's French.")))
        assert (j.votes, j.score, j.hint) == ([None] * 3, 0, None)
        assert j.rationale == "no valid vote" and j.prompt_version == "prm_v1+hint_v1"
        assert judge.requests == 6 and judge.retries == 0  # 3 PRM votes + 3 hint votes
        metrics = httpx.get(f"{cfg.gateway_url}/metrics").text
        assert "clawflow_unrecorded_requests_total 6" in metrics  # judge calls never become training data
        assert "clawflow_turns_recorded_total 0" in metrics


@pytest.mark.parametrize("status, headers", [(500, None), (503, None), (429, {"Retry-After": "0.05"})])
def test_fails_twice_then_answers_with_retries(status, headers):
    with serving(judge_app(fail_first=2, status=status, headers=headers), free_port()) as url:
        judge = llm_judge(url, votes=1, api_key="sk-judge")
        j = asyncio.run(judge(item("No, that's French. I asked for Spanish.")))
    assert (j.score, j.votes) == (-1, [-1])
    assert j.hint == "Translate into Spanish, the language the user asked for, not French."
    assert j.rationale == "The user corrects the assistant: the turn was wrong and has to be redone."
    assert judge.retries == 2 and judge.requests == 4 and judge.tokens == 680  # 2 failures, PRM, hint
    assert j.judge == "llm" and j.judge_version == judge.version and j.extra == {"hint_votes": 1}


def test_a_stalled_request_times_out_and_is_retried():
    app = judge_app(stall_first=1, stall_s=2.0)
    with serving(app, free_port()) as url:
        judge = llm_judge(url, votes=1, hints="off", timeout_s=0.3)
        start = time.monotonic()
        j = asyncio.run(judge(item("thanks!")))
        elapsed = time.monotonic() - start
    assert (j.score, judge.retries) == (1, 1) and elapsed < 2.0  # did not wait for the stalled answer
    assert app.state.auth[-1] is None  # no key configured → no Authorization header


def test_votes_are_majority_voted():
    with serving(judge_app(), free_port()) as url:
        judge = llm_judge(url, votes=5, hints="off", api_key="sk-judge")
        j = asyncio.run(judge(item("thanks, perfect")))
    assert j.votes == [1] * 5 and j.score == 1 and j.hint is None and judge.requests == 5


def test_malformed_200_answers_are_invalid_votes_not_crashes():
    with serving(judge_app(garbage=True), free_port()) as url:
        j = asyncio.run(llm_judge(url, votes=3)(item("No, wrong.")))
    assert (j.votes, j.score, j.hint) == ([None] * 3, 0, None)


def test_client_errors_are_not_retried():
    app = judge_app(fail_first=10, status=401)
    with serving(app, free_port()) as url:
        judge = llm_judge(url, votes=1, max_retries=4)
        with pytest.raises(JudgeUnavailable, match="refused the request .*HTTP 401"):
            asyncio.run(judge(item("thanks")))
    assert app.state.calls == 1


def test_request_and_token_budgets_leave_the_rest_unjudged():
    items = [item("thanks")] * 5
    with serving(judge_app(), free_port()) as url:
        by_requests = llm_judge(url, votes=1, hints="off", budget_requests=3)
        out = run(by_requests, items)
        assert [j is not None for j in out] == [True, True, True, False, False] and by_requests.requests == 3
        by_tokens = llm_judge(url, votes=1, hints="off", budget_tokens=700)  # 340 tokens a call
        out = run(by_tokens, items, concurrency=1)
        assert [j is not None for j in out] == [True, True, True, False, False] and by_tokens.tokens == 1020
        with pytest.raises(JudgeUnavailable, match="budget spent"):
            asyncio.run(by_tokens(item("thanks")))


def test_endpoint_down_leaves_turns_unjudged_and_fails_fast():
    judge = llm_judge(f"http://127.0.0.1:{free_port()}/v1", votes=1, max_retries=2)
    start = time.monotonic()
    out = run(judge, [item("thanks")] * 4, concurrency=1)
    assert out == [None] * 4  # never a fake score
    assert judge.requests == 3 and judge.retries == 2  # one turn's attempts, then the breaker
    assert "ConnectError" in judge.down and time.monotonic() - start < 5
    with pytest.raises(JudgeUnavailable, match="down this run"):
        asyncio.run(judge(item("thanks")))
    assert judge.requests == 3
