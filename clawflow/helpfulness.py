"""Helpfulness: does a policy still answer general questions, and answer each one?

Greedy replies to held-out general questions (configs/eval/helpfulness.yaml, never trained on) are
scored by the share that state the question's key fact, and by degeneracy signals a collapsed
policy cannot hide: the same or near-same reply to different questions, replies that loop, empty
replies, and replies unrelated to their question (MiniLM cosine of question and reply). A terse
policy that still answers keeps its facts; one that learned "The answer to this question is:" for
everything loses them and duplicates itself. The reference NLL used before *fell* when a policy
became terse, so it rewarded exactly that collapse (issue #15).

The eval gate (clawflow/gate.py) and bench/learning.py both call this module. Scoring is pure;
generation and relevance load models; `cached` keeps the base's and champion's figures on disk.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from clawflow.config import REPO_ROOT, HelpfulnessConfig
from clawflow.yamlfile import YamlDoc

DEFAULT_FILE = REPO_ROOT / "configs" / "eval" / "helpfulness.yaml"
_WORDS = re.compile(r"\w+")


@dataclass(frozen=True)
class Question:
    prompt: str
    facts: tuple[str, ...]  # alternatives: a reply states the fact when any one matches

    def stated_in(self, reply: str) -> bool:
        return any(re.search(rf"(?<!\w)(?:{f})(?!\w)", reply, re.IGNORECASE) for f in self.facts)


def load_questions(path: str | Path | None = None) -> list[Question]:
    """The question file; ValueError naming the file and line for a malformed entry."""
    doc = YamlDoc(path or DEFAULT_FILE)
    if not isinstance(doc.data, dict):
        raise doc.error("expected a mapping with `questions`")
    out, seen = [], set()
    for i, q in enumerate(doc.require(doc.data, "questions", list)):
        prompt = doc.require(q, "prompt", str, "questions", i)
        facts = doc.require(q, "facts", list, "questions", i)
        if not facts or not all(isinstance(f, (str, int, float)) and str(f).strip() for f in facts):
            raise doc.error(f"question {prompt!r}: `facts` must be a non-empty list of strings", "questions", i)
        for f in facts:
            try:
                re.compile(str(f))
            except re.error as exc:
                raise doc.error(f"question {prompt!r}: fact {f!r} is not a valid pattern ({exc})",
                                "questions", i, "facts") from exc
        if prompt in seen:
            raise doc.error(f"duplicate question {prompt!r}", "questions", i)
        seen.add(prompt)
        out.append(Question(prompt, tuple(str(f) for f in facts)))
    if not out:
        raise doc.error("no questions", "questions")
    return out


def file_digest(path: str | Path | None = None) -> str:
    return hashlib.sha256(Path(path or DEFAULT_FILE).read_bytes()).hexdigest()[:16]


@dataclass
class Helpfulness:
    facts_rate: float  # share of replies stating their question's key fact
    duplicate_share: float  # share of replies (near-)identical to the reply to another question
    repetitive_share: float  # share of replies that loop ("A: A: A: ...")
    empty_share: float
    offtopic_share: float  # share whose MiniLM similarity to the question is under the threshold
    n: int
    replies: list[str] = field(default_factory=list)

    def as_metrics(self, prefix: str = "help_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k != "replies"}


def _norm(text: str) -> list[str]:
    return _WORDS.findall(text.lower())


def _trigrams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + 3]) for i in range(max(len(words) - 2, 0))}


def near_same(a: str, b: str) -> bool:
    """Same words; or a shared opening of 6+ words covering 3/4 of the shorter reply (a template
    with the last word swapped: "The answer to this question is: X"); or word-trigram Jaccard >= 0.8."""
    wa, wb = _norm(a), _norm(b)
    if not wa or not wb:
        return False
    prefix = next((i for i, (x, y) in enumerate(zip(wa, wb)) if x != y), min(len(wa), len(wb)))
    if wa == wb or (prefix >= 6 and prefix >= 0.75 * min(len(wa), len(wb))):
        return True
    ta, tb = _trigrams(wa), _trigrams(wb)
    return bool(ta and tb) and len(ta & tb) / len(ta | tb) >= 0.8


def loops(text: str) -> bool:
    """12+ words of which under half the word trigrams are distinct."""
    words = _norm(text)
    return len(words) >= 12 and len(_trigrams(words)) / (len(words) - 2) < 0.5


def score(questions: list[Question], replies: list[str], relevance: list[float] | None = None,
          offtopic_below: float = 0.25) -> Helpfulness:
    """The figures for one policy's replies (pure)."""
    if len(questions) != len(replies) or not replies:
        raise ValueError(f"{len(questions)} questions but {len(replies)} replies")
    n = len(replies)
    dup = sum(any(j != i and near_same(r, s) for j, s in enumerate(replies)) for i, r in enumerate(replies))
    off = sum(x < offtopic_below for x in relevance) / n if relevance is not None else 0.0
    return Helpfulness(facts_rate=sum(q.stated_in(r) for q, r in zip(questions, replies)) / n,
                       duplicate_share=dup / n, repetitive_share=sum(map(loops, replies)) / n,
                       empty_share=sum(not r.strip() for r in replies) / n, offtopic_share=off, n=n,
                       replies=list(replies))


