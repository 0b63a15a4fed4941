"""Does fine-tuning MiniLM itself beat the shipped embedded judge (v2)? Cross-validated on the
*train* split only, with the same folds as `bench/judge_cv.py` (5 folds × 3 shuffles).

The fine-tuned model keeps v2's shape: clauses of the next state, the 64-char request and reply
gists and the exemplars are all embedded by MiniLM, turned into v2's features (nearest exemplar
per class, request/reply cosine, cue flags), and a per-role logistic head classifies. What is new
is that MiniLM's top N layers (fully, or by LoRA) are trained through those features, so the
embedding space learns what feedback looks like, with the head warm-started from v2's fit. At
inference this costs nothing extra: it is the same one encoder call, with other top-layer weights.
One variant (`top1+cls`) also feeds the fine-tuned embedding of the whole next state (384-d) to the
head, the classic "fine-tuned classifier" with the cue features beside it.

Cost on one thread is kept down by running the frozen bottom layers once per text (cached) and
training only the top N layers; exemplars are re-embedded (no gradient) at the start of each
epoch, so the anchors follow the encoder. After training, each role's head is refitted by v2's
L-BFGS `fit` on the fine-tuned features (exactly what `build` would do), except in `+cls`.

    .venv/bin/python bench/judge_finetune_cv.py                 # the default variants (~11 min, 1 thread)
    .venv/bin/python bench/judge_finetune_cv.py --variants top2 --seeds 1
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers.masking_utils import create_bidirectional_mask

sys.path.insert(0, str(Path(__file__).parent))
from judge_cv import SECOND_BATCH, cv_predictions  # noqa: E402 - same folds and v2 baseline

from clawflow.config import JudgeConfig  # noqa: E402
from clawflow.judge.dataset import load_labelled  # noqa: E402
from clawflow.judge.embedded import (GIST_CHARS, L2, ROLES, _paths, _read_exemplars, item_features,  # noqa: E402
                                     reply_text, request_text, shared_encoder, state_text)
from clawflow.judge.features import CLASSES, clauses, cue_flags  # noqa: E402
from clawflow.judge.head import Head, fit  # noqa: E402
from clawflow.judge.minilm import clip, length_batches  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    top: int  # trained top layers of MiniLM's 6
    lora: int = 0  # LoRA rank (0: the top layers are trained fully)
    lr: float = 1e-4
    epochs: int = 3
    cls: bool = False  # the fine-tuned 384-d state embedding also goes to the head


# Fixed before running (standard small-data settings), not tuned: few variants, few epochs (CPU budget).
VARIANTS = {v.name: v for v in [
    Variant("top1", top=1),
    Variant("top2", top=2),
    Variant("top1+cls", top=1, cls=True),
    Variant("top2-lora8", top=2, lora=8, lr=1e-3),  # not in the default run (CPU budget): --variants
]}
DEFAULT = ["top1", "top2", "top1+cls"]
BATCH = 16
HEAD_LR = 1e-2


@dataclass
class Row:
    id: str
    role: str
    texts: list[str]  # clauses (whole text first), then request gist, then reply gist
    cues: torch.Tensor
    label: int


class Cache:
    """Hidden states after MiniLM's frozen bottom layers, per text (computed once)."""

    def __init__(self, encoder, texts: list[str], keep: int):
        tok, model = encoder.tokenizer, encoder.model
        self.model, self.keep = model, keep
        uniq = sorted(set(texts))
        ids = tok([clip(t) for t in uniq], truncation=True, max_length=encoder.max_tokens)["input_ids"]
        self.hidden: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for batch in length_batches([len(x) for x in ids], 32):
                inp, mask = _pad([torch.tensor(ids[j]) for j in batch], tok.pad_token_id or 0)
                states = model(input_ids=inp, attention_mask=mask, output_hidden_states=True).hidden_states
                for row, j in enumerate(batch):
                    self.hidden[uniq[j]] = states[keep][row, : len(ids[j])].clone()

    def embed(self, layers: torch.nn.ModuleList, texts: list[str]) -> torch.Tensor:
        """(len(texts), 384) unit vectors through the trainable top `layers` (mean pooling)."""
        out: list = [None] * len(texts)
        hidden = [self.hidden[t] for t in texts]
        for batch in length_batches([len(h) for h in hidden], 64):
            h, mask = _pad([hidden[j] for j in batch], 0.0)
            attn = create_bidirectional_mask(config=self.model.config, inputs_embeds=h, attention_mask=mask)
            for layer in layers:
                h = layer(h, attn)
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)
            for j, row in zip(batch, pooled):
                out[j] = row
        return torch.stack(out)


