"""Standing preferences (clawflow/prefs): which hints become one, merging, superseding, forgetting,
the Parquet file and its DuckDB view, and the `clawflow prefs` commands."""

from __future__ import annotations

import duckdb
import pytest
from typer.testing import CliRunner

from clawflow.prefs.axes import Stance, contradicts, stance
from clawflow.prefs.record import ACTIVE, SUPERSEDED, ranked
from clawflow.prefs.store import PreferenceStore
from clawflow.prefs.update import NewHint, fold, forget_session, set_strengths, teacher_text
from clawflow.store.storage import Storage


def hint(text, turn, session="s1", at="2026-12-05T10:00:00", user="default"):
    return NewHint(user, text, session, turn, at)


@pytest.mark.parametrize("text, axis, pole", [
    ("Please keep replies under 30 words.", "length", "short"),
    ("Shorter please: 30 words at most.", "length", "short"),
    ("Too wordy, I don't have time for all that.", "length", "short"),
    ("That's a bit too short to be useful.", "length", "long"),
    ("Give me more detail.", "length", "long"),
    ("Please answer as a bullet list, one \"- \" line per point, nothing else.", "format", "bullets"),
    ("Please give numbered steps (1. 2. 3.), one per line, nothing else.", "format", "numbered"),
    ("No bullet points, write it in prose.", "format", "prose"),
    ("Write everything in lowercase, no capital letters at all.", "case", "lower"),
    ("That's a bit too casual for me.", "tone", "formal"),
    ("That feels a bit stiff.", "tone", "casual"),
    ("Don't use exclamation marks.", "excitement", "calm"),
    ("Always end your reply with a question for me.", "closing", "question"),
    ("Never use these words: certainly, delve.", "wording", "avoid"),
    ("From now on, answer in French.", "other", ""),
])
def test_standing_hints_have_an_axis(text, axis, pole):
    st = stance(text)
    assert st is not None and (st.axis, st.pole) == (axis, pole), st


@pytest.mark.parametrize("text", ["No, the capital is Paris.", "That's wrong.", "You left out something I care about.",
                                  "It should be 1945, not 1944."])
def test_content_and_vague_corrections_are_not_preferences(text):
    assert stance(text) is None
    prefs, log = fold([], [hint(text, "t1")])
    assert prefs == [] and "not a standing preference" in log[0]


def test_numbers_on_length():
    assert stance("Answer in no more than 25 words.") == Stance("length", "short", 25)
    assert contradicts(Stance("length", "short", 30), Stance("length", "short", 50))
    assert not contradicts(Stance("length", "short", None), Stance("length", "short", 30))


def test_same_thing_merges_and_the_concrete_words_are_taught():
    prefs, _ = fold([], [hint("Too wordy, I don't have time for all that.", "t1", at="2026-12-05T10:00"),
                         hint("Please keep replies under 30 words.", "t2", session="s2", at="2026-12-05T10:05")])
    assert len(prefs) == 1
    p = prefs[0]
    assert p.number == 30 and p.sessions == ["s1", "s2"] and len(p.variants) == 2
    assert p.text == "Please keep replies under 30 words."  # concrete over vague before any strength is known
    set_strengths(prefs, "default", {"Too wordy, I don't have time for all that.": 2.0,
                                     "Please keep replies under 30 words.": 9.0})
    assert p.strength == 9.0 and p.text == "Please keep replies under 30 words."


def test_later_contradiction_supersedes_whatever_the_order_given():
    later = hint("Give me more detail, please.", "t2", at="2026-12-05T11:00")
    earlier = hint("Shorter please: 30 words at most.", "t1", at="2026-12-05T10:00")
    prefs, log = fold([], [later, earlier])
    by_turn = {p.variants[0].turn_id: p for p in prefs}
    assert by_turn["t1"].status == SUPERSEDED and by_turn["t1"].superseded_by == by_turn["t2"].pref_id
    assert by_turn["t2"].status == ACTIVE
    assert [p.text for p in ranked(prefs, "default")] == ["Give me more detail, please."]
    assert any("superseded" in line for line in log)


def test_users_are_kept_apart():
    prefs, _ = fold([], [hint("Please keep replies under 30 words.", "t1", user="ann"),
                         hint("Give me more detail.", "t2", user="bob")])
    assert all(p.status == ACTIVE for p in prefs)
    assert [p.user for p in ranked(prefs, "ann")] == ["ann"]


@pytest.mark.parametrize("bad, why", [("", "empty"), ("   ", "empty"), (None, "not text"), (42, "not text"),
                                      ("Please keep it short. " * 40, "characters")])
def test_bad_hints_are_refused_with_a_reason(bad, why):
    prefs, log = fold([], [hint(bad, "t1")])
    assert prefs == [] and "refused" in log[0] and why in log[0]


def test_free_form_preferences_merge_by_similarity():
    same = lambda a, b: 0.9 if "french" in a.lower() and "french" in b.lower() else 0.1  # noqa: E731
    prefs, _ = fold([], [hint("From now on, answer in French.", "t1"), hint("Always reply in French.", "t2"),
                         hint("Always include a source.", "t3")], same)
    assert sorted(len(p.variants) for p in prefs) == [1, 2]


def test_forget_session_drops_what_came_only_from_it():
    prefs, _ = fold([], [hint("Please keep replies under 30 words.", "t1", session="a"),
                         hint("Too wordy.", "t2", session="b"),
                         hint("Always end your reply with a question for me.", "t3", session="a")])
    kept, dropped = forget_session(prefs, "a")
    assert len(dropped) == 1 and len(kept) == 1 and kept[0].sessions == ["b"]


def test_teacher_text():
    assert teacher_text(["Under 30 words", "Always end with a question.", "x"], limit=2) == \
        "Under 30 words. Always end with a question."


def test_store_round_trip_duckdb_and_cli(tmp_path, monkeypatch):
    store = PreferenceStore(Storage(tmp_path), tmp_path)
    log = store.add_hints([hint("Please keep replies under 30 words.", "t1"), hint("No, Paris.", "t2"),
                           hint("Always end your reply with a question for me.", "t3", session="s9")])
    assert len(log) == 3
    assert [p.axis for p in store.active("default")] == ["length", "closing"] or len(store.active("default")) == 2
    with duckdb.connect() as con:
        rows = store.query(con, "SELECT axis, status FROM preferences ORDER BY axis")
    assert rows == [("closing", "active"), ("length", "active")]
    assert store.forget_session("s9") and len(store.active("default")) == 1

    from clawflow.cli import app

    cfg = tmp_path / "c.yaml"
    cfg.write_text(open("configs/test.yaml").read())
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path))
    runner = CliRunner()
    pid = store.active("default")[0].pref_id
    out = runner.invoke(app, ["prefs", "-c", str(cfg)])
    assert out.exit_code == 0 and pid in out.output and "replies" in out.output, out.output
    assert runner.invoke(app, ["prefs", "forget", "p-nope", "-c", str(cfg)]).exit_code == 2
    out = runner.invoke(app, ["prefs", "forget", pid, "-c", str(cfg)])
    assert out.exit_code == 0 and pid in out.output
    assert store.active("default") == []
