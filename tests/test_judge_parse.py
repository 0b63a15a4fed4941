"""Judge building blocks without a model or a server: prompts, boxed parsing on recorded judge
outputs, hint extraction and selection, the labelled set, the judgment store, reward and stats."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawflow.config import REPO_ROOT
from clawflow.judge import JudgeInput, majority
from clawflow.judge.dataset import DatasetError, load_labelled, split_of
from clawflow.judge.features import clauses, cue_flags
from clawflow.judge.hints import extract_hint as hint_from_user
from clawflow.judge.parse import extract_hint, parse_boxed, rationale, select_hint
from clawflow.judge.prompts import load_prompt, render
from clawflow.contracts.judgment import Judged
from clawflow.judge.stats import combine_reward, judge_stats
from clawflow.judge.store import COLUMNS, JudgmentStore

LABELLED = REPO_ROOT / "configs" / "judge" / "labelled.jsonl"

ITEM = JudgeInput(
    context=[{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Run the tests."}],
    turn={"role": "assistant", "content": "Running them now.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "pytest -q"}'}}]},
    next_state=[{"role": "tool", "tool_call_id": "c1", "content": "1 failed, 7 passed in 0.84s"}],
    next_role="tool")


# --- prompts ---------------------------------------------------------------------------------

def test_prm_prompt_renders_request_turn_tool_calls_and_next_state():
    text = render(load_prompt("prm_v1"), ITEM)
    assert "[user] Run the tests." in text and "[system] You are helpful." in text
    assert "[assistant] Running them now." in text
    assert '[assistant calls tool] shell({"cmd": "pytest -q"})' in text
    assert "(role: tool)" in text and "[tool] 1 failed, 7 passed in 0.84s" in text
    assert "\\boxed{1}, \\boxed{-1} or \\boxed{0}" in text  # the answer format survives templating
    assert "$" not in text.replace("$100", "")  # every placeholder filled


def test_prompt_options_hide_the_request_and_keep_the_last_messages():
    hidden = render(load_prompt("prm_v1"), ITEM, include_request=False)
    assert "Run the tests." not in hidden and "(not shown)" in hidden
    last_one = render(load_prompt("prm_v1"), ITEM, context_messages=1)
    assert "Run the tests." in last_one and "You are helpful." not in last_one


def test_long_messages_are_clipped_in_the_middle():
    long = JudgeInput(ITEM.context, {"role": "assistant", "content": "A" * 3000 + "END"}, ITEM.next_state, "tool")
    text = render(load_prompt("prm_v1"), long)
    assert "characters cut" in text and "END" in text and "A" * 1500 not in text


def test_hint_prompt_asks_for_markers_and_unknown_prompts_fail_clearly():
    text = render(load_prompt("hint_v1"), ITEM)
    assert "[HINT_START]" in text and "[HINT_END]" in text and "[tool] 1 failed" in text
    with pytest.raises(ValueError, match="no judge prompt named 'prm_v9'"):
        load_prompt("prm_v9")
    with pytest.raises(ValueError):
        load_prompt("../config")


# --- boxed parsing on recorded, realistic judge outputs --------------------------------------

RECORDED = [
    (("The user thanks the assistant and says they are sending the email, so the turn achieved its goal.\n\n"
     "\\boxed{1}"), 1),
    (("The tool result is a ModuleNotFoundError: the script could not run, so the call did not make progress.\n"
     "Final answer: \\boxed{-1}"), -1),
    (("<think>\nThe user asks about daylight saving time, unrelated to the recipe.\n</think>\n"
     "The next state says nothing about the recipe's quality. \\boxed{0}"), 0),
    (("At first glance the reply could look fine (\\boxed{1}), but the user is sarcastic: \"Great math\". "
     "So the final score is \\boxed{-1}."), -1),
    ("The answer is $\\boxed{+1}$ because the user accepted the booking.", 1),
    ("Score: \\boxed{ −1 }", -1),  # a Unicode minus, spaces
    ("The user says 'no' which could indicate that the", None),  # cut off by max_tokens: no box
    ("\\boxed{-1} ... wait, on reflection it's unclear: \\boxed{maybe}", None),  # the LAST box counts
    ("\\boxed{\\text{-1}}", None),  # nested LaTeX
    ("\\boxed{2}", None), ("\\boxed{1.0}", None), ("\\boxed{}", None), ("\\boxed{1", None),
    ("boxed{1}", None), ("", None), (None, None), ("\\boxed{-0}", 0), ("\\\\boxed{1}", 1),
    ("lorem ipsum dolor sit amet 42 -1 +1", None),
]


@pytest.mark.parametrize("text, expected", RECORDED)
def test_parse_boxed(text, expected):
    assert parse_boxed(text) == expected


def test_votes_from_recorded_outputs_go_through_the_majority():
    votes = [parse_boxed(t) for t, _ in RECORDED[:3]]
    assert votes == [1, -1, 0] and majority(votes) == 0  # three-way tie
    assert majority([parse_boxed(t) for t in ("\\boxed{-1}", "\\boxed{-1}", "no box")]) == -1
    assert majority([parse_boxed(t) for t in ("garbage", "\\boxed{7}", "")]) == 0  # all invalid
    assert majority([True, True, -1]) == -1  # a bool is not a vote


def test_rationale_is_the_text_before_the_last_box():
    assert rationale(RECORDED[0][0]) == ("The user thanks the assistant and says they are sending the email, "
                                         "so the turn achieved its goal.")
    assert rationale("x" * 500 + " \\boxed{1}").startswith("…") and len(rationale("x" * 500)) == 301


# --- hints -----------------------------------------------------------------------------------

HINT_REPLIES = [
    ("The user wanted Spanish, not French.\n[HINT_START]Translate into Spanish: the user asked for Spanish, "
    "not French.[HINT_END]\n\\boxed{1}"),
    "[HINT_START]  Answer   in Spanish. [HINT_END] \\boxed{1}",
    "[HINT_START]Be better.[HINT_END] \\boxed{1}",
    "Nothing actionable. \\boxed{-1}",
    "[HINT_START]Keep it short.[HINT_END] \\boxed{-1}",  # a hint, but the model boxed "no hint"
    "[HINT_START]unterminated \\boxed{1}",
]


def test_extract_hint_from_recorded_outputs():
    got = [extract_hint(t) for t in HINT_REPLIES]
    assert got == ["Translate into Spanish: the user asked for Spanish, not French.", "Answer in Spanish.",
                   "Be better.", None, None, None]


def test_select_hint_takes_the_longest_valid_over_the_minimum():
    got = [extract_hint(t) for t in HINT_REPLIES]
    assert select_hint(got, min_chars=20) == got[0]
    assert select_hint([got[1], got[2]], min_chars=20) is None  # both under the floor
    assert select_hint([got[1], got[2]], min_chars=5) == "Answer in Spanish."
    assert select_hint([None, None]) is None and select_hint([]) is None
    assert select_hint(["a" * 25, "b" * 25]) == "a" * 25  # first among equals


@pytest.mark.parametrize("text, hint", [
    ("No! Two people, Friday. Please fix it.", "Two people, Friday. Please fix it."),
    ("I said quick. I have 20 minutes.", "I said quick. I have 20 minutes."),
    ("Next time keep it to two sentences, this is a novel.", "Next time keep it to two sentences, this is a novel."),
    ("I prefer learning with books, not apps.", "I prefer learning with books, not apps."),
    ("nope, use the csv crate instead", "Use the csv crate instead"),
    ("thanks, perfect", None), ("no", None), ("What's the weather in Oslo?", None), ("", None),
    # persona-style corrections: comparatives, "too …", requests, limits; the next request is cut off
    ("Shorter please: 30 words at most. Next one: Why is the sky blue?", "Shorter please: 30 words at most."),
    ("Too wordy, I don't have time for all that.", "Too wordy, I don't have time for all that."),
    ("Hmm, this is a lot to read.", "This is a lot to read."),
    ("Can you be briefer? Now, how do I sleep better?", "Can you be briefer?"),
    ("Perfect, thanks. Next one: Please explain DNS.", None), ("Too bad it rained, thanks anyway.", None),
])
def test_embedded_hint_extraction_from_corrections(text, hint):
    assert hint_from_user(text, min_chars=10) == hint


def test_clauses_and_cues():
    assert clauses("Love it but I'm a PM. Fix the title please.") == [
        "Love it but I'm a PM. Fix the title please.", "Love it but I'm a PM.", "Fix the title please."]
    assert clauses("") == [""]
    assert cue_flags("tool", "Traceback (most recent call last):\nKeyError: 'x'")[0] == 1.0
    assert cue_flags("tool", "All checks passed!")[:3] == [0.0, 0.0, 1.0]  # error, structured failure, success
    assert cue_flags("tool", "3 packets transmitted, 3 received, 0% packet loss")[:3] == [0.0, 0.0, 1.0]
    assert cue_flags("tool", '{"confirmed": false, "reason": "full"}')[1] == 1.0
    assert cue_flags("tool", '{"total": 0, "items": []}')[3] == 1.0  # an empty result
    assert cue_flags("user", "we haven't decided yet")[:2] == [0.0, 1.0]  # negation, not a correction
    assert cue_flags("user", "No, that's wrong")[:2] == [1.0, 0.0]
    assert cue_flags("tool", "")[-1] == 1.0  # no output at all


# --- the labelled set --------------------------------------------------------------------------

def test_shipped_labelled_set_is_big_varied_and_split_before_tuning():
    items = load_labelled(LABELLED)
    assert len(items) >= 200 and len({i.id for i in items}) == len(items)
    labels = {lab: sum(i.label == lab for i in items) for lab in (-1, 0, 1)}
    roles = {r: sum(i.input.next_role == r for i in items) for r in ("user", "tool")}
    assert min(labels.values()) >= 40 and min(roles.values()) >= 50
    assert sum(bool(i.hint) for i in items) >= 40
    assert sum(bool(i.input.turn.get("tool_calls")) for i in items) == roles["tool"]
    test = load_labelled(LABELLED, "test")
    assert 0.2 < len(test) / len(items) < 0.4 and {i.split for i in test} == {"test"}
    assert len(load_labelled(LABELLED, "train")) + len(test) == len(items)
    assert split_of("pa-001") == split_of("pa-001") and {split_of(f"x{i}") for i in range(50)} == {"train", "test"}


@pytest.mark.parametrize("line, message", [
    ("not json", "Expecting value"),
    ('{"context": [], "reply": "x", "next_state": {"role": "user", "content": "ok"}}', "missing field(s): label"),
    ('{"context": [], "reply": "x", "next_state": {"role": "bot", "content": "ok"}, "label": 1}', "next_state must be"),
    ('{"context": [], "reply": "x", "next_state": {"role": "user", "content": "ok"}, "label": 2}', "label must be"),
    ('{"context": "hi", "reply": "x", "next_state": {"role": "user", "content": "ok"}, "label": 1}', "context must"),
])
def test_bad_labelled_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "set.jsonl"
    good = json.dumps({"context": [], "reply": "x", "next_state": {"role": "user", "content": "ok"}, "label": 0})
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(DatasetError, match=f"set.jsonl:3: .*{message}".replace("(", r"\(").replace(")", r"\)")):
        load_labelled(path)


# --- storage, reward, stats --------------------------------------------------------------------

def test_store_writes_exact_columns_and_looks_up_per_judge_version(tmp_path):
    store = JudgmentStore(tmp_path)
    assert store.lookup(["t1"], "llm", "v1") == {}  # no directory yet
    base = {"session_id": "s", "judge": "llm", "prompt_version": "prm_v1+hint_v1", "rationale": "r", "hint": None}
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    store.append([{**base, "turn_id": "t1", "judge_version": "v1", "score": -1, "votes": [-1, None, -1],
                   "hint": "Be brief.", "created_at": t0},
                  {**base, "turn_id": "t2", "judge_version": "v1", "score": 0, "votes": [None, None, None]}])
    store.append([{**base, "turn_id": "t1", "judge_version": "v1", "score": 1, "votes": [1, 1, 1],
                   "created_at": t0 + timedelta(hours=1)},
                  {**base, "turn_id": "t1", "judge_version": "v2", "score": 0, "votes": [0]}])
    assert store.append([]) is None and len(store.files()) == 2
    table = pq.read_table(store.files()[0])
    assert table.schema.names == COLUMNS == ["turn_id", "session_id", "judge", "judge_version", "prompt_version",
                                             "score", "votes", "rationale", "hint", "created_at"]
    votes_type = table.schema.field("votes").type
    assert table.schema.field("score").type == pa.int8() and votes_type.value_type == pa.int8()
    assert table.column("votes").to_pylist() == [[-1, None, -1], [None, None, None]]
    got = store.lookup(["t1", "t2", "t3"], "llm", "v1")
    assert set(got) == {"t1", "t2"} and got["t1"].score == 1 and got["t1"].votes == [1, 1, 1]  # latest wins
    assert store.lookup(["t1"], "llm", "v2")["t1"].score == 0 and store.lookup(["t1"], "rules", "v1") == {}
    assert not list(store.dir.glob(".*.tmp"))


@pytest.mark.parametrize("score, env, mode, weight, expected", [
    (1, None, "add", 1.0, 1.0), (-1, 1.0, "add", 1.0, 0.0), (1, 1.0, "add", 0.5, 1.5), (0, -1.0, "add", 1.0, -1.0),
    (1, -1.0, "replace", 1.0, -1.0), (1, None, "replace", 1.0, 1.0), (-1, 1.0, "ignore", 1.0, -1.0),
    (1, float("nan"), "add", 1.0, 1.0),
])
def test_combine_reward(score, env, mode, weight, expected):
    assert combine_reward(score, env, mode, weight) == expected


def test_combine_reward_rejects_unknown_modes():
    with pytest.raises(ValueError):
        combine_reward(1, 1.0, "multiply")


def test_judge_stats():
    def judged(score, votes, hint=None, reused=False):
        return Judged(turn_id="t", session_id=None, judge="llm", judge_version="1", prompt_version=None, score=score,
                      votes=votes, hint=hint, reward=float(score), reused=reused)

    js = [judged(1, [1, 1, None], reused=True), judged(-1, [-1, -1, 1], "Be brief and concrete."),
          judged(0, [None, None, None]), judged(0, [1, -1, 0])]
    s = judge_stats(js, pending=5)
    assert s["judge_turns"] == 4 and s["judge_unjudged"] == 1 and s["judge_reused"] == 1
    assert (s["judge_score_pos_rate"], s["judge_score_neg_rate"], s["judge_score_zero_rate"]) == (0.25, 0.25, 0.5)
    assert s["judge_invalid_vote_rate"] == pytest.approx(4 / 12)
    assert s["judge_vote_agreement"] == pytest.approx((1 + 2 / 3 + 1 / 3) / 3)
    assert s["judge_hint_rate"] == 0.25
    assert judge_stats([], pending=3)["judge_unjudged"] == 3
