"""Agents' envelopes are metadata, not words: the normalizer on OpenClaw's exact format, and every
reader of the user's words (judge backends, hints, session inference) reading normalized text."""

from __future__ import annotations

import asyncio

import pytest

from clawflow.config import REPO_ROOT, JudgeConfig
from clawflow.envelopes import normalize_message, normalize_messages, normalize_text, strip_openclaw
from clawflow.judge import JudgeInput, RuleJudge, judge_many
from clawflow.judge.dataset import load_labelled
from clawflow.judge.prompts import load_prompt, render
from clawflow.serving.sessions import history_key

# As openclaw 2026.9.6 (`agent --local`) sent them to a capturing server: the first user message
# carries the timestamp and the runtime line relocated from the system prompt; later ones only
# their own timestamp.
RUNTIME = ("Runtime: agent=main | session=agent:main:explicit:s1 | sessionId=s1 | host=vm | "
           "repo=/tmp/occap/home/.openclaw/workspace | os=Linux 6.18.44-fc-v1147 (x64) | node=v24.22.3 | "
           "active_node=unknown | model=clawflow/smollm2-135m-instruct | "
           "default_model=clawflow/smollm2-135m-instruct | shell=bash")
FIRST = f"[Fri 2026-12-04 04:11 UTC] What is the capital of France?\n\n{RUNTIME}"
LATER = "[Fri 2026-12-04 04:12 UTC] No, that's wrong. The capital of France is Paris. Just say Paris."


def wrap(text: str, first: bool = False, stamp: str = "Fri 2026-12-04 00:11 UTC") -> str:
    return f"[{stamp}] {text}" + (f"\n\n{RUNTIME}" if first else "")


def test_openclaw_envelope_is_stripped_exactly():
    assert strip_openclaw(FIRST) == normalize_text(FIRST) == "What is the capital of France?"
    assert normalize_text(LATER) == "No, that's wrong. The capital of France is Paris. Just say Paris."
    # the user's timezone (short Intl names), seconds, a named agent, a multi-line message
    assert normalize_text("[Mon 2026-01-05 09:30 EST] hi") == "hi"
    assert normalize_text("[Sun 2026-01-04 18:02:07 GMT+5:30] hi") == "hi"
    assert normalize_text("[Tue 2026-01-06 10:00] hi") == "hi"
    assert normalize_text(f"[Fri 2026-12-04 00:11 UTC] a\n\nb\n\nRuntime: name=Claw | {RUNTIME[9:]}") == "a\n\nb"
    # content parts joined by the gateway: the runtime line arrives without its blank line
    assert normalize_text(f"[Fri 2026-12-04 00:11 UTC] Too long.{RUNTIME}") == "Too long."


@pytest.mark.parametrize("text", [
    "What is the capital of France?",
    "Runtime: 3 s. Can it be faster?",  # the user's own words
    "The log says\n\nRuntime: 42 ms",
    "Meeting [Fri 2026-12-04 00:11 UTC] moved",  # a stamp that does not start the message
    "[Fri 2026-12-04] no time, not OpenClaw's",
    "[x] done\n[ ] todo",
    "",
])
def test_text_without_an_envelope_is_unchanged(text):
    assert normalize_text(text) == text


def test_messages_only_user_text_is_normalized_and_inputs_are_not_mutated():
    msgs = [{"role": "system", "content": RUNTIME}, {"role": "user", "content": FIRST},
            {"role": "assistant", "content": "[Fri 2026-12-04 04:11 UTC] Paris."},
            {"role": "user", "content": [{"type": "text", "text": LATER}, {"type": "image_url", "image_url": {}}]},
            {"role": "tool", "content": f"ok\n\n{RUNTIME}", "tool_call_id": "c"}]
    before = [dict(m) for m in msgs]
    out = normalize_messages(msgs)
    assert msgs == before  # reading never changes what was received (the recorded turn)
    assert out[0] is msgs[0] and out[2] is msgs[2] and out[4] is msgs[4]
    assert out[1] == {"role": "user", "content": "What is the capital of France?"}
    assert out[3]["content"][0]["text"].startswith("No, that's wrong.")
    assert out[3]["content"][1] == msgs[3]["content"][1]
    assert normalize_message({"role": "user", "content": "plain"}) == {"role": "user", "content": "plain"}


def test_every_judge_backend_reads_normalized_text():
    item = JudgeInput(context=[{"role": "user", "content": FIRST}],
                      turn={"role": "assistant", "content": "The capital of France is Lyon."},
                      next_state=[{"role": "user", "content": LATER}], next_role="user")
    assert item.context == [{"role": "user", "content": "What is the capital of France?"}]
    assert item.next_state[0]["content"].startswith("No, that's wrong.")
    prompt = render(load_prompt("prm_v1"), item)  # what the LLM judge sends
    assert "Runtime:" not in prompt and "UTC]" not in prompt
    terse = "Too long. Keep answers under two sentences from now on, please."
    judgment = asyncio.run(RuleJudge()(JudgeInput(item.context, item.turn, [
        {"role": "user", "content": wrap(terse, first=True)}], "user")))
    assert judgment.score == -1 and judgment.hint == terse


def test_session_inference_ignores_a_changed_envelope():
    """OpenClaw re-sends the first message with its runtime line every turn; if that line changes
    (another model, another host) the conversation is still the same one."""
    reply = {"role": "assistant", "content": "Lyon."}
    a = [{"role": "user", "content": FIRST}, reply]
    b = [{"role": "user", "content": FIRST.replace("host=vm", "host=laptop")}, reply]
    c = [{"role": "user", "content": "What is the capital of Spain?"}, reply]
    assert history_key(a) == history_key(b) != history_key(c)


@pytest.mark.slow
def test_embedded_judge_scores_and_hints_identically_with_and_without_the_envelope():
    """The labelled corrections (next state: the user's message, label −1; the held-out split, to
    keep the suite fast), judged plain and as OpenClaw wraps them: the correction with its
    timestamp, the request as a first message."""
    from clawflow.judge.embedded import EmbeddedJudge

    items = [i for i in load_labelled(REPO_ROOT / "configs" / "judge" / "labelled.jsonl", "test")
             if i.input.next_role == "user" and i.label == -1]
    assert len(items) > 90
    plain = [i.input for i in items]
    wrapped = [JudgeInput(context=[{**m, "content": wrap(m["content"], first=k == 0)} if m["role"] == "user" else m
                                   for k, m in enumerate(i.context)],
                          turn=i.turn, next_state=[{**i.next_state[0], "content": wrap(i.next_state[0]["content"])}],
                          next_role="user") for i in plain]
    judge = EmbeddedJudge(JudgeConfig())
    a, b = asyncio.run(judge_many(judge, plain)), asyncio.run(judge_many(judge, wrapped))
    assert [(j.score, j.hint) for j in a] == [(j.score, j.hint) for j in b]
    hints = [j.hint for j in b if j.hint]
    assert len(hints) > 30 and not any("UTC]" in h or "Runtime:" in h for h in hints)
    assert sum(j.score == -1 for j in b) > 0.7 * len(b)  # they are corrections: the judge sees them as such
