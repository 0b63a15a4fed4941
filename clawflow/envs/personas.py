"""Simulated users: personas with checkable preferences, and their natural-language feedback.

A preference is a pure function of the reply text (`check(kind, value, text)`), never an LLM, so
the hit-rate is exact and reproducible. The persona asks a prompt from the pool; after each reply
it answers in words: a satisfied message (then the next prompt) when every preference holds, else
a correction about the first one that failed, phrased vaguely ("way too long") or, with
probability `concrete_feedback`, as a concrete instruction ("keep it under 40 words"): the
concrete ones are what OPD's hindsight hints feed on. Wording is drawn from configs/envs/personas.yaml.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clawflow.config import REPO_ROOT, EnvConfig
from clawflow.envs.base import Environment, Episode, Step
from clawflow.yamlfile import YamlDoc

DEFAULT_FILE = REPO_ROOT / "configs" / "envs" / "personas.yaml"

_BULLET = re.compile(r"^\s*(?:[-*•])\s+\S")
_NUMBERED = re.compile(r"^\s*\d+[.)]\s+\S")
_CONTRACTION = re.compile(r"\b\w+'(?:s|re|ve|ll|d|t|m)\b", re.IGNORECASE)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _words(text: str) -> list[str]:
    return text.split()


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


CHECKS: dict[str, Callable[[str, Any], bool]] = {
    "max_words": lambda t, v: len(_words(t)) <= int(v),
    "min_words": lambda t, v: len(_words(t)) >= int(v),
    "bullet_list": lambda t, v: len(_lines(t)) >= 2 and all(_BULLET.match(ln) for ln in _lines(t)),
    "numbered_list": lambda t, v: len(_lines(t)) >= 2 and all(_NUMBERED.match(ln) for ln in _lines(t)),
    "ends_with_question": lambda t, v: t.rstrip().endswith("?"),
    "all_lowercase": lambda t, v: any(c.isalpha() for c in t) and t == t.lower(),
    "no_exclamation": lambda t, v: "!" not in t,
    "formal": lambda t, v: "!" not in t and not _CONTRACTION.search(t.replace("’", "'")),
    "forbidden_words": lambda t, v: not any(_has_word(t, w) for w in v),
    "must_include": lambda t, v: _has_word(t, str(v)),
    "starts_with": lambda t, v: t.lstrip().lower().startswith(str(v).lower()),
}


def check(kind: str, value: Any, text: str) -> bool:
    """Whether `text` satisfies one preference; an empty reply satisfies none."""
    return bool(text and text.strip()) and CHECKS[kind](text, value)


@dataclass(frozen=True)
class Preference:
    kind: str
    value: Any = None

    def holds(self, text: str) -> bool:
        return check(self.kind, self.value, text)


@dataclass
class Persona:
    name: str
    preferences: list[Preference]
    prompts: list[str]
    system: str | None = None

    def failed(self, text: str) -> list[Preference]:
        return [p for p in self.preferences if not p.holds(text)]

    def hit(self, text: str) -> bool:
        return not self.failed(text)


@dataclass
class Feedback:
    text: str
    satisfied: bool
    failed: list[str] = field(default_factory=list)  # kinds that did not hold
    concrete: bool = False


@dataclass
class Wording:
    satisfied: list[str]
    next_prompt: list[str]  # "{feedback} ... {prompt}"
    vague: dict[str, list[str]]
    concrete: dict[str, list[str]]


def feedback(persona: Persona, wording: Wording, reply: str, rng: random.Random,
             concrete_p: float) -> Feedback:
    """The persona's answer to `reply`: satisfied, or a correction of the first failed preference."""
    failed = persona.failed(reply)
    if not failed:
        return Feedback(rng.choice(wording.satisfied), True)
    pref = failed[0]
    concrete = rng.random() < concrete_p
    pool = (wording.concrete if concrete else wording.vague)[pref.kind]
    value = ", ".join(pref.value) if isinstance(pref.value, list) else pref.value
    return Feedback(rng.choice(pool).format(value=value), False, [p.kind for p in failed], concrete)


