"""From samples to a run plan: which samples train, with what per-sample terms, in which steps.

Everything here is decided once, before the first forward pass, identically on every rank (no
communication): the per-sample RL advantage and staleness weight, the teacher prompt, and the
split into optimizer steps by a budget of response tokens (gradient accumulation), each step
divided over ranks and micro-batches. The plan is the same every epoch (one seeded shuffle), so
a sample stays on the same rank and a resumed run replays exactly the remaining steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from clawflow.config import TrainConfig
from clawflow.train.batch import Sample, collate, load_samples
from clawflow.train.launch import EXIT_NO_SAMPLES
from clawflow.train.objective import Objective, sample_advantages
from clawflow.train.rehearsal import load_rehearsal, pair_with_hints
from clawflow.train.teacher import chat_prompt_ids, teacher_prompt_ids


class InputError(Exception):
    """Bad arguments or inputs; `code` is the process exit status."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Item:
    """One trainable sample, ready to collate."""

    index: int  # position in the sample file
    prompt: list[int]
    response: list[int]
    rollout: list[float]
    rl_adv: float
    weight: float
    teacher_prompt: list[int] | None  # hint-augmented prompt; None = no OPD term / no rewrite
    rewrite: bool = False  # distill: `response` is replaced by the hinted policy's reply before training
    request: str = ""  # distill: the last user message's text (a rewrite must still answer it)
    facts: tuple[str, ...] = ()  # rehearsal: a rewrite must state one of these (helpfulness.Question)
    hint: str = ""  # distill: the hint in `teacher_prompt`, and what it was built from (to rebuild it with another)
    messages: list | None = None
    tools: list | None = None
    broad: bool = False  # a general prompt distilling the standing preferences (broad_items)


