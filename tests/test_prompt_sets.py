"""The hand-written prompt and question sets (issue 27) and their loader, clawflow/train/prompts.py.

Every set has one job: training prompts (configs/train/prompts.yaml), the gate's held-out preference
prompts and facts questions (configs/eval/preference_prompts.yaml, helpfulness.yaml), the bench's own
facts (configs/eval/facts_bench.yaml), rehearsal (configs/train/rehearsal.yaml), the learning
bench's hit-rate prompts and the personas' prompts (configs/envs/). A prompt in two of them, or a
near copy of one, would let training see what an evaluation measures.
"""

import itertools
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from clawflow import helpfulness as H
from clawflow.config import REPO_ROOT
from clawflow.train.prompts import (DEFAULT_FILE, KINDS, PREFERENCE_FILE, Prompt, load_prompts, normalize,
                                    sample_prompts)
from clawflow.train.rehearsal import load_rehearsal
from clawflow.train.rewrite import content_words

FACTS_BENCH = REPO_ROOT / "configs" / "eval" / "facts_bench.yaml"
ENVS = REPO_ROOT / "configs" / "envs"


def _persona_prompts(path: Path) -> list[str]:
    """Every prompt a simulated user of `path` may send: the shared pool and each persona's own."""
    raw = yaml.safe_load(path.read_text())
    own = [p for persona in raw["personas"] for p in persona.get("prompts") or []]
    return list(raw["prompts"]) + own


def _learning_bench_prompts() -> list[str]:
    raw = yaml.safe_load((ENVS / "learning_bench.yaml").read_text())
    lists = [raw["eval_prompts"], *(raw.get("persona_eval_prompts") or {}).values()]
    return list(dict.fromkeys(p for prompts in lists for p in prompts))  # aliases repeat a list


def _sets() -> dict[str, list[str]]:
    return {
        "train prompts": [p.prompt for p in load_prompts()],
        "preference prompts": [p.prompt for p in load_prompts(PREFERENCE_FILE)],
        "helpfulness": [q.prompt for q in H.load_questions()],
        "facts_bench": [q.prompt for q in H.load_questions(FACTS_BENCH)],
        "rehearsal": [q.prompt for q in load_rehearsal()],
        "learning_bench": _learning_bench_prompts(),
        "personas": _persona_prompts(ENVS / "personas.yaml"),
        "personas_final": _persona_prompts(ENVS / "personas_final.yaml"),
    }


# -- the loader ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, line, message", [
    ("prompts: [oops\n", 2, "not valid YAML"),
    ("- a\n- b\n", 1, "expected a mapping with `prompts`"),
    ("other: 1\n", 1, "missing `prompts`"),
    ("prompts: []\n", 1, "no prompts"),
    ("prompts:\n  - {prompt: 'Hi?', kind: smalltalk}\n  - {kind: fact}\n", 3, "missing `prompt`"),
    ("prompts:\n  - {prompt: 'Hi?'}\n", 2, "missing `kind`"),
    ("prompts:\n  - {prompt: 'Hi?', kind: smalltalk}\n  - {prompt: '  ', kind: fact}\n", 3, "`prompt` is empty"),
    ("prompts:\n  - {prompt: 7, kind: fact}\n", 2, "`prompt` must be a str"),
    ("prompts:\n  - {prompt: 'Hi?', kind: smalltalk}\n\n  - {prompt: 'Why?', kind: riddle}\n", 4, "unknown kind 'riddle'"),
    ("prompts:\n  - {prompt: 'What is up?', kind: smalltalk}\n  - {prompt: 'what is UP', kind: smalltalk}\n", 3,
     "duplicate prompt 'what is UP'"),
    ("prompts:\n  - just a string\n", 2, "expected a mapping, got str"),
])
def test_a_malformed_prompt_file_names_the_file_and_the_line(tmp_path, text, line, message):
    path = tmp_path / "prompts.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line}: ") and message in msg and "\n" not in msg, msg


def test_a_missing_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'nope.yaml'}: cannot read"):
        load_prompts(tmp_path / "nope.yaml")


