"""The gate's check of the user's own words on the candidate's own answers (issue #27).

The preference measure (policy/preference_probe.py) reads no words: it asks whether the candidate
finds the teacher's answers likelier. A teacher that cannot show a preference still answers
differently with it in its prompt (SmolLM2-135M told "All lowercase please" answers shorter, in
ordinary case), so a candidate that learned *that* passed the measure: `lowercase_casual` v2 was
promoted at a hit-rate of 0.000. Where the user's words say something a reply can be checked against
("under 30 words", "all lowercase", "as a bullet list": prefs/shows.py), the candidate's greedy plain
answers to the held-out preference prompts must show all of them at once in more answers than the
champion's plain answers do, and none in fewer, each by more than `gate.stance_margin` of the
prompts: the recipe learns only rewrites that show every checkable stance the teacher read
(`train.verify_stances`), and the gate promotes only what it set out to teach. A count the champion
already reaches nearly everywhere has no room to rise: it must only hold. Stances without a check leave the verdict to the preference measure, as before.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from clawflow.prefs import shows


EVERY = "every stance"  # the answers showing all of them at once, when there are two or more


def shown_counts(taught: str, texts: Sequence[str]) -> dict[str, int]:
    """{stance label: how many of `texts` show it}, one entry per checkable stance of `taught`, and
    `EVERY` with two or more; {} when it has none. Pure."""
    stances = shows.checkable(taught)
    out = {shows.label(st): sum(bool(shows.shows(st, t)) for t in texts) for st in stances}
    if len(out) > 1:
        out[EVERY] = sum(all(shows.shows(st, t) for st in stances) for t in texts)
    return out


def verdict(champion: dict[str, int], candidate: dict[str, int], answers: int, margin: float) -> str | None:
    """Why the candidate's answers do not show the user's checkable stances better than the champion's
    (`shown_counts` of each, over the same `answers` prompts), or None when they do or none is checkable.
    A change counts when it is more than `margin` x `answers` answers (and at least one). Pure."""
    if not champion:
        return None
    allowed = margin * answers

    def said(labels: list[str]) -> str:
        return ", ".join(f"{k} {champion[k]} → {candidate[k]}" for k in labels) + f" of {answers} answers"

    fell = [k for k in champion if champion[k] - candidate[k] > allowed]
    if fell:
        return f"its answers show the user's preferences less than the champion's: {said(fell)}"
    joint = joint_key(champion)
    if has_room(champion, answers, margin) and not candidate[joint] - champion[joint] > max(allowed, 0.5):
        return (f"its answers do not show the user's preferences more than the champion's: {said(list(champion))} "
                f"(needs more than +{allowed:.3g}{' answers showing all at once' if joint == EVERY else ''})")
    return None


def has_room(champion: dict[str, int], answers: int, margin: float) -> bool:
    """Whether the champion's answers leave the joint count (`EVERY`, or the one stance) room to rise
    by more than `margin` x `answers`: only then can the words show that a candidate learned. Pure."""
    return bool(champion) and champion[joint_key(champion)] + margin * answers < answers


def joint_key(counts: dict[str, int]) -> str:
    """The count that must rise: `EVERY` with two or more stances, else the one. Pure."""
    return EVERY if EVERY in counts else next(iter(counts))


def key(label: str) -> str:
    """The gate figure of a stance's count: 'length/short 30' -> 'shown.length_short_30'."""
    return "shown." + label.replace("/", "_").replace(" ", "_")


def metrics(champion: dict[str, int], candidate: dict[str, int], answers: int) -> dict[str, float]:
    """The counts as gate figures: `shown.<stance>` (candidate), `shown.<stance>.champion`, `shown_answers`."""
    out = {"shown_answers": float(answers)}
    for k in champion:
        out[key(k)], out[key(k) + ".champion"] = float(candidate[k]), float(champion[k])
    return out


def texts(tok, answers: list[list[int]]) -> list[str]:
    return [tok.decode(a, skip_special_tokens=True) for a in answers]


def measure(path: str, tok, prompts: list[str], taught: str, champion: dict[str, int], m: dict[str, float],
            max_new_tokens: int, margin: float, model=None) -> str | None:
    """The candidate at `path` (`model`, when already loaded): its greedy plain answers to `prompts`,
    their counts (and the seconds) into the gate's figures `m`; why they do not show the user's
    stances (`verdict`), or None."""
    from clawflow.helpfulness import load_model
    from clawflow.policy.preference_probe import teacher_answers

    t0 = time.monotonic()
    cand = model if model is not None else load_model(path)[0]
    answers = texts(tok, teacher_answers(cand, tok, prompts, "", max_new_tokens))
    shown = shown_counts(taught, answers)
    m.update(metrics(champion, shown, len(answers)), seconds_stances=time.monotonic() - t0)
    return verdict(champion, shown, len(answers), margin)