def prepare_items(cfg: TrainConfig, objective: Objective, samples: list[Sample], tokenizer,
                  parent_version: int, preferences: list[dict] | None = None,
                  broad_seed: int = 0) -> tuple[list[Item], dict[str, int]]:
    """The trainable items and counts of what was left out and why. With standing `preferences`
    (the flow's `--preferences` file: the user's active ones, strongest first), every rewrite and
    rehearsal reads them, and `train.broad_prompts` general prompts distil them (`broad_items`)."""
    taught = teaching(preferences, cfg.max_preferences)
    if not samples:
        broad = broad_items(cfg, taught, tokenizer, 0, broad_seed) if objective.rewrites else []
        return broad, {"samples": 0, "broad": len(broad)}
    gids: dict[str, int] = {}
    group = torch.tensor([gids.setdefault(s.group_id, len(gids)) if s.group_id else -1 for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    versions = torch.tensor([s.policy_version for s in samples], dtype=torch.long)
    rl_adv, weight = sample_advantages(cfg, rewards, group, versions, parent_version)
    hinted = torch.tensor([bool(s.hint and s.messages) and objective.uses_hints for s in samples])
    # Only a reply judged bad is rewritten (it then replaces the recorded reply: no RL term on it). A
    # hint on a good turn is the user moving on ("Thanks. Next: ..."): a rewrite with it in the
    # prompt answers the *next* question, and the student would learn to answer off-topic.
    rewrite = hinted & objective.rewrites & (rewards < 0)
    rl_adv = torch.where(rewrite, torch.zeros_like(rl_adv), rl_adv)
    active = objective.active(rl_adv, hinted & objective.needs_teacher, weight, rewrite) \
        & torch.tensor([bool(s.response_token_ids) for s in samples])
    items = []
    for i, s in enumerate(samples):
        if not active[i]:
            continue
        uses = bool(hinted[i]) and (objective.needs_teacher or bool(rewrite[i]))
        in_system = bool(rewrite[i]) and cfg.rewrite_hint == "system"  # OPD's teacher keeps OpenClaw-RL's format
        teacher = teacher_prompt_ids(tokenizer, s.messages, s.hint, s.tools, in_system=in_system) if uses else None
        items.append(Item(i, s.prompt_token_ids, s.response_token_ids, s.response_logprobs,
                          float(rl_adv[i]), float(weight[i]), teacher, bool(rewrite[i]),
                          last_user_text(s.messages) if rewrite[i] else "",
                          hint=s.hint or "", messages=s.messages if rewrite[i] else None, tools=s.tools))
    run_hints = [taught] if taught else [s.hint for i, s in enumerate(samples) if rewrite[i] and active[i]]
    rehearsed = rehearsal_items(cfg, run_hints, tokenizer, len(samples), parent_version) if objective.rewrites else []
    broad = broad_items(cfg, taught, tokenizer, len(samples) + len(rehearsed), broad_seed) \
        if objective.rewrites else []
    counts = {"samples": len(samples), "trainable": len(items), "with_hint": int(hinted.sum()),
              "hint_without_messages": sum(1 for s in samples if s.hint and not s.messages),
              "stale_dropped": int((weight == 0).sum()), "rehearsal": len(rehearsed), "broad": len(broad)}
    return items + rehearsed + broad, counts


def next_run_items(cfg: TrainConfig, base: Path, parent_version: int, preferences: list[dict],
                   broad_seed: int) -> list[Item]:
    """What a run from `base` (registry version `parent_version`) with these standing preferences
    rewrites whatever its batch holds: the rehearsal and the general prompts (`recipe --prepare`)."""
    taught = teaching(preferences, cfg.max_preferences)
    if not taught or not Objective.from_config(cfg).rewrites:
        return []
    from clawflow.policy.loader import tokenizer_for

    tokenizer = tokenizer_for(base)
    rehearsed = rehearsal_items(cfg, [taught], tokenizer, 0, parent_version)
    return rehearsed + broad_items(cfg, taught, tokenizer, len(rehearsed), broad_seed)


def teaching(preferences: list[dict] | None, limit: int) -> str:
    """The words the teacher reads for standing `preferences` (each a dict with `text`)."""
    from clawflow.prefs.update import teacher_text

    return teacher_text([p["text"] for p in preferences or []], limit)


def broad_items(cfg: TrainConfig, taught: str, tokenizer, first_index: int, seed: int) -> list[Item]:
    """`train.broad_prompts` general prompts, a fresh sample per run (`seed`), each to be answered by
    the policy with the standing preferences in its system prompt and learned from the plain prompt:
    the preferences reach prompts the user never asked about (context distillation, Snell et al.
    2022). No key facts to check: a rewrite must only say something and answer its prompt."""
    if not cfg.broad_prompts or not taught or tokenizer is None:
        return []
    from clawflow.train.prompts import load_prompts, sample_prompts

    chosen = sample_prompts(load_prompts(cfg.broad_prompts_file), cfg.broad_prompts, seed)
    out = []
    for k, p in enumerate(chosen):
        messages = [{"role": "user", "content": p.prompt}]
        hinted = teacher_prompt_ids(tokenizer, messages, taught, in_system=True)
        out.append(Item(first_index + k, chat_prompt_ids(tokenizer, messages), [], [], 0.0, 1.0, hinted, True,
                        p.prompt, (), hint=taught, messages=messages, broad=True))
    return out


def rehearsal_items(cfg: TrainConfig, hints: list[str], tokenizer, first_index: int, parent_version: int) -> list[Item]:
    """`train.rehearsal` general questions, each to be answered by the policy with one of this run's
    correction hints in its prompt and learned from the plain prompt (train/rehearsal.py)."""
    if not cfg.rehearsal or not hints or tokenizer is None:
        return []
    pairs = pair_with_hints(load_rehearsal(cfg.rehearsal_prompts), hints, cfg.rehearsal, cfg.seed + parent_version)
    out = []
    for k, (q, hint) in enumerate(pairs):
        messages = [{"role": "user", "content": q.prompt}]
        hinted = teacher_prompt_ids(tokenizer, messages, hint, in_system=cfg.rewrite_hint == "system")
        out.append(Item(first_index + k, chat_prompt_ids(tokenizer, messages), [], [], 0.0, 1.0, hinted, True,
                        q.prompt, tuple(q.facts), hint=hint, messages=messages))
    return out


def last_user_text(messages: list[dict] | None) -> str:
    """The text of the last user message (content parts joined)."""
    for m in reversed(messages or []):
        if m.get("role") == "user":
            c = m.get("content")
            return c if isinstance(c, str) else " ".join(p.get("text", "") for p in c or [] if isinstance(p, dict))
    return ""


def load_items(cfg: TrainConfig, batch: Path, base: Path, parent_version: int,
               preferences: list[dict] | None = None, broad_seed: int = 0) -> tuple[list[Item], dict, list[str]]:
    """Read the sample file and prepare its trainable items; InputError when there are none."""
    if not batch.is_file():
        raise InputError(f"batch file not found: {batch}")
    samples = load_samples(batch)
    objective = Objective.from_config(cfg)
    tokenizer = None
    if objective.uses_hints and (any(s.hint for s in samples) or preferences):  # the base's chat template
        from clawflow.policy.loader import tokenizer_for

        tokenizer = tokenizer_for(base)
    items, counts = prepare_items(cfg, objective, samples, tokenizer, parent_version, preferences, broad_seed)
    if not items:
        raise InputError(f"no trainable samples in {batch}: {len(samples)} rows, none with a non-zero advantage "
                         f"or a hint for objective {cfg.objective!r} ({counts})", code=EXIT_NO_SAMPLES)
    return items, counts, [s.turn_id for s in samples if s.turn_id]


def plan_steps(items: list[Item], step_tokens: int, seed: int) -> list[list[int]]:
    """Optimizer steps as lists of item positions: one seeded shuffle, then greedy packing up to
    `step_tokens` response tokens per step (a longer sample gets a step of its own)."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    steps: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        n = len(items[i].response)
        if current and tokens + n > step_tokens:
            steps.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        steps.append(current)
    return steps


def rank_micro_batches(step: list[int], rank: int, world: int, micro_batch: int) -> list[list[int]]:
    """This rank's share of a step in micro-batches; every rank gets the same number of them
    (empty ones are padding: FSDP needs every rank in every forward and backward)."""
    share = step[rank::world]
    n = math.ceil(math.ceil(len(step) / world) / micro_batch)
    micros = [share[k * micro_batch : (k + 1) * micro_batch] for k in range(n)]
    return micros


def collate_items(items: list[Item], pad_id: int) -> dict:
    """`collate` plus the per-sample terms the objective reads (rl_adv, weight, has_hint [B])."""
    b = collate([it.prompt for it in items], [it.response for it in items], pad_id, [it.rollout for it in items])
    b["rl_adv"] = torch.tensor([it.rl_adv for it in items])
    b["weight"] = torch.tensor([it.weight for it in items])
    b["has_hint"] = torch.tensor([it.teacher_prompt is not None and not it.rewrite for it in items])
    b["rewrite"] = torch.tensor([it.rewrite for it in items])
    b["items"] = items
    return b