def test_a_good_file_loads_in_order_with_its_kinds(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("# a comment\nprompts:\n  - {prompt: ' How do I boil pasta? ', kind: howto}\n"
                    "  - {prompt: \"Hi, what's new?\", kind: smalltalk}\n")
    assert load_prompts(path) == [Prompt("How do I boil pasta?", "howto"), Prompt("Hi, what's new?", "smalltalk")]
    assert normalize("  What's  NEW, friend?! ") == "what s new friend"


# -- sampling -----------------------------------------------------------------------------------------


def test_sampling_is_seeded_without_replacement_and_capped():
    prompts = load_prompts()
    a = sample_prompts(prompts, 12, seed=3)
    assert len(a) == 12 and len(set(a)) == 12 and all(p in prompts for p in a)
    assert a == sample_prompts(prompts, 12, seed=3)  # same seed, same sample
    assert a != sample_prompts(prompts, 12, seed=4)  # each run practises on others
    assert len({tuple(sample_prompts(prompts, 12, seed=s)) for s in range(20)}) == 20
    everything = sample_prompts(prompts, len(prompts) + 50, seed=1)
    assert sorted(everything, key=lambda p: p.prompt) == sorted(prompts, key=lambda p: p.prompt)
    assert sample_prompts(prompts, 0, seed=1) == [] and sample_prompts([], 5, seed=1) == []
    # over many runs every prompt gets drawn: no corner of the file is dead
    drawn = {p.prompt for s in range(300) for p in sample_prompts(prompts, 16, seed=s)}
    assert len(drawn) > 0.95 * len(prompts)


# -- the shipped sets ---------------------------------------------------------------------------------


def test_the_training_prompts_are_many_of_every_kind():
    prompts = load_prompts()
    assert load_prompts(DEFAULT_FILE) == prompts and len(prompts) >= 320
    counts = Counter(p.kind for p in prompts)
    assert set(counts) == set(KINDS) and min(counts.values()) >= 40, counts
    header = DEFAULT_FILE.read_text().split("prompts:")[0]
    assert header.startswith("#") and "clawflow/train/prompts.py" in header and "test_prompt_sets" in header


def test_the_preference_prompts_are_held_out_and_mixed():
    prompts = load_prompts(PREFERENCE_FILE)
    assert len(prompts) >= 40
    counts = Counter(p.kind for p in prompts)
    assert set(counts) == set(KINDS) and min(counts.values()) >= 5, counts
    header = PREFERENCE_FILE.read_text().split("prompts:")[0]
    assert header.startswith("#") and "never trained on" in header.lower() and "gate" in header


def test_the_facts_sets_are_large_and_no_fact_is_given_away_by_its_question():
    gate, bench = H.load_questions(), H.load_questions(FACTS_BENCH)
    assert len(gate) >= 200 and len(bench) >= 120
    assert "gate never reads" in FACTS_BENCH.read_text().split("questions:")[0].replace("\n# ", " ")
    given_away = [(q.prompt, f) for q in gate + bench for f in q.facts if H.Question(q.prompt, [f]).stated_in(q.prompt)]
    assert not given_away
    # the checker itself: a whole-word match, so it does catch a fact that sits in its question
    assert H.Question("What colour is a ripe banana, yellow or red?", ["yellow"]).stated_in(
        "What colour is a ripe banana, yellow or red?")


def test_the_learning_bench_has_enough_held_out_prompts():
    raw = yaml.safe_load((ENVS / "learning_bench.yaml").read_text())
    assert len(raw["eval_prompts"]) >= 40 and len(set(raw["eval_prompts"])) == len(raw["eval_prompts"])
    lists = raw["persona_eval_prompts"]
    assert lists and all(len(v) >= 36 and len(set(v)) == len(v) for v in lists.values())


def test_no_prompt_is_in_two_sets():
    sets = _sets()
    assert all(len(v) >= 10 for v in sets.values()), {k: len(v) for k, v in sets.items()}
    where: dict[str, set[str]] = {}
    for name, prompts in sets.items():
        for p in prompts:
            where.setdefault(normalize(p), set()).add(name)
    shared = {p: sorted(names) for p, names in where.items() if len(names) > 1}
    assert not shared, shared


def _jaccard(a: str, b: str) -> float:
    """Jaccard similarity of two prompts' content words (clawflow.train.rewrite.content_words) and
    numbers: content_words keeps letters only, and "What is 7 times 8?" is not "What is 12 times 12?"."""
    wa, wb = (content_words(x) | set(re.findall(r"\d+", x)) for x in (a, b))
    return len(wa & wb) / len(wa | wb) if wa and wb else 0.0


def test_no_prompt_is_a_near_copy_of_another_sets():
    """Content-word Jaccard >= 0.8 between prompts of different sets: "What is the capital of Spain?"
    and "Spain's capital city, please?" are one question for a model that has learned either."""
    assert _jaccard("What is the capital city of Spain?", "Spain's capital city, please?") >= 0.8  # it can fail
    assert _jaccard("What is the capital of Spain?", "What is the capital of Peru?") < 0.8
    assert _jaccard("What is 12 times 12?", "So what's 12 times 12, then?") >= 0.8
    assert _jaccard("What is 12 times 12?", "What is 7 times 8?") < 0.8
    sets = _sets()
    near = [(a, p, b, q) for (a, xs), (b, ys) in itertools.combinations(sets.items(), 2)
            for p, q in itertools.product(xs, ys) if _jaccard(p, q) >= 0.8]
    assert not near, near[:10]
