"""Cross-validated accuracy of the embedded judge on the *train* split only: how its features,
exemplars and regularization were chosen without looking at the test split.

Each train item is embedded once (the expensive part, production code: `item_features`), then for
every seed the items are shuffled into k folds and the per-role heads are refitted on k−1 folds
and scored on the held-out one. Printed: mean CV accuracy over seeds (and each seed), per role,
and on the items added in the second batch of the labelled set (ids `pa2-…`, `code2-…`, `tool2-…`,
`misc2-…`), which the exemplars' author never saw.

    .venv/bin/python bench/judge_cv.py                     # 5 folds × 3 seeds at the shipped L2
    .venv/bin/python bench/judge_cv.py --l2 0.01 0.03 0.1  # compare regularization strengths
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch

from clawflow.config import JudgeConfig
from clawflow.judge.dataset import load_labelled
from clawflow.judge.embedded import L2, ROLES, _paths, _read_exemplars, item_features, shared_encoder
from clawflow.judge.head import fit

SECOND_BATCH = re.compile(r"^[a-z]+2-\d+$")


def cv_predictions(rows: list[tuple[str, str, torch.Tensor, int]], l2: float, k: int, seed: int) -> dict[str, int]:
    """Out-of-fold prediction for each item id; rows are (id, role, (f,) features, label)."""
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
            head = fit(torch.stack([r[2] for r in fit_rows]), [r[3] for r in fit_rows], l2)
            out.update(zip([r[0] for r in test_rows], head.predict(torch.stack([r[2] for r in test_rows]))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--l2", type=float, nargs="+", default=[L2])
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--mistakes", action="store_true", help="print the train items misjudged out of fold")
    args = ap.parse_args()
    _, exemplars_path, labelled_path = _paths(JudgeConfig())
    encoder = shared_encoder()
    exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
    emb = {r: encoder.embed([e["text"] for e in exemplars[r]]) for r in ROLES}
    train = load_labelled(labelled_path, "train")
    start = time.perf_counter()
    rows = []
    for item in train:
        role, _, x = item_features(encoder, exemplars, emb, item.input)
        rows.append((item.id, role, x[0], item.label))
    labels = {r[0]: r[3] for r in rows}
    texts = {i.id: str(i.input.next_state[0].get("content"))[:80] for i in train}
    second = [r[0] for r in rows if SECOND_BATCH.match(r[0])]
    print(f"train split: {len(rows)} items ({len(second)} of the second batch); {args.folds}-fold CV × "
          f"{args.seeds} seeds; features in {time.perf_counter() - start:.0f} s")
    for l2 in args.l2:
        accs, per_role, on_second, wrong = [], {r: [0, 0] for r in ROLES}, [0, 0], {}
        for seed in range(args.seeds):
            pred = cv_predictions(rows, l2, args.folds, seed)
            accs.append(sum(pred[i] == y for i, y in labels.items()) / len(labels))
            for iid, role, _, y in rows:
                per_role[role][0] += pred[iid] == y
                per_role[role][1] += 1
                if iid in second:
                    on_second[0] += pred[iid] == y
                    on_second[1] += 1
                if pred[iid] != y:
                    wrong[iid] = pred[iid]
        roles = "  ".join(f"{r} {a / n:.3f}" for r, (a, n) in per_role.items())
        print(f"l2 {l2:<6} CV accuracy {sum(accs) / len(accs):.3f} (seeds: {' '.join(f'{a:.3f}' for a in accs)})  "
              f"{roles}  second batch {on_second[0] / max(on_second[1], 1):.3f}")
        if args.mistakes:
            for iid, p in sorted(wrong.items()):
                print(f"  mistake {iid} label {labels[iid]:+d} judged {p:+d} {texts[iid]!r}")


if __name__ == "__main__":
    main()
