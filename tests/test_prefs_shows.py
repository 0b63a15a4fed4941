"""prefs/shows.py: whether a reply shows what a hint's words ask, where they can be checked; and the
best-of-N choice preferring the candidates that do (train/rewrite.py `choose`)."""

from __future__ import annotations

import pytest

from clawflow.prefs.axes import Stance, stances_in
from clawflow.prefs.shows import checkable, label, shows, unshown
from clawflow.train.rewrite import Candidate, choose


def test_every_sentence_and_axis_of_a_hint_is_read():
    assert stances_in("Use a bullet list, at most 60 words. Please no exclamation marks!") == [
        Stance("length", "short", 60), Stance("format", "bullets"), Stance("excitement", "calm")]
    assert stances_in("No, it was Paris.") == []


@pytest.mark.parametrize("hint, good, bad", [
    ("Answer in no more than 30 words.", "Mars is the red planet.", " ".join(["word"] * 31)),
    ("Give me at least 12 words.", " ".join(["word"] * 12), "Too short."),
    ("All lowercase please, no capitals.", "mars is the red planet, 4th from the sun.", "Mars is the red planet."),
    ("Please answer as a bullet list.", "Two things:\n- eggs\n- milk", "Eggs and milk."),
    ("Numbered steps please.", "1. Boil water.\n2) Add tea.", "Boil water, then add tea."),
    ("Not as a list, in prose please.", "Boil water, then add tea.", "- Boil water\n- Add tea"),
    ("Calm down with the exclamation marks.", "That is great.", "That is great!"),
    ("Always end your reply with a question for me.", "Paris. Want more?", "Want more? Paris."),
    ("Too casual, be more formal.", "It is not ready.", "It isn't ready."),
])
def test_a_checkable_hint_is_shown_by_a_reply_that_does_what_it_asks(hint, good, bad):
    assert len(checkable(hint)) == 1
    assert unshown(hint, good) == [] and [label(st) for st in unshown(hint, bad)] == [label(checkable(hint)[0])]
    assert unshown(hint, "   ") == checkable(hint)  # an empty reply shows nothing


def test_stances_without_a_check_pass_every_reply():
    for hint in ("Too wordy.", "More detail please.", "Be more casual.", "No, Paris.", "Always answer kindly."):
        assert checkable(hint) == [] and unshown(hint, "Anything AT ALL!") == []
    assert shows(Stance("length", "short"), "x " * 500) is None  # "shorter": no number to hold it to


def test_best_of_n_prefers_the_candidates_that_show_the_hint():
    cands = [Candidate([1], plain=-1.0, hinted=-2.0), Candidate([2], plain=-5.0, hinted=-1.0),
             Candidate([3], plain=-3.0, hinted=-1.0)]
    assert choose(cands, [True, True, True], "plain") == 0
    assert choose(cands, [True, True, True], "plain", shown=[False, True, True]) == 2  # likeliest that shows it
    assert choose(cands, [True, False, True], "plain", shown=[False, True, False]) == 0  # none usable shows it
    assert choose(cands, [False, False, False], "plain", shown=[True, True, True]) is None


def test_a_prefix_that_fails_a_stance_for_good_is_told_apart_from_one_that_may_still_show_it():
    """`cannot_show`: sampling stops a rewrite candidate once no continuation can show its teacher's stances."""
    from clawflow.prefs.shows import cannot_show

    def fails(hint: str, prefix: str) -> bool:
        return cannot_show(checkable(hint), prefix)

    assert fails("Please keep replies under 5 words.", "one two three four five six")
    assert not fails("Please keep replies under 5 words.", "one two three")
    assert fails("all lowercase please, no capitals.", "sure, Here")
    assert not fails("all lowercase please, no capitals.", "sure, here")
    assert fails("Don't use exclamation marks.", "Great!") and not fails("Don't use exclamation marks.", "Great.")
    # a list, a closing question or a minimum length may still come: never stopped
    for hint in ("Please answer as a bullet list.", "Always end your reply with a question for me.",
                 "Please write at least 50 words."):
        assert checkable(hint) and not fails(hint, "Plain words, no list, no question yet.")
    assert not fails("Be more casual.", "Anything At All!")  # nothing checkable
