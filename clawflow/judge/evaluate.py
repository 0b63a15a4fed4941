"""`clawflow judge-eval`: score a labelled JSONL set with a judge and report how often it agrees.

Prints the confusion matrix (rows: label, columns: judgment), the hint rate, and as its last line
`accuracy: 0.93 (186/200)`, so scripts can `tail -1`. A turn the judge could not answer
(endpoint down, budget spent) counts as wrong and is reported as unjudged.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from clawflow.judge.base import Judge, judge_many
from clawflow.judge.dataset import LabelledItem
from clawflow.judge.features import CLASSES


@dataclass
class EvalReport:
    judge: str
    n: int
    correct: int
    confusion: Counter = field(default_factory=Counter)  # (label, score or None) → count
    hints: int = 0  # judgments that carried a hint
    hinted_labels: int = 0  # items whose label has a hint
    hinted_both: int = 0  # … of which the judge also gave one
    unjudged: int = 0
    seconds: float = 0.0
    mistakes: list[tuple[str, int, int | None]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def evaluate(judge: Judge, items: list[LabelledItem], concurrency: int = 8) -> EvalReport:
    start = time.perf_counter()
    judgments = asyncio.run(judge_many(judge, [i.input for i in items], concurrency))
    report = EvalReport(getattr(judge, "name", type(judge).__name__), len(items), 0,
                        seconds=time.perf_counter() - start)
    for item, j in zip(items, judgments):
        score = None if j is None else j.score
        report.confusion[(item.label, score)] += 1
        report.unjudged += j is None
        report.correct += score == item.label
        report.hints += bool(j and j.hint)
        report.hinted_labels += bool(item.hint)
        report.hinted_both += bool(item.hint and j and j.hint)
        if score != item.label:
            report.mistakes.append((item.id, item.label, score))
    return report


def format_report(r: EvalReport, show_mistakes: bool = False) -> str:
    def fmt(v):
        return f"{v:+d}" if v else "0"

    lines = [f"judge: {r.judge}   items: {r.n}   {1000 * r.seconds / max(r.n, 1):.1f} ms/item",
             "confusion (rows: label, columns: judgment):",
             "label " + "".join(f"{fmt(c):>6}" for c in CLASSES) + ("  unjudged" if r.unjudged else "")]
    for label in CLASSES:
        row = "".join(f"{r.confusion[(label, c)]:>6}" for c in CLASSES)
        lines.append(f"{fmt(label):>5} {row}" + (f"{r.confusion[(label, None)]:>10}" if r.unjudged else ""))
    lines.append(f"hint rate: {r.hints / max(r.n, 1):.2f} ({r.hints}/{r.n}); labelled hints covered: "
                 f"{r.hinted_both}/{r.hinted_labels}")
    if r.unjudged:
        lines.append(f"unjudged (judge unavailable): {r.unjudged}")
    if show_mistakes:
        lines += [f"mistake: {i} label {fmt(lab)} judged {'-' if s is None else fmt(s)}" for i, lab, s in r.mistakes]
    lines.append(f"accuracy: {r.accuracy:.2f} ({r.correct}/{r.n})")
    return "\n".join(lines)


def run_eval(cfg, path, backend: str | None = None, split: str = "all", show_mistakes: bool = False) -> str:
    """`clawflow judge-eval`: the report text; ValueError/RuntimeError carry one-line messages."""
    from clawflow.judge import BACKENDS, make_judge
    from clawflow.judge.dataset import load_labelled

    if split not in ("all", "train", "test"):
        raise ValueError(f"--split must be all, train or test, not {split!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown judge {backend!r} (choose from {', '.join(BACKENDS)})")
    items = load_labelled(path, split)  # DatasetError is a ValueError
    if not items:
        raise ValueError(f"{path}: no items in split {split!r}")
    judge = make_judge(cfg, backend)
    return format_report(evaluate(judge, items, cfg.judge.concurrency), show_mistakes)
