"""General prompts for context distillation: the user's standing preferences, practised on requests
the user never made.

Context distillation (Snell et al. 2022, "Learning by Distilling Context") does not need labelled
data: the model with the context (here, the hints learned from a user's corrections) in its prompt
answers many unlabelled prompts, and the student learns those answers from the plain prompt. Trained
only on the few requests a user corrected, a preference stays tied to them; trained on a fresh
sample of general prompts each run (configs/train/prompts.yaml: how-tos, explanations, advice, short
facts, lists, small talk), the preference is practised where the user will meet it next, and each
version starts from the habits of the last one, so it compounds.

configs/eval/preference_prompts.yaml (`PREFERENCE_FILE`) holds more prompts in the same format,
never trained on: the eval gate measures on them whether a candidate moved toward the preferences.
Pure apart from reading the file.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from clawflow.config import REPO_ROOT
from clawflow.yamlfile import YamlDoc

DEFAULT_FILE = REPO_ROOT / "configs" / "train" / "prompts.yaml"
PREFERENCE_FILE = REPO_ROOT / "configs" / "eval" / "preference_prompts.yaml"
# howto: "How do I ...?"; explain: why / how does / what is, explained; advise: a personal situation;
# fact: a short general-knowledge question; list: ideas, tips, names; smalltalk: chat, no task.
KINDS = ("howto", "explain", "advise", "fact", "list", "smalltalk")
_NOT_WORD = re.compile(r"[\W_]+")


@dataclass(frozen=True)
class Prompt:
    prompt: str
    kind: str


def normalize(text: str) -> str:
    """Lower-case words joined by single spaces, punctuation dropped: "What's up?" -> "what s up"."""
    return _NOT_WORD.sub(" ", text.lower()).strip()


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The prompt file (`DEFAULT_FILE` unless given); a ValueError naming the file and line for a
    malformed entry, an unknown kind, an empty prompt or a duplicate (after `normalize`)."""
    doc = YamlDoc(path or DEFAULT_FILE)
    if not isinstance(doc.data, dict):
        raise doc.error("expected a mapping with `prompts`")
    out: list[Prompt] = []
    seen: dict[str, str] = {}
    for i, p in enumerate(doc.require(doc.data, "prompts", list)):
        text = doc.require(p, "prompt", str, "prompts", i)
        kind = doc.require(p, "kind", str, "prompts", i)
        if not text.strip():
            raise doc.error("`prompt` is empty", "prompts", i, "prompt")
        if kind not in KINDS:
            raise doc.error(f"prompt {text!r}: unknown kind {kind!r} (kinds: {', '.join(KINDS)})",
                            "prompts", i, "kind")
        key = normalize(text)
        if key in seen:
            raise doc.error(f"duplicate prompt {text!r} (same as {seen[key]!r})", "prompts", i)
        seen[key] = text
        out.append(Prompt(text.strip(), kind))
    if not out:
        raise doc.error("no prompts", "prompts")
    return out


def sample_prompts(prompts: list[Prompt], n: int, seed: int) -> list[Prompt]:
    """`n` distinct prompts (all of them when `n` exceeds the list), a seeded random sample: the same
    seed gives the same sample, another seed (each training run's) another one."""
    if n <= 0:
        return []
    return random.Random(seed).sample(list(prompts), min(n, len(prompts)))