def _pad(seqs: list[torch.Tensor], value) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width, *seqs[0].shape[1:]), value, dtype=seqs[0].dtype)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return out, mask


def features(row: Row, emb: torch.Tensor, ex_emb: torch.Tensor, cols: list[list[int]]) -> torch.Tensor:
    """v2's `feature_vector` in differentiable torch; `emb`: this row's text embeddings."""
    k = len(row.texts) - 2
    clause, request, reply = emb[:k], emb[k], emb[k + 1]
    sims = clause @ ex_emb.T
    out = []
    for c in cols:
        block = sims[:, c]
        out += [block.max(), block[0].topk(min(3, len(c))).values.mean()]
    out += [clause[0] @ request, clause[0] @ reply]
    return torch.cat([torch.stack(out), row.cues])


class Model:
    """Trainable top layers + per-role heads, warm-started from v2 (frozen encoder, `fit`)."""

    def __init__(self, cache: Cache, v: Variant, ex_texts: dict, cols: dict, init: dict[str, Head], seed: int):
        torch.manual_seed(seed)
        self.cache, self.v, self.ex_texts, self.cols = cache, v, ex_texts, cols
        self.layers = copy.deepcopy(cache.model.encoder.layer[cache.keep:])
        if v.lora:
            cfg = LoraConfig(r=v.lora, lora_alpha=2 * v.lora, lora_dropout=0.0,
                             target_modules=["query", "key", "value", "dense"])
            self.layers = inject_adapter_in_model(cfg, self.layers)
        for name, p in self.layers.named_parameters():
            p.requires_grad_(not v.lora or "lora_" in name)
        self.heads = {r: Head(*(t.clone().requires_grad_(True) for t in (h.weight, h.bias)), h.mean, h.std)
                      for r, h in init.items()}
        self.emb_w = {r: torch.zeros(384, len(CLASSES), requires_grad=True) for r in ROLES} if v.cls else None
        self.ex_emb = self.exemplars()

    def exemplars(self) -> dict[str, torch.Tensor]:
        self.layers.eval()
        with torch.no_grad():
            return {r: self.cache.embed(self.layers, self.ex_texts[r]) for r in ROLES}

    def forward(self, rows: list[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per row: (features, logits)."""
        texts = [t for r in rows for t in r.texts]
        emb = self.cache.embed(self.layers, texts)
        feats, logits, at = [], [], 0
        for r in rows:
            e = emb[at: at + len(r.texts)]
            at += len(r.texts)
            x = features(r, e, self.ex_emb[r.role], self.cols[r.role])
            h = self.heads[r.role]
            z = ((x - h.mean) / h.std) @ h.weight + h.bias
            if self.emb_w is not None:
                z = z + e[0] @ self.emb_w[r.role]
            feats.append(x)
            logits.append(z)
        return feats, logits

    def train(self, rows: list[Row], seed: int) -> None:
        enc = [p for p in self.layers.parameters() if p.requires_grad]
        head = [t for h in self.heads.values() for t in (h.weight, h.bias)] + list((self.emb_w or {}).values())
        steps = self.v.epochs * -(-len(rows) // BATCH)
        opt = torch.optim.AdamW([{"params": enc, "lr": self.v.lr, "weight_decay": 0.01},
                                 {"params": head, "lr": HEAD_LR, "weight_decay": 0.0}])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
        rng = random.Random(seed)
        for _ in range(self.v.epochs):
            self.ex_emb = self.exemplars()  # anchors follow the encoder, once per epoch
            self.layers.train()
            order = rows[:]
            rng.shuffle(order)
            for i in range(0, len(order), BATCH):
                batch = order[i: i + BATCH]
                _, logits = self.forward(batch)
                y = torch.tensor([CLASSES.index(r.label) for r in batch])
                l2 = sum((h.weight ** 2).sum() for h in self.heads.values())
                l2 = l2 + sum((w ** 2).sum() for w in (self.emb_w or {}).values())
                loss = torch.nn.functional.cross_entropy(torch.stack(logits), y) + L2 * l2 / len(ROLES)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        self.ex_emb = self.exemplars()

    def predict(self, fit_rows: list[Row], test_rows: list[Row]) -> dict[str, int]:
        self.layers.eval()
        with torch.no_grad():
            test_x, logits = self.forward(test_rows)
            if self.v.cls:  # the jointly trained head is the classifier
                return {r.id: CLASSES[int(z.argmax())] for r, z in zip(test_rows, logits)}
            fit_x, _ = self.forward(fit_rows)
        out = {}
        for role in ROLES:  # refit as `build` would: v2's L-BFGS head on the fine-tuned features
            fr = [(x, r) for x, r in zip(fit_x, fit_rows) if r.role == role]
            tr = [(x, r) for x, r in zip(test_x, test_rows) if r.role == role]
            if tr:
                h = fit(torch.stack([x for x, _ in fr]), [r.label for _, r in fr], L2)
                out.update(zip([r.id for _, r in tr], h.predict(torch.stack([x for x, _ in tr]))))
        return out


def folds(n: int, k: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(fit, held) indices: the same shuffle and folds as `judge_cv.cv_predictions`."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    out = []
    for fold in range(k):
        held = set(order[fold::k])
        out.append(([i for i in order if i not in held], sorted(held)))
    return out


def score(pred: dict[str, int], rows: list[Row]) -> tuple[float, float]:
    second = [r for r in rows if SECOND_BATCH.match(r.id)]
    acc = sum(pred[r.id] == r.label for r in rows) / len(rows)
    return acc, sum(pred[r.id] == r.label for r in second) / len(second)


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=DEFAULT, choices=list(VARIANTS))
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    start = time.perf_counter()
    _, exemplars_path, labelled_path = _paths(JudgeConfig())
    encoder = shared_encoder()
    exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
    ex_texts = {r: [e["text"] for e in exemplars[r]] for r in ROLES}
    cols = {r: [[i for i, e in enumerate(exemplars[r]) if e["label"] == c] for c in CLASSES] for r in ROLES}
    ex_frozen = {r: encoder.embed(ex_texts[r]) for r in ROLES}
    train = load_labelled(labelled_path, "train")
    rows, v2_rows = [], []
    for item in train:
        role, text, x = item_features(encoder, exemplars, ex_frozen, item.input)
        texts = clauses(text) + [request_text(item.input)[:GIST_CHARS], reply_text(item.input)[:GIST_CHARS]]
        rows.append(Row(item.id, role, texts, torch.tensor(cue_flags(role, text)), item.label))
        v2_rows.append((item.id, role, x[0], item.label))
    n_second = sum(bool(SECOND_BATCH.match(r.id)) for r in rows)
    print(f"train split: {len(rows)} items ({n_second} of the second batch); {args.folds}-fold CV × {args.seeds} "
          f"seeds, torch threads {torch.get_num_threads()}")
    caches: dict[int, Cache] = {}
    all_texts = [t for r in rows for t in r.texts] + [t for r in ROLES for t in ex_texts[r]]
    results = {}
    v2 = [cv_predictions(v2_rows, L2, args.folds, s) for s in range(args.seeds)]
    results["v2 (shipped)"] = [score(p, rows) for p in v2]
    for name in args.variants:
        v = VARIANTS[name]
        keep = encoder.model.config.num_hidden_layers - v.top
        if keep not in caches:
            caches[keep] = Cache(encoder, all_texts, keep)
        cache = caches[keep]
        if name == args.variants[0]:  # the differentiable features reproduce v2's exactly before training
            init = {r: fit(torch.stack([x for _, role, x, _ in v2_rows if role == r]),
                           [y for _, role, _, y in v2_rows if role == r], L2) for r in ROLES}
            got, _ = Model(cache, v, ex_texts, cols, init, 0).forward(rows)
            diff = max(float((a.detach() - b[2]).abs().max()) for a, b in zip(got, v2_rows))
            assert diff < 1e-4, f"differentiable features differ from v2's by {diff}"
        t0, accs = time.perf_counter(), []
        for seed in range(args.seeds):
            pred: dict[str, int] = {}
            for f, (fit_idx, held_idx) in enumerate(folds(len(rows), args.folds, seed)):
                fit_rows, test_rows = [rows[i] for i in fit_idx], [rows[i] for i in held_idx]
                init = {r: fit(torch.stack([v2_rows[i][2] for i in fit_idx if rows[i].role == r]),
                               [rows[i].label for i in fit_idx if rows[i].role == r], L2) for r in ROLES}
                model = Model(cache, v, ex_texts, cols, init, 1000 * seed + f)
                model.train(fit_rows, 1000 * seed + f)
                pred.update(model.predict(fit_rows, test_rows))
            accs.append(score(pred, rows))
            print(f"  {name} seed {seed}: CV {accs[-1][0]:.3f}  second batch {accs[-1][1]:.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        results[name] = accs
    print(f"\n| variant (train split of {len(rows)}) | CV | second batch | seeds |\n|---|---|---|---|")
    for name, accs in results.items():
        cv, sb = (sum(a[i] for a in accs) / len(accs) for i in (0, 1))
        print(f"| {name} | {cv:.3f} | {sb:.3f} | {' '.join(f'{a[0]:.3f}' for a in accs)} |")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
