"""Response logprobs from a model: the training forward, and the no-grad start-of-run pass that
fixes pi_old, the OPD teacher and the KL reference before any weight moves.

Only the last R + 1 positions get logits (`logits_to_keep`, prompts left-padded by `collate`),
and the log-softmax over the vocabulary runs in chunks (`loss.sequence_logprobs`): both inside
`clawflow.policy.logprobs.response_logprobs`, the scoring function the engine and the gate use
too. Under FSDP every rank must run the same number of forward passes, so a rank with less to
score runs one-token dummy passes.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from clawflow.policy.logprobs import response_logprobs, response_topk
from clawflow.train import distributed as D
from clawflow.train.plan import Item


def dummy_forward(model, pad_id: int, device: torch.device) -> torch.Tensor:
    """A two-token pass for a rank with nothing to do; its zero loss still backpropagates."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits.sum() * 0.0


@torch.no_grad()
def score_items(model, items: list[Item], todo: list[int], hinted: bool, micro_batch: int, pad_id: int,
                device: torch.device, adapter_off: bool = False) -> dict[int, torch.Tensor]:
    """{item.index: [R_i] logprobs} of `items[todo]`, on the hint-augmented prompt when `hinted`.
    `adapter_off` scores with a peft model's adapter disabled (the frozen base of a LoRA run)."""
    chunks = [todo[k : k + micro_batch] for k in range(0, len(todo), micro_batch)]
    out: dict[int, torch.Tensor] = {}
    with model.disable_adapter() if adapter_off else nullcontext():
        for k in range(int(D.all_max([len(chunks)], device)[0])):
            if k >= len(chunks):
                dummy_forward(model, pad_id, device)
                continue
            its = [items[i] for i in chunks[k]]
            prompts = [it.teacher_prompt if hinted else it.prompt for it in its]
            lp = response_logprobs(model, prompts, [it.response for it in its], pad_id, device).cpu()
            for row, it in enumerate(its):
                out[it.index] = lp[row, : len(it.response)].clone()
    return out


@torch.no_grad()
def topk_items(model, items: list[Item], todo: list[int], k: int, micro_batch: int, pad_id: int,
               device: torch.device, adapter_off: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{item.index: (ids [R_i, k], log-probs [R_i, k])}: the teacher's k likeliest tokens at each
    position of `items[todo]`'s replies, on their hint-augmented prompts (distillation's targets)."""
    chunks = [todo[j : j + micro_batch] for j in range(0, len(todo), micro_batch)]
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with model.disable_adapter() if adapter_off else nullcontext():
        _topk_chunks(model, items, chunks, k, pad_id, device, out)
    return out


def _topk_chunks(model, items, chunks, k, pad_id, device, out) -> None:
    for n in range(int(D.all_max([len(chunks)], device)[0])):
        if n >= len(chunks):
            dummy_forward(model, pad_id, device)
            continue
        its = [items[i] for i in chunks[n]]
        ids, lps = response_topk(model, [it.teacher_prompt for it in its], [it.response for it in its], k, pad_id,
                                 device)
        for row, it in enumerate(its):
            out[it.index] = (ids[row, : len(it.response)].cpu().clone(), lps[row, : len(it.response)].cpu().clone())


def cached_topk(cache: dict[int, tuple[torch.Tensor, torch.Tensor]], items: list[Item], k: int,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, R, k] ids, [B, R, k] teacher log-probs) of a micro-batch; zeros for items without targets
    (their rows are not distilled, so the values only need to be finite)."""
    ids = torch.zeros((len(items), rows, k), dtype=torch.long)
    lps = torch.zeros((len(items), rows, k), dtype=torch.float32)
    for row, it in enumerate(items):
        if it.index in cache:
            i, lp = cache[it.index]
            ids[row, : len(i)], lps[row, : len(i)] = i, lp
    return ids, lps


def cached(cache: dict[int, torch.Tensor], items: list[Item], fallback: torch.Tensor) -> torch.Tensor:
    """[B, R] on CPU: each item's cached logprobs where present, else the (detached) fallback row."""
    out = fallback.detach().cpu().clone()
    for row, it in enumerate(items):
        if it.index in cache:
            out[row, : len(it.response)] = cache[it.index]
    return out
