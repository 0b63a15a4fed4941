"""Does fine-tuning the reader's top layers beat the frozen reader? Cross-validated on the *train*
split only, with the same folds as `bench/judge_cv.py` (rejected: see configs/judge/README.md).

The shipped reader is frozen: SmolLM2's first 14 layers, mean-pooled, and a logistic probe. Here
the top layers (`--train-from` to 14) are trained with a linear head on the pooled state (fully, or
LoRA with `--lora`), 4 epochs of AdamW, on each fold's training part. Printed per fold, side by side
on the same held-out items: the frozen reader's probe (`head.fit`, as the judge fits it) and the
fine-tuned reader. `--with-v2` also gives the head the MiniLM features (the judge's other half),
initialized from their joint probe.

Cost is kept down by running the frozen bottom layers once per item (cached) and training only the
top ones: ~80 s a fold on 2 cores for 4 layers.

    .venv/bin/python bench/judge_tune_cv.py                         # full FT of layers 10-13 (~7 min)
    .venv/bin/python bench/judge_tune_cv.py --lora --train-from 8 --lr 1e-3 --with-v2 --folds-run 2
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers.masking_utils import create_causal_mask

sys.path.insert(0, str(Path(__file__).parent))
from judge_cv import BATCHES  # noqa: E402 - same batches

from clawflow.base_model import model_dir  # noqa: E402
from clawflow.config import JudgeConfig, default_home  # noqa: E402
from clawflow.judge.dataset import load_labelled  # noqa: E402
from clawflow.judge.embedded import L2, L2_READER, ROLES, STACK_FOLDS, _paths, _read_exemplars, item_role, items_features, shared_encoder, state_text  # noqa: E402
from clawflow.judge.features import CLASSES  # noqa: E402
from clawflow.judge.head import fit  # noqa: E402
from clawflow.judge.reader import Reader  # noqa: E402
from clawflow.judge.stack import fit_stacked, stacked_probs, with_probs  # noqa: E402

BASELINE = {False: "frozen probe", True: "shipped stack"}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_layers(model, h: torch.Tensor, mask: torch.Tensor, layers) -> torch.Tensor:
    """Decoder layers over right-padded hidden states, as `LlamaModel.forward` runs them."""
    pos = torch.arange(h.shape[1])[None]
    causal = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=mask, cache=None, position_ids=pos)
    rotary = model.rotary_emb(h, position_ids=pos)
    for layer in layers:
        h = layer(h, attention_mask=causal, position_embeddings=rotary, position_ids=pos)
    return h


class Data:
    """Train items as the reader reads them, with the bottom layers' states cached."""

    def __init__(self, args):
        cfg = JudgeConfig()
        _, exemplars_path, labelled_path = _paths(cfg)
        self.items = load_labelled(labelled_path, "train")
        self.roles = [item_role(i.input) for i in self.items]
        self.labels = torch.tensor([CLASSES.index(i.label) for i in self.items])
        # the shipped reader's own input and model (its first `layers` layers, no final norm)
        reader = Reader(model_dir(cfg.embedded.reader, default_home()), layers=args.layers, threads=None)
        self.seqs, self.spans = map(list, zip(*(reader.tokens(r, state_text(i.input))
                                                for r, i in zip(self.roles, self.items))))
        self.model = reader.model
        self.v2 = None
        if args.with_v2:
            encoder = shared_encoder()
            exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
            emb = {r: encoder.embed([e["text"] for e in exemplars[r]]) for r in ROLES}
            self.v2 = []
            for at in range(0, len(self.items), 16):
                self.v2 += items_features(encoder, exemplars, emb, [i.input for i in self.items[at:at + 16]])
        self.cache: list[torch.Tensor] = []

    def cache_bottom(self, start: int) -> torch.Tensor:
        """Cache layer-`start` states of every item; return the frozen reader's pooled features."""
        order = sorted(range(len(self.items)), key=lambda i: len(self.seqs[i]))
        self.cache = [torch.empty(0)] * len(self.items)
        pooled = torch.zeros(len(self.items), self.model.config.hidden_size)
        with torch.inference_mode():
            for at in range(0, len(order), 32):
                idx = order[at:at + 32]
                width = max(len(self.seqs[i]) for i in idx)
                ids = torch.zeros(len(idx), width, dtype=torch.long)
                for j, i in enumerate(idx):
                    ids[j, : len(self.seqs[i])] = torch.tensor(self.seqs[i])
                h = self.model.embed_tokens(ids)
                mask = torch.stack([torch.arange(width) < len(self.seqs[i]) for i in idx]).long()
                h = run_layers(self.model, h, mask, self.model.layers[:start])
                for j, i in enumerate(idx):
                    self.cache[i] = h[j, : len(self.seqs[i])].clone()
                pooled[idx] = self.pool(run_layers(self.model, h, mask, self.model.layers[start:]), idx)
        return pooled

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(self.cache[i].shape[0] for i in idx)
        h = torch.zeros(len(idx), width, self.cache[idx[0]].shape[1])
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for j, i in enumerate(idx):
            h[j, : self.cache[i].shape[0]], mask[j, : self.cache[i].shape[0]] = self.cache[i], 1
        return h, mask

    def pool(self, h: torch.Tensor, idx: list[int]) -> torch.Tensor:
        return torch.stack([h[j, self.spans[i][0]:self.spans[i][1]].mean(0) for j, i in enumerate(idx)])


