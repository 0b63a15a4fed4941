"""CPU training precision chosen by measurement (`train.autocast: auto`), never by a CPU-name table.

On a CPU with native bf16 (AVX512-BF16 or AMX), bf16 matmuls run 2x faster than fp32 (measured:
2.2x on this session's AVX512-BF16 EPYC) and a training step of SmolLM2-135M under bf16 autocast
1.6-1.75x faster; on an AVX2-only CPU bf16 is emulated and 2.2x slower (FIELD_NOTES.md). So `choose`
times a forward + backward of the model itself in both, best of two, and autocasts only when it is
clearly faster. Weights, optimizer state and the loss's log-softmax stay fp32 (autocast runs the
matmuls in bf16 only), so a checkpoint is the same kind either way. The start-of-run logprobs
(pi_old, teacher, reference) are computed under the same setting as the training forward, so the
PPO ratio starts at 1 (up to bf16 noise).

On a GPU `train.mixed_precision` (FSDP's bf16 policy) is what applies; autocast is for CPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

PROBE_TOKENS = 256
MIN_SPEEDUP = 1.2  # below this, bf16's rounding is not worth it (and load noise could flip it)


def step_seconds(model: Any, bf16: bool, reps: int = 2) -> float:
    """Best seconds of a forward + backward over PROBE_TOKENS random tokens, fp32 or under bf16 autocast."""
    ids = torch.randint(0, model.config.vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for i in range(reps + 1):  # the first pass selects kernels and packs weights: not timed
        t0 = time.perf_counter()
        with autocast(bf16):
            logits = model(input_ids=ids, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()
        if i:
            best = min(best, time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return best


def probe(model: Any) -> float:
    """bf16 autocast's training-step speed-up over fp32 (fp32 seconds / bf16 seconds) for `model`."""
    return step_seconds(model, False) / step_seconds(model, True)


def choose(setting: str, model: Any, device: torch.device) -> tuple[bool, float | None]:
    """(autocast to bf16?, the probe's speed-up when it ran) for `train.autocast` on `device`."""
    if device.type != "cpu" or setting == "off":
        return False, None
    if setting == "bfloat16":
        return True, None
    try:
        speedup = probe(model)
    except Exception:  # noqa: BLE001 - a torch build or model that cannot autocast: train fp32
        return False, None
    return speedup >= MIN_SPEEDUP, speedup


def autocast(enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on the CPU when `enabled`, else nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()