def load_personas(path: Path | None = None, names: list[str] | None = None) -> tuple[list[Persona], Wording]:
    """Personas (all, or those named) and the feedback wording from the YAML file; a malformed
    file raises ValueError naming the file and the line."""
    doc = YamlDoc(path or DEFAULT_FILE)
    raw = doc.data
    if not isinstance(raw, dict):
        raise doc.error("expected a mapping with `personas`, `prompts` and `feedback`")
    pool = doc.require(raw, "prompts", list)
    personas = []
    for i, p in enumerate(doc.require(raw, "personas", list)):
        name = doc.require(p, "name", str, "personas", i)
        prefs = []
        for j, item in enumerate(doc.require(p, "preferences", list, "personas", i)):
            if not isinstance(item, dict) or len(item) != 1:
                raise doc.error(f"persona {name}: a preference is one `kind: value` pair", "personas", i,
                                "preferences", j)
            (kind, value), = item.items()
            if kind not in CHECKS:
                raise doc.error(f"persona {name}: unknown preference `{kind}` (known: {', '.join(CHECKS)})",
                                "personas", i, "preferences", j)
            prefs.append(Preference(kind, value))
        own = p.get("prompts")
        if own is not None and (not isinstance(own, list) or not all(isinstance(x, str) for x in own) or not own):
            raise doc.error(f"persona {name}: `prompts` must be a non-empty list of strings", "personas", i, "prompts")
        personas.append(Persona(name, prefs, own or pool, p.get("system")))
    w = doc.require(raw, "feedback", dict)
    parts = [doc.require(w, key, kind, "feedback") for key, kind in
             (("satisfied", list), ("next_prompt", list), ("vague", dict), ("concrete", dict))]
    wording = Wording(*parts)
    for pref in (pref for p in personas for pref in p.preferences):
        if pref.kind not in wording.vague or pref.kind not in wording.concrete:
            raise doc.error(f"no feedback wording for preference `{pref.kind}`", "feedback")
    if names:
        unknown = set(names) - {p.name for p in personas}
        if unknown:
            raise doc.error(f"unknown persona(s): {', '.join(sorted(unknown))}", "personas")
        personas = [p for p in personas if p.name in names]
    return personas, wording


class PersonaEnv(Environment):
    """A simulated user: one persona per episode, prompts from its pool, feedback each turn."""

    name = "persona"

    def __init__(self, loaded: tuple[list[Persona], Wording], cfg: EnvConfig):
        self.personas, self.wording = loaded
        self.cfg = cfg

    def start(self, rng: random.Random) -> Episode:
        persona = rng.choice(self.personas)
        messages = [{"role": "system", "content": persona.system}] if persona.system else []
        messages.append({"role": "user", "content": rng.choice(persona.prompts)})
        return Episode(messages, data={"persona": persona, "hits": []})

    def step(self, episode: Episode, reply: dict, rng: random.Random) -> Step:
        persona: Persona = episode.data["persona"]
        fb = feedback(persona, self.wording, reply.get("content") or "", rng, self.cfg.concrete_feedback)
        episode.data["hits"].append(fb.satisfied)
        text = fb.text
        if fb.satisfied:  # a satisfied user moves on to the next thing they want
            text = rng.choice(self.wording.next_prompt).format(feedback=fb.text, prompt=rng.choice(persona.prompts))
        return Step([{"role": "user", "content": text}])

    def outcome(self, episode: Episode) -> float | None:
        hits = episode.data["hits"]
        return sum(hits) / len(hits) if hits else None  # the episode's preference hit-rate

    def score(self, episode: Episode, reply: dict) -> float | None:
        return 1.0 if episode.data["persona"].hit(reply.get("content") or "") else 0.0
