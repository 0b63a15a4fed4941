"""The gate reads the user's own words on the candidate's answers (clawflow/policy/stance_probe.py):
a candidate whose teacher could not show a checkable preference is not promoted for what it learned
instead, however much the preference measure moved."""

from __future__ import annotations

import pytest
import yaml

from clawflow.config import REPO_ROOT, HelpfulnessGateConfig, load_config
from clawflow.policy import stance_probe as S
from clawflow.policy.gate import evaluate_doses
from clawflow.policy.preference_probe import bar as preference_bar

SHIPPED = load_config(REPO_ROOT / "configs" / "default.yaml").gate


def test_counts_are_per_checkable_stance_of_the_taught_text():
    taught = "Please keep replies under 30 words.\nAll lowercase please. Be more casual."
    texts = ["short and lower", "Short But Capitalised", " ".join(["word"] * 31), ""]
    assert S.shown_counts(taught, texts) == {"length/short 30": 2, "case/lower": 2, S.EVERY: 1}
    assert S.shown_counts("Keep it under 30 words.", texts) == {"length/short 30": 2}
    assert S.shown_counts("Be more casual.", texts) == {}  # nothing checkable: the check says nothing


def test_a_candidate_must_show_an_open_stance_more_and_none_less():
    n, margin = 40, 0.05  # a change counts past 2 answers
    assert S.verdict({}, {}, n, margin) is None
    assert S.verdict({"case/lower": 1}, {"case/lower": 4}, n, margin) is None  # +3 > 2
    why = S.verdict({"case/lower": 1}, {"case/lower": 3}, n, margin)  # +2: noise, not learning
    assert why and "do not show the user's preferences more" in why and "case/lower 1 → 3 of 40" in why
    # with two stances, the answers showing both at once must rise (what the recipe teaches); none may fall
    both = {"length/short 50": 5, "closing/question": 0, S.EVERY: 0}
    why = S.verdict(both, {"length/short 50": 30, "closing/question": 0, S.EVERY: 0}, n, margin)
    assert why and "do not show the user's preferences more" in why and "all at once" in why
    assert S.verdict(both, {"length/short 50": 30, "closing/question": 6, S.EVERY: 6}, n, margin) is None
    why = S.verdict({"length/short 30": 5, "closing/question": 20, S.EVERY: 2},
                    {"length/short 30": 30, "closing/question": 12, S.EVERY: 10}, n, margin)
    assert why and "less than the champion's" in why and "closing/question 20 → 12" in why
    # a stance the champion shows nearly everywhere has no room to rise: holding it is enough
    assert S.verdict({"excitement/calm": 39}, {"excitement/calm": 38}, n, margin) is None
    assert S.verdict({"excitement/calm": 39}, {"excitement/calm": 36}, n, margin)
    # margin 0: any change counts, at least one answer
    assert S.verdict({"case/lower": 0}, {"case/lower": 1}, n, 0.0) is None
    assert S.verdict({"case/lower": 0}, {"case/lower": 0}, n, 0.0)


def test_the_words_can_show_learning_only_where_the_champion_leaves_room():
    n, margin = 40, 0.05
    assert S.has_room({"case/lower": 37}, n, margin) and not S.has_room({"case/lower": 38}, n, margin)
    # the joint count decides, not a stance the champion already shows everywhere
    assert S.has_room({"length/short 30": 40, "case/lower": 2, S.EVERY: 2}, n, margin)
    assert not S.has_room({}, n, margin)
    # no room: the measure's own bar, not the checked one
    checked = SHIPPED.model_copy(update={"min_preference_gain_checked": 0.0})
    assert preference_bar(checked, S.has_room({"case/lower": 39}, n, margin)) == SHIPPED.min_preference_gain


