"""Labelled judge items (JSONL) and their fixed train/test split.

One item per line:
    {"id": "pa-001", "context": [messages], "reply": "...", "tool_calls": [...] (optional),
     "next_state": {"role": "user"|"tool", "content": "..."}, "label": 1|-1|0, "hint": "..." (optional)}

The split is a pure function of the item's `id` (sha256 mod 10 < 3 → test, ~30 %), fixed before
any tuning, so the held-out figure is honest and reproducible: the embedded judge trains only on
`train` items (plus `configs/judge/exemplars.jsonl`), and `clawflow judge-eval --split test`
reports held-out accuracy. Items without an `id` fall back to a hash of their line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from clawflow.judge.base import JudgeInput

Split = Literal["train", "test", "all"]
TEST_FRACTION_TENTHS = 3


class DatasetError(ValueError):
    """A labelled file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class LabelledItem:
    id: str
    input: JudgeInput
    label: int
    hint: str | None = None

    @property
    def split(self) -> str:
        return split_of(self.id)


def split_of(item_id: str) -> str:
    digest = int(hashlib.sha256(item_id.encode()).hexdigest(), 16)
    return "test" if digest % 10 < TEST_FRACTION_TENTHS else "train"


def parse_item(raw: Any, fallback_id: str) -> LabelledItem:
    if not isinstance(raw, dict):
        raise ValueError("each line must be a JSON object")
    missing = [k for k in ("context", "reply", "next_state", "label") if k not in raw]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    nxt, context = raw["next_state"], raw["context"]
    if not isinstance(nxt, dict) or nxt.get("role") not in ("user", "tool") or not isinstance(nxt.get("content"), str):
        raise ValueError('next_state must be {"role": "user"|"tool", "content": "..."}')
    if not isinstance(context, list) or not all(isinstance(m, dict) for m in context):
        raise ValueError("context must be a list of message objects")
    if raw["label"] not in (-1, 0, 1) or isinstance(raw["label"], bool):
        raise ValueError(f"label must be 1, -1 or 0, not {raw['label']!r}")
    turn: dict[str, Any] = {"role": "assistant", "content": raw["reply"]}
    if raw.get("tool_calls"):
        turn["tool_calls"] = raw["tool_calls"]
    item = JudgeInput(context=context, turn=turn, next_state=[dict(nxt)], next_role=nxt["role"])
    hint = raw.get("hint") or None
    return LabelledItem(str(raw.get("id") or fallback_id), item, raw["label"], hint)


def load_labelled(path: str | Path, split: Split = "all") -> list[LabelledItem]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            items.append(parse_item(json.loads(line), hashlib.sha256(line.encode()).hexdigest()[:12]))
        except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise DatasetError(f"{path}:{n}: {exc}") from None
    if not items:
        raise DatasetError(f"{path}: no items")
    return items if split == "all" else [i for i in items if i.split == split]
