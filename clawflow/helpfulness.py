"""Helpfulness: does a policy still answer general questions, and answer each one?

Greedy replies to held-out general questions (configs/eval/helpfulness.yaml, never trained on) are
scored by the share that state the question's key fact, and by degeneracy signals a collapsed
policy cannot hide: the same or near-same reply to different questions, replies that loop, empty
replies, and replies unrelated to their question (MiniLM cosine of question and reply). A terse
policy that still answers keeps its facts; one that learned "I'm sorry for any misinterpretation."
for everything loses them and duplicates itself. The reference NLL used before *fell* when a policy
became terse, so it rewarded exactly that collapse (issue #15).

The eval gate (clawflow/policy/gate.py) and bench/learning.py both call this module. Scoring is pure;
`measure` loads a checkpoint (full or LoRA adapter), generates and scores, and keeps the raw replies
on disk so the base's and the champion's figures are generated once. Torch, transformers and peft
are imported inside the functions that need them: importing this module stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clawflow.config import REPO_ROOT
from clawflow.yamlfile import YamlDoc

DEFAULT_FILE = REPO_ROOT / "configs" / "eval" / "helpfulness.yaml"
# MiniLM cosine(question, reply) under this is off-topic. Measured on the 56 default questions:
# SmolLM2-135M-Instruct's own greedy replies 0.63-0.90 (median 0.80), six LoRA versions trained by
# the learning bench 0.36 and up, the base's replies shuffled onto other questions -0.09-0.52
# (median 0.14, 49 of 56 under 0.3), a collapsed "I'm sorry ..." adapter -0.08-0.2.
OFFTOPIC_THRESHOLD = 0.3
# One batch for the whole set: on 2 CPU cores, 48 questions x 32 tokens took 16 s at batch 48,
# 21 s at 24 and 47 s at 16 (per-step overhead dominates small batches).
BATCH_SIZE = 64
_WORDS = re.compile(r"\w+")


@dataclass
class Question:
    """A question and its ONE key fact: `facts` are alternative spellings (case-insensitive regular
    expressions matched as whole words); a reply states the fact when any one of them appears.
    A fact with several parts is written as one pattern (e.g. "hydrogen.*oxygen")."""

    prompt: str
    facts: list[str]

    def stated_in(self, reply: str) -> bool:
        return any(re.search(rf"(?<!\w)(?:{f})(?!\w)", reply, re.IGNORECASE) for f in self.facts)


def load_questions(path: str | Path | None = None) -> list[Question]:
    """The question file; a ValueError naming the file and line for a malformed entry."""
    doc = YamlDoc(path or DEFAULT_FILE)
    if not isinstance(doc.data, dict):
        raise doc.error("expected a mapping with `questions`")
    out, seen = [], set()
    for i, q in enumerate(doc.require(doc.data, "questions", list)):
        prompt = doc.require(q, "prompt", str, "questions", i)
        facts = doc.require(q, "facts", list, "questions", i)
        if not prompt.strip():
            raise doc.error("`prompt` is empty", "questions", i, "prompt")
        if not facts or not all(isinstance(f, (str, int, float)) and str(f).strip() for f in facts):
            raise doc.error(f"question {prompt!r}: `facts` must be a non-empty list of strings",
                            "questions", i, "facts")
        for f in facts:
            try:
                re.compile(str(f))
            except re.error as exc:
                raise doc.error(f"question {prompt!r}: fact {f!r} is not a valid pattern ({exc})",
                                "questions", i, "facts") from exc
        if prompt in seen:
            raise doc.error(f"duplicate question {prompt!r}", "questions", i)
        seen.add(prompt)
        out.append(Question(prompt, [str(f) for f in facts]))
    if not out:
        raise doc.error("no questions", "questions")
    return out


@dataclass
class Helpfulness:
    facts_rate: float  # share of replies stating their question's key fact
    duplicate_share: float  # share of replies (near-)identical to the reply to another question
    offtopic_share: float  # share whose MiniLM similarity to the question is under the threshold
    repetitive_share: float  # share of replies that loop ("A: A: A: ...")
    empty_share: float
    n: int
    replies: list[str] = field(default_factory=list)
    stated: list[bool] = field(default_factory=list)  # per question: the reply states its key fact

    def as_metrics(self, prefix: str = "help_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k not in ("replies", "stated")}


def paired(candidate: Helpfulness, reference: Helpfulness) -> tuple[int, int]:
    """(questions the reference answered with their fact and the candidate no longer does, the
    reverse): two rates can hide a swap of many questions; the paired counts do not. Pure."""
    if len(candidate.stated) != len(reference.stated):
        raise ValueError(f"{len(candidate.stated)} vs {len(reference.stated)} questions")
    pairs = list(zip(candidate.stated, reference.stated))
    return sum(r and not c for c, r in pairs), sum(c and not r for c, r in pairs)


def _words(text: str) -> list[str]:
    return _WORDS.findall(text.lower())


def _trigrams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + 3]) for i in range(max(len(words) - 2, 0))}


def near_same(a: str, b: str) -> bool:
    """Same words; the same first 8 words (a template with its tail swapped: "I'm sorry, but as an
    AI I cannot ... X"); a shared opening of 5+ words covering 3/4 of the shorter reply ("I'm sorry
    for any misunderstanding." vs "... misinterpretation."); or word-trigram Jaccard >= 0.8.
    Correct answers to different questions part within their first words ("The capital of France
    is Paris." vs "The capital of Japan is Tokyo." share 3)."""
    wa, wb = _words(a), _words(b)
    if not wa or not wb:
        return False
    shared = next((i for i, (x, y) in enumerate(zip(wa, wb)) if x != y), min(len(wa), len(wb)))
    if wa == wb or shared >= 8 or (shared >= 5 and shared >= 0.75 * min(len(wa), len(wb))):
        return True
    ta, tb = _trigrams(wa), _trigrams(wb)
    return bool(ta and tb) and len(ta & tb) / len(ta | tb) >= 0.8


def loops(text: str) -> bool:
    """12+ words of which under half the word trigrams are distinct ("A: A: A: A: ...")."""
    words = _words(text)
    return len(words) >= 12 and len(_trigrams(words)) / (len(words) - 2) < 0.5


def score(questions: list[Question], replies: list[str], relevance: list[float] | None = None,
          offtopic_threshold: float = OFFTOPIC_THRESHOLD) -> Helpfulness:
    """The figures for one policy's replies (pure); offtopic_share is 0 without `relevance`."""
    if len(questions) != len(replies) or not replies:
        raise ValueError(f"{len(questions)} questions but {len(replies)} replies")
    if relevance is not None and len(relevance) != len(replies):
        raise ValueError(f"{len(replies)} replies but {len(relevance)} relevance scores")
    n = len(replies)
    dup = sum(any(j != i and near_same(r, s) for j, s in enumerate(replies)) for i, r in enumerate(replies))
    off = sum(x < offtopic_threshold for x in relevance) / n if relevance is not None else 0.0
    stated = [q.stated_in(r) for q, r in zip(questions, replies)]
    return Helpfulness(facts_rate=sum(stated) / n, stated=stated,
                       duplicate_share=dup / n, offtopic_share=off, repetitive_share=sum(map(loops, replies)) / n,
                       empty_share=sum(not r.strip() for r in replies) / n, n=n, replies=list(replies))


def relevance(questions: list[Question], replies: list[str], encoder: Any = None) -> list[float]:
    """MiniLM cosine similarity of each question with its reply (an empty reply scores 0)."""
    from clawflow.judge.minilm import MiniLM

    enc = encoder or MiniLM(threads=1)
    q, r = enc.embed([x.prompt for x in questions]), enc.embed([x or " " for x in replies])
    return [0.0 if not text.strip() else float(s) for text, s in zip(replies, (q * r).sum(-1).tolist())]


def greedy_replies(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int,
                   batch_size: int = BATCH_SIZE, deadline: float | None = None) -> list[str]:
    """Greedy replies (chat template, one user message, no system prompt), batched with left
    padding; TimeoutError once `deadline` (time.monotonic()) has passed, checked between batches
    and after every decoded token (so a slow machine stops within one step, not one batch)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Deadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), deadline is not None and time.monotonic() > deadline)

    def late(what: str) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"greedy replies ran out of time {what} ({len(out)} of {len(prompts)} done)")

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: list[str] = []
    try:
        for k in range(0, len(prompts), batch_size):
            late("before a batch")
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False) for p in prompts[k : k + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                     stopping_criteria=StoppingCriteriaList([_Deadline()]))
            late("during a batch")
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return [r.strip() for r in out]


def load_model(model_dir: str | Path):
    """(model, tokenizer) in fp32 eval mode from a full checkpoint or a LoRA adapter directory (base
    + adapter merged: generation then costs what the base's does)."""
    import torch
    from transformers import AutoTokenizer

    from clawflow.policy.loader import load_policy, weights_dir
    from clawflow.policy.packed_linear import pack_if_faster

    path = Path(model_dir)
    model = load_policy(path, torch.float32, merge=True).eval()
    # the serving engine's fp32 kernels where they are faster: SmolLM2-135M's 81 greedy answers came
    # out identical and 1.55x faster (21.7 -> 14.0 s on 2 cores)
    pack_if_faster(model)
    has_tokenizer = any(path.glob("tokenizer*"))
    return model, AutoTokenizer.from_pretrained(path if has_tokenizer else weights_dir(path))


def cache_key(model_dir: str | Path, questions: list[Question], max_new_tokens: int) -> str:
    """What the replies depend on: the checkpoint's real path and its weight files' mtimes (an
    adapter's base's too), the prompts and the token budget. Facts and thresholds only affect
    scoring, which is redone from the cached replies."""
    from clawflow.policy.loader import weights_stamp

    blob = json.dumps([weights_stamp(model_dir), [q.prompt for q in questions], max_new_tokens])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def measure(model_dir: str, questions: list[Question], max_new_tokens: int, deadline: float | None = None,
            threads: int | None = None, *, cache_dir: Path | None = None,
            offtopic_threshold: float = OFFTOPIC_THRESHOLD, batch_size: int = BATCH_SIZE,
            model: Any = None, tokenizer: Any = None, encoder: Any = None) -> Helpfulness:
    """The checkpoint's helpfulness. With `cache_dir`, its replies and their relevance are kept as
    JSON per `cache_key`, so a reference is generated once. `model`/`tokenizer`, when the caller
    already holds `model_dir`'s model, save loading it again; `threads` pins torch's threads for
    the generation (restored after); `deadline` is a time.monotonic() value (TimeoutError)."""
    path = Path(cache_dir) / f"{cache_key(model_dir, questions, max_new_tokens)}.json" if cache_dir else None
    if path is not None and path.is_file():
        raw = json.loads(path.read_text())
        return score(questions, raw["replies"], raw["relevance"], offtopic_threshold)
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if model is None:
            model, tokenizer = load_model(model_dir)
        replies = greedy_replies(model, tokenizer, [q.prompt for q in questions], max_new_tokens, batch_size, deadline)
    finally:
        torch.set_num_threads(before)
    rel = relevance(questions, replies, encoder)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"model_dir": str(model_dir), "max_new_tokens": max_new_tokens,
                                   "replies": replies, "relevance": rel}))
        tmp.replace(path)  # atomic: a concurrent gate reads a whole file or none
    return score(questions, replies, rel, offtopic_threshold)


