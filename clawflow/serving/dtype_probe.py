"""Serving dtype chosen by measurement (`serving.dtype: auto`), never by a CPU-name table.

Machines differ between sessions: an AVX2-only EPYC ran bf16 matmuls 2.2x SLOWER than fp32 (no
native bf16: FIELD_NOTES.md); CPUs with AVX512-BF16 or AMX run them much faster. So at start-up
`choose` times the model's own matmul shapes (its MLP's up projection) in both dtypes on this
machine's threads: a prefill-shaped one (the agent workload's cost: long prompts) and a
decode-shaped one (a batch of single tokens), best of a few runs each, well under a second in all.
bf16 wins only when it is clearly faster at prefill and not slower at decode; everywhere else fp32.

Recorded logprobs stay the trainer's business: a bf16 server samples from bf16 logits, and the
trainer's truncated importance sampling (`train.tis_cap`) corrects the mismatch per token;
`bench/dtype.py` measures how large it is (mean |Δ logprob| per token, bf16 vs fp32).
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("clawflow.dtype")

PREFILL_ROWS, DECODE_ROWS = 512, 8
MIN_SPEEDUP = 1.15  # below this, bf16's rounding is not worth it (and timing noise could flip it)


def matmul_seconds(dtype: torch.dtype, rows: int, k: int, n: int, reps: int = 5) -> float:
    """Best-of-`reps` seconds of one [rows, k] x [k, n] linear in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)  # first call: kernel selection, packing
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
    return best


def probe(hidden: int, intermediate: int) -> dict[str, float]:
    """bf16's speed-up over fp32 (fp32 seconds / bf16 seconds) at prefill and decode shapes."""
    out = {}
    for name, rows in (("prefill", PREFILL_ROWS), ("decode", DECODE_ROWS)):
        fp32 = matmul_seconds(torch.float32, rows, hidden, intermediate)
        bf16 = matmul_seconds(torch.bfloat16, rows, hidden, intermediate)
        out[f"{name}_speedup"] = fp32 / bf16
    return out


def choose(setting: str, hidden: int, intermediate: int) -> tuple[str, dict[str, float] | None]:
    """The dtype to serve in: `setting` itself unless it is "auto"; then the probe's answer."""
    if setting != "auto":
        return setting, None
    try:
        found = probe(hidden, intermediate)
    except Exception as exc:  # a dtype this torch build cannot run: keep fp32
        log.warning("dtype probe failed (%s); serving float32", exc)
        return "float32", None
    pick = "bfloat16" if found["prefill_speedup"] >= MIN_SPEEDUP and found["decode_speedup"] >= 1.0 else "float32"
    log.info("dtype probe: bf16 vs fp32 matmuls %.2fx at prefill, %.2fx at decode: serving %s",
             found["prefill_speedup"], found["decode_speedup"], pick)
    return pick, found