def fine_tune(data: Data, train: list[int], start: int, args, seed: int, frozen: torch.Tensor):
    """Train the top layers + a linear head on `train`; return (frozen probe's probs, tuned probs),
    each a function of item indices giving (n, 3) probabilities."""
    torch.manual_seed(seed)
    top = torch.nn.ModuleList([copy.deepcopy(layer) for layer in data.model.layers[start:]])
    if args.lora:
        top = inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=LORA_TARGETS), top)
    for name, p in top.named_parameters():
        p.requires_grad = not args.lora or "lora_" in name

    def inputs(pooled: torch.Tensor, idx: list[int]) -> torch.Tensor:
        return pooled if data.v2 is None or args.stacked else torch.cat([pooled, torch.stack([data.v2[i] for i in idx])], 1)

    heads, probes, norm = torch.nn.ModuleDict(), {}, {}
    for role in ROLES:
        mine = [i for i in train if data.roles[i] == role]
        probes[role] = fit(inputs(frozen[mine], mine), [data.items[i].label for i in mine], 0.03)  # as the judge fits it
        norm[role] = (probes[role].mean, probes[role].std)
        heads[role] = torch.nn.Linear(probes[role].weight.shape[0], 3)
        with torch.no_grad():
            if data.v2 is not None and not args.stacked:  # start from the joint probe: MiniLM's half is fitted
                heads[role].weight.copy_(probes[role].weight.T)
                heads[role].bias.copy_(probes[role].bias)
            else:
                heads[role].weight.zero_()
                heads[role].bias.zero_()
    dropout = torch.nn.Dropout(0.1)

    def logits(idx: list[int], training: bool) -> torch.Tensor:
        h, mask = data.batch(idx)
        pooled = data.pool(run_layers(data.model, h, mask, top), idx)
        out = torch.zeros(len(idx), 3)
        for role in ROLES:
            js = [j for j, i in enumerate(idx) if data.roles[i] == role]
            if js:
                x = (inputs(pooled[js], [idx[j] for j in js]) - norm[role][0]) / norm[role][1]
                out[js] = heads[role](dropout(x) if training else x)
        return out

    opt = torch.optim.AdamW([{"params": [p for p in top.parameters() if p.requires_grad], "lr": args.lr},
                             {"params": heads.parameters(), "lr": args.head_lr}], weight_decay=0.01)
    steps = args.epochs * ((len(train) + 15) // 16)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, args.head_lr], total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    for _ in range(args.epochs):
        top.train()
        order = train[:]
        rng.shuffle(order)
        for at in range(0, len(order), 16):
            idx = order[at:at + 16]
            loss = torch.nn.functional.cross_entropy(logits(idx, True), data.labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    top.eval()

    def tuned(idx: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([logits(idx[at:at + 32], False).softmax(-1) for at in range(0, len(idx), 32)])

    def probe(idx: list[int]) -> torch.Tensor:
        out = torch.zeros(len(idx), 3)
        for role in ROLES:
            js = [j for j, i in enumerate(idx) if data.roles[i] == role]
            if js:
                out[js] = probes[role].probs(inputs(frozen[[idx[j] for j in js]], [idx[j] for j in js]))
        return out

    return probe, tuned


def stacked_fold(data: Data, frozen: torch.Tensor, train: list[int], held: list[int], args, seed: int):
    """Per-item correctness on `held` of (the shipped stack: MiniLM features + the frozen reader's
    out-of-fold probe probs; the same with the fine-tuned reader's probs). The fine-tuned reader's
    out-of-fold probs come from 2 inner halves (5 would cost 5 fine-tunings per fold)."""
    halves = [train[0::2], train[1::2]]
    oof = torch.zeros(len(data.items), 3)
    for k in (0, 1):
        _, tuned = fine_tune(data, halves[k], args.train_from, args, seed + k + 1, frozen)
        oof[halves[1 - k]] = tuned(halves[1 - k])
    _, tuned = fine_tune(data, train, args.train_from, args, seed, frozen)
    held_probs = dict(zip(held, tuned(held)))
    base_ok, tuned_ok = torch.zeros(len(held), dtype=torch.bool), torch.zeros(len(held), dtype=torch.bool)
    for role in ROLES:
        mine = [i for i in train if data.roles[i] == role]
        js = [j for j, i in enumerate(held) if data.roles[i] == role]
        hi = [held[j] for j in js]
        x, tx = torch.stack([data.v2[i] for i in mine]), torch.stack([data.v2[i] for i in hi])
        y, ty = [data.items[i].label for i in mine], data.labels[hi]
        probe, head = fit_stacked(x, frozen[mine], y, L2, L2_READER, STACK_FOLDS)  # the shipped judge
        base_ok[js] = stacked_probs(probe, head, tx, frozen[hi]).argmax(-1) == ty
        final = fit(with_probs(x, oof[mine]), y, L2)
        tuned_ok[js] = final.probs(with_probs(tx, torch.stack([held_probs[i] for i in hi]))).argmax(-1) == ty
    return base_ok, tuned_ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=14, help="the reader's depth (as shipped)")
    ap.add_argument("--train-from", type=int, default=10, help="first trained layer")
    ap.add_argument("--lora", action="store_true", help="LoRA r=8 on every linear instead of full fine-tuning")
    ap.add_argument("--with-v2", action="store_true", help="the head also gets the MiniLM features")
    ap.add_argument("--stacked", action="store_true",
                    help="score the judge's stack (MiniLM features + reader probs) with the fine-tuned reader")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--folds-run", type=int, default=5, help="stop after this many folds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start_time = time.perf_counter()
    args.with_v2 = args.with_v2 or args.stacked
    data = Data(args)
    frozen = data.cache_bottom(args.train_from)
    print(f"{len(data.items)} train items; bottom {args.train_from} layers cached in "
          f"{time.perf_counter() - start_time:.0f} s", flush=True)
    order = list(range(len(data.items)))
    random.Random(args.seed).shuffle(order)  # the folds of bench/judge_cv.py
    base_ok, tuned_ok, held_all = [], [], []
    for fold in range(min(args.folds, args.folds_run)):
        t = time.perf_counter()
        held = sorted(order[fold::args.folds])
        train = [i for i in order if i not in set(held)]
        if args.stacked:
            base, ok = stacked_fold(data, frozen, train, held, args, args.seed * 100 + fold)
        else:
            probe, tuned = fine_tune(data, train, args.train_from, args, args.seed * 100 + fold, frozen)
            base, ok = probe(held).argmax(-1) == data.labels[held], tuned(held).argmax(-1) == data.labels[held]
        base_ok.append(base)
        tuned_ok.append(ok)
        held_all += held
        print(f"fold {fold}: {BASELINE[args.stacked]} {base.float().mean():.3f}, fine-tuned {ok.float().mean():.3f} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    ok = torch.cat(tuned_ok)
    batches = "  ".join(
        f"{b} batch {float(ok[[j for j, i in enumerate(held_all) if rx.match(data.items[i].id)]].float().mean()):.3f}"
        for b, rx in BATCHES.items())
    print(f"{'LoRA' if args.lora else 'full'} fine-tuning of layers {args.train_from}-{args.layers - 1}"
          f"{' with the MiniLM features' if args.with_v2 and not args.stacked else ''}{', stacked' if args.stacked else ''}: "
          f"{BASELINE[args.stacked]} {float(torch.cat(base_ok).float().mean()):.3f}, "
          f"fine-tuned {float(ok.float().mean()):.3f} on {len(held_all)} held-out train items ({batches})")


if __name__ == "__main__":
    main()
