"""Cross-validated accuracy of the embedded judge on the *train* split only: how its features,
exemplars, reader and regularization were chosen without looking at the test split.

Each train item is featurized once (the expensive part, production code: `train_rows`), then for
every seed the items are shuffled into k folds and the per-role stacked heads are refitted on k−1
folds (production code: `fit_stacked`, whose own inner folds give the reader probe's out-of-fold
probabilities) and scored on the held-out one. Printed: mean CV accuracy over seeds (and each
seed), per role, and per later batch of the labelled set (`…2-` and `…3-` ids), whose authors never
saw the exemplars: the more honest figures. `--no-reader` scores v2 (MiniLM features alone).

    .venv/bin/python bench/judge_cv.py                          # 5 folds × 3 seeds, shipped settings
    .venv/bin/python bench/judge_cv.py --l2 0.01 0.03 --l2-reader 0.01 0.03 0.1
    .venv/bin/python bench/judge_cv.py --layers 10 14 18        # the reader's depth
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch

from clawflow.config import JudgeConfig
from clawflow.judge.dataset import load_labelled
from clawflow.judge.embedded import (
    L2,
    L2_READER,
    ROLES,
    STACK_FOLDS,
    _paths,
    _read_exemplars,
    shared_encoder,
    shared_reader,
    state_text,
    train_rows,
)
from clawflow.judge.head import fit
from clawflow.judge.stack import fit_stacked, stacked_probs

BATCHES = {f"{n}": re.compile(rf"^[a-z]+{d}-\d+$") for n, d in (("second", 2), ("third", 3), ("fourth", 4))}


def cv_predictions(rows: list, l2: float, l2_reader: float | None, k: int, seed: int) -> dict[str, int]:
    """Out-of-fold prediction for each item id; rows are (id, role, x, reader x, label).
    `l2_reader` None: the MiniLM head alone (v2)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    out: dict[str, int] = {}
    for fold in range(k):
        held = set(order[fold::k])
        for role in ROLES:
            fit_rows = [rows[i] for i in order if i not in held and rows[i][1] == role]
            test_rows = [rows[i] for i in sorted(held) if rows[i][1] == role]
            if not test_rows:
                continue
            x, y = torch.stack([r[2] for r in fit_rows]), [r[4] for r in fit_rows]
            tx = torch.stack([r[2] for r in test_rows])
            if l2_reader is None:
                probs = fit(x, y, l2).probs(tx)
            else:
                probe, head = fit_stacked(x, torch.stack([r[3] for r in fit_rows]), y, l2, l2_reader, STACK_FOLDS)
                probs = stacked_probs(probe, head, tx, torch.stack([r[3] for r in test_rows]))
            out.update(zip([r[0] for r in test_rows], [(-1, 0, 1)[i] for i in probs.argmax(-1).tolist()]))
    return out


def report(rows: list, l2: float, l2_reader: float | None, args, texts: dict[str, str]) -> None:
    labels = {r[0]: r[4] for r in rows}
    accs, per_role, wrong = [], {r: [0, 0] for r in ROLES}, {}
    per_batch = {b: [0, 0] for b in BATCHES}
    for seed in range(args.seeds):
        pred = cv_predictions(rows, l2, l2_reader, args.folds, seed)
        accs.append(sum(pred[i] == y for i, y in labels.items()) / len(labels))
        for iid, role, _, _, y in rows:
            per_role[role][0] += pred[iid] == y
            per_role[role][1] += 1
            for b, rx in BATCHES.items():
                if rx.match(iid):
                    per_batch[b][0] += pred[iid] == y
                    per_batch[b][1] += 1
            if pred[iid] != y:
                wrong[iid] = pred[iid]
    roles = "  ".join(f"{r} {a / n:.3f}" for r, (a, n) in per_role.items())
    batches = "  ".join(f"{b} batch {a / max(n, 1):.3f}" for b, (a, n) in per_batch.items())
    name = "v2 (no reader)" if l2_reader is None else f"reader l2 {l2_reader}"
    print(f"l2 {l2:<5} {name:<17} CV accuracy {sum(accs) / len(accs):.3f} "
          f"(seeds: {' '.join(f'{a:.3f}' for a in accs)})  {roles}  {batches}", flush=True)
    if args.mistakes:
        for iid, p in sorted(wrong.items()):
            print(f"  mistake {iid} label {labels[iid]:+d} judged {p:+d} {texts[iid]!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--l2", type=float, nargs="+", default=[L2])
    ap.add_argument("--l2-reader", type=float, nargs="+", default=[L2_READER])
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="reader depths to compare")
    ap.add_argument("--no-reader", action="store_true", help="also score the MiniLM head alone (v2)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--mistakes", action="store_true", help="print the train items misjudged out of fold")
    args = ap.parse_args()
    cfg = JudgeConfig()
    _, exemplars_path, labelled_path = _paths(cfg)
    encoder = shared_encoder()
    exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
    emb = {r: encoder.embed([e["text"] for e in exemplars[r]]) for r in ROLES}
    for layers in args.layers or [cfg.embedded.reader_layers]:
        cfg.embedded.reader_layers = layers
        start = time.perf_counter()
        rows = train_rows(encoder, shared_reader(cfg), exemplars, emb, labelled_path)
        texts = {i.id: state_text(i.input)[:80] for i in load_labelled(labelled_path, "train")}
        counts = "  ".join(f"{sum(bool(rx.match(r[0])) for r in rows)} of the {b} batch" for b, rx in BATCHES.items())
        print(f"train split: {len(rows)} items ({counts}); reader: {layers} layers; {args.folds}-fold CV × "
              f"{args.seeds} seeds; features in {time.perf_counter() - start:.0f} s", flush=True)
        if args.no_reader:
            for l2 in args.l2:
                report(rows, l2, None, args, texts)
        for l2 in args.l2:
            for l2r in args.l2_reader:
                report(rows, l2, l2r, args, texts)


if __name__ == "__main__":
    main()