def relevance(questions: list[Question], replies: list[str], encoder: Any = None) -> list[float]:
    """MiniLM cosine similarity of each question with its reply (an empty reply scores 0)."""
    from clawflow.judge.minilm import MiniLM

    enc = encoder or MiniLM(threads=1)
    q, r = enc.embed([x.prompt for x in questions]), enc.embed([x or " " for x in replies])
    return [0.0 if not text.strip() else float(s) for text, s in zip(replies, (q * r).sum(-1).tolist())]


def greedy_replies(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, batch_size: int = 64,
                   deadline: float | None = None) -> list[str]:
    """Greedy replies (chat template, one user message, no system prompt), batched with left
    padding; TimeoutError once `deadline` (time.monotonic()) has passed."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Deadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return deadline is not None and time.monotonic() > deadline

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    try:
        for k in range(0, len(prompts), batch_size):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"helpfulness replies: {k} of {len(prompts)} done when the time ran out")
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False) for p in prompts[k : k + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                     stopping_criteria=StoppingCriteriaList([_Deadline()]))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"helpfulness replies: batch {k // batch_size + 1} ran past the time limit")
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return [r.strip() for r in out]


def measure(model: Any, tokenizer: Any, questions: list[Question], cfg: HelpfulnessConfig,
            deadline: float | None = None, encoder: Any = None) -> Helpfulness:
    replies = greedy_replies(model, tokenizer, [q.prompt for q in questions], cfg.max_new_tokens,
                             deadline=deadline)
    return score(questions, replies, relevance(questions, replies, encoder), cfg.offtopic_below)


def cached(cache_dir: Path, model_dir: str | Path, settings: str, compute: Callable[[], Helpfulness]) -> Helpfulness:
    """`compute()`'s result, kept on disk per (checkpoint dir, its weight files' mtimes, settings)."""
    d = Path(model_dir).resolve()
    stamp = [(f.name, f.stat().st_mtime_ns) for f in sorted(d.glob("*.safetensors"))]
    key = hashlib.sha256(json.dumps([str(d), stamp, settings]).encode()).hexdigest()[:24]
    path = cache_dir / f"{key}.json"
    if path.is_file():
        return Helpfulness(**json.loads(path.read_text()))
    h = compute()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(h)))
    tmp.replace(path)
    return h


def verdict(candidate: Helpfulness, references: dict[str, Helpfulness], cfg: HelpfulnessConfig) -> str | None:
    """Why the candidate answers worse than a reference (`champion`, `base`) or degenerates; None if fine."""
    for name, ref in references.items():
        if candidate.facts_rate < ref.facts_rate - cfg.margin:
            return (f"helpfulness fell: key facts stated in {candidate.facts_rate:.3f} of {candidate.n} held-out "
                    f"answers vs {ref.facts_rate:.3f} for the {name} (margin {cfg.margin})")
    if candidate.duplicate_share > cfg.max_duplicate_share:
        return (f"degenerate replies: {candidate.duplicate_share:.3f} of answers repeat another question's answer "
                f"(max {cfg.max_duplicate_share})")
    if candidate.repetitive_share > cfg.max_repetitive_share:
        return f"degenerate replies: {candidate.repetitive_share:.3f} of answers loop (max {cfg.max_repetitive_share})"
    if candidate.empty_share > cfg.max_empty_share:
        return f"degenerate replies: {candidate.empty_share:.3f} of answers are empty (max {cfg.max_empty_share})"
    for name, ref in references.items():
        if candidate.offtopic_share > ref.offtopic_share + cfg.max_offtopic_increase:
            return (f"degenerate replies: {candidate.offtopic_share:.3f} of answers are unrelated to their question "
                    f"vs {ref.offtopic_share:.3f} for the {name} (allowed +{cfg.max_offtopic_increase})")
    return None