def test_the_counts_are_gate_figures():
    m = S.metrics({"length/short 30": 5}, {"length/short 30": 30}, 40)
    assert m == {"shown_answers": 40.0, "shown.length_short_30": 30.0, "shown.length_short_30.champion": 5.0}
    assert S.key("length/short 30") == "shown.length_short_30" and S.key(S.EVERY) == "shown.every_stance"


def test_the_shipped_gate_checks_stances():
    assert SHIPPED.check_stances and 0 < SHIPPED.stance_margin < 0.2


def test_where_the_words_are_checked_the_measure_may_need_only_point_toward_the_teacher():
    checked = SHIPPED.model_copy(update={"min_preference_gain_checked": 0.0})
    assert preference_bar(checked, words_checked=True) == 0.0
    assert preference_bar(checked, words_checked=False) == SHIPPED.min_preference_gain > 0
    # shipped unset: the measure's own bar everywhere (one_liner's v5 lost facts the gate never reads)
    assert SHIPPED.min_preference_gain_checked is None
    assert preference_bar(SHIPPED, True) == preference_bar(SHIPPED, False) == SHIPPED.min_preference_gain


@pytest.mark.slow  # ~45 s: a hint-following model taught (200 steps), a student of it (40), the gate three times
def test_a_candidate_that_shows_a_preference_passes_and_one_that_shows_another_does_not(tiny_model_dir, tmp_path):
    """The hint-following model (tests/hint_following.py) answers a 40-word LONG plainly and a 7-word
    SHORT ("Short answer: ...", capitalised) with any hint in its system prompt. Its student answers
    SHORT plainly. With "under 30 words" the student shows the user's words in every answer and the
    champion in none: promoted. With "all lowercase" the teacher answered the same SHORT, so the
    preference measure moves just as much, but no answer is lowercase: rejected, and promoted when
    the check is off."""
    from hint_following import answering_short, build

    champion = str(build(tiny_model_dir, tmp_path / "champion"))
    student = str(answering_short(champion, tmp_path / "student"))
    prompts = tmp_path / "prompts.yaml"  # 8 of the shipped held-out prompts: the test's time
    shipped = yaml.safe_load((REPO_ROOT / "configs" / "eval" / "preference_prompts.yaml").read_text())
    prompts.write_text(yaml.safe_dump({"prompts": shipped["prompts"][:8]}))
    gate = SHIPPED.model_copy(update={
        "helpfulness": HelpfulnessGateConfig(enabled=False),  # a 64-wide model states no facts
        "max_kl": 100.0, "max_nll_increase": 100.0,  # the student rewrote every answer: drift is not this test's
        "doses": [1.0], "preference_prompts": prompts})

    def verdict(taught: str, **update):
        return evaluate_doses(gate.model_copy(update=update), student, champion, tmp_path / taught[:5],
                              judged=[], taught=taught)

    short = verdict("Please keep replies under 30 words.")
    assert short.passed and short.dose == 1.0, short.reason
    assert short.metrics["shown.length_short_30"] == 8 and short.metrics["shown.length_short_30.champion"] == 0
    assert "shown length/short 30 0 → 8" in short.reason
    # the words decide where they can be checked: a fixed bar past any gain does not stop it, unless
    # the checked bar is off
    assert verdict("Please keep replies under 30 words.", min_preference_gain=1e6, min_preference_gain_checked=0.0).passed
    fixed = verdict("Please keep replies under 30 words.", min_preference_gain=1e6)
    assert not fixed.passed and "not past the champion's (+1e+06)" in fixed.reason

    lower = verdict("All lowercase please, no capitals.")
    assert lower.metrics["pref_gain"] > gate.min_preference_gain  # the measure alone would promote it
    assert not lower.passed and lower.dose is None
    assert "do not show the user's preferences more" in lower.reason and "case/lower 0 → 0 of 8" in lower.reason
    assert lower.metrics["shown.case_lower"] == 0 == lower.metrics["shown.case_lower.champion"]
    assert verdict("All lowercase please, no capitals.", check_stances=False).passed