def verdict(candidate: Helpfulness, references: dict[str, Helpfulness], cfg: Any) -> str | None:
    """Why the candidate answers worse than a reference (`champion`, `base`) or degenerates, as one
    line with the figures; None when it is fine. `cfg` is a HelpfulnessGateConfig."""
    c = candidate
    for name, ref in references.items():
        if c.facts_rate < ref.facts_rate - cfg.margin:
            lost, gained = paired(c, ref)
            return (f"helpfulness fell: key facts stated in {c.facts_rate:.3f} of {c.n} held-out answers "
                    f"vs {ref.facts_rate:.3f} for the {name} (margin {cfg.margin}; {lost} questions lost, "
                    f"{gained} gained)")
    if c.duplicate_share > cfg.max_duplicate_share:
        return (f"degenerate replies: {c.duplicate_share:.3f} of answers repeat another question's answer "
                f"(max {cfg.max_duplicate_share}; facts {c.facts_rate:.3f})")
    if c.repetitive_share > cfg.max_repetitive_share:
        return f"degenerate replies: {c.repetitive_share:.3f} of answers loop (max {cfg.max_repetitive_share})"
    if c.empty_share > cfg.max_empty_share:
        return f"degenerate replies: {c.empty_share:.3f} of answers are empty (max {cfg.max_empty_share})"
    for name, ref in references.items():
        if c.offtopic_share > ref.offtopic_share + cfg.max_offtopic_increase:
            return (f"degenerate replies: {c.offtopic_share:.3f} of answers are unrelated to their question "
                    f"vs {ref.offtopic_share:.3f} for the {name} (allowed +{cfg.max_offtopic_increase})")
    return None
