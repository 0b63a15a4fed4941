"""Judge accuracy and per-turn latency on the shipped labelled set, side by side against the
`rules` baseline (the lexical judge), in one run.

Accuracy is on the held-out `test` split (fixed by item id before any tuning; the embedded head
never saw it). Latency is one turn at a time (what a flow pays per turn), after a warm-up, at the
torch thread counts given; the model load is reported separately.

    .venv/bin/python bench/judge.py                # embedded vs rules, 1 and 2 torch threads
    .venv/bin/python bench/judge.py --repeat 3     # more latency samples
    .venv/bin/python bench/judge.py --latency-only --layers 10 12 14   # on train items: no test look
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import time

import torch

from clawflow.config import REPO_ROOT, JudgeConfig
from clawflow.judge import RuleJudge
from clawflow.judge.dataset import load_labelled
from clawflow.judge.evaluate import evaluate

LABELLED = REPO_ROOT / "configs" / "judge" / "labelled.jsonl"
BATCH = re.compile(r"^[a-z]+?([234])?-\d+$")  # `…2-`, `…3-`: later batches (configs/judge/README.md)


def latencies(judge, items, repeat: int) -> tuple[list[float], list[float]]:
    """Per-turn wall and CPU milliseconds. On a shared machine wall time includes waiting for a
    core; at one torch thread, CPU time is what the turn costs on a quiet one."""
    asyncio.run(judge(items[0].input))  # warm-up
    wall, cpu = [], []
    for _ in range(repeat):
        for item in items:
            w, c = time.perf_counter(), time.process_time()
            asyncio.run(judge(item.input))
            wall.append(1000 * (time.perf_counter() - w))
            cpu.append(1000 * (time.process_time() - c))
    return wall, cpu


def batched_ms(judge, items, size: int) -> float:
    """Per-turn wall milliseconds when `judge_many` hands the judge `size` turns at a time (how the
    training flow judges a batch of turns)."""
    from clawflow.judge import judge_many

    start = time.perf_counter()
    asyncio.run(judge_many(judge, [i.input for i in items], size))
    return 1000 * (time.perf_counter() - start) / len(items)


def latency_only(args) -> None:
    """Per-turn cost at each reader depth, on train items, so choosing the depth never looks at
    the test split."""
    from clawflow.judge.embedded import EmbeddedJudge

    items = load_labelled(LABELLED, "train")[:150]
    for layers in args.layers:
        for threads in args.threads:
            cfg = JudgeConfig()
            cfg.embedded.reader_layers, cfg.embedded.threads = layers, threads
            judge = EmbeddedJudge(cfg)
            wall, cpu = latencies(judge, items, args.repeat)
            print(f"reader {layers} layers, {threads} thread(s) per encoder: wall median "
                  f"{statistics.median(wall):.1f} ms, p90 {statistics.quantiles(wall, n=10)[-1]:.1f} ms, "
                  f"cpu median {statistics.median(cpu):.1f} ms; batches of 8: {batched_ms(judge, items, 8):.1f} ms "
                  f"per turn ({len(items)} train items)", flush=True)


def row(name: str, report, ms: tuple[list[float], list[float]], baseline_ms: float | None) -> str:
    wall, cpu = ms
    med, p90, cpu_med = statistics.median(wall), statistics.quantiles(wall, n=10)[-1], statistics.median(cpu)
    ratio = f"{med / baseline_ms:8.0f}x" if baseline_ms else "     1.0x"
    return (f"{name:<22} {report.accuracy:>8.3f} {report.correct:>4}/{report.n:<4} {med:>9.1f} {p90:>9.1f} "
            f"{cpu_med:>9.1f} {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=8, help="turns per batch for the batched figure")
    ap.add_argument("--latency-only", action="store_true", help="cost per reader depth on train items")
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 12, 14])
    args = ap.parse_args()
    if args.latency_only:
        return latency_only(args)
    test = load_labelled(LABELLED, "test")
    print(f"held-out split: {len(test)} of {len(load_labelled(LABELLED))} items "
          f"({sum(i.input.next_role == 'tool' for i in test)} tool results); torch {torch.__version__}")
    print(f"{'judge':<22} {'accuracy':>8} {'correct':>9} {'ms median':>9} {'ms p90':>9} {'cpu ms':>9} {'vs rules':>9}")
    rules = RuleJudge()
    base_ms = latencies(rules, test, args.repeat)
    print(row("rules (baseline)", evaluate(rules, test), base_ms, None))
    base = statistics.median(base_ms[0])

    from clawflow.judge.embedded import EmbeddedJudge

    start = time.perf_counter()
    embedded = EmbeddedJudge(JudgeConfig())
    load_s = time.perf_counter() - start
    for threads in args.threads:
        # judge.embedded.threads (default 1): per encoder; MiniLM and the reader run at once
        embedded.cfg.embedded.threads = embedded.encoder.threads = embedded.reader.threads = threads
        ms = latencies(embedded, test, args.repeat)
        print(row(f"embedded ({threads} thread{'s' if threads > 1 else ''})", evaluate(embedded, test), ms, base))
        print(f"  the same, {args.batch} turns at a time (judge_many, as the flow judges): "
              f"{batched_ms(embedded, test, args.batch):.1f} ms per turn")
    for batch in ("1", "2", "3", "4"):
        mine = [i for i in test if ((m := BATCH.match(i.id)) and (m.group(1) or "1")) == batch]
        r = evaluate(embedded, mine)
        print(f"embedded on batch {batch}'s {len(mine)} test items: {r.accuracy:.3f} ({r.correct}/{r.n})")
    print(f"embedded judge load (MiniLM + reader + heads): {load_s:.1f} s; load average now "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
