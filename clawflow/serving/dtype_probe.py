"""Serving dtype chosen by measurement (`serving.dtype: auto`), never by a CPU-name table.

Machines differ between sessions: an AVX2-only EPYC ran bf16 matmuls 2.2x SLOWER than fp32 (no
native bf16: FIELD_NOTES.md); CPUs with AVX512-BF16 or AMX run them much faster. Matmuls are not the
whole story, though: on an AVX512-BF16 EPYC, full bf16 ran a 2k-token prefill 1.5x faster but a
decode step after 4k cached tokens 2x SLOWER (206 vs 100 ms: attention and KV-cache traffic in
bf16), and an agent's turn is mostly that. So the fast path is `bf16-weights`
(policy/bf16_weights.py): only the Linear weights in bf16, attention and the KV cache in fp32. On
that EPYC it ran prefill 1.4x, a decode step after 4k tokens 1.3x and short-context decode 1.6-1.9x
faster than fp32.

`choose` times the model itself, fp32 and bf16-weights, on this machine's threads: a
PREFILL_TOKENS prefill and a decode step after CONTEXT cached tokens (random KV: the time does not
depend on the values), best of two: seconds of start-up, in a child process. bf16-weights wins only
when it is clearly faster at prefill and not slower at long-context decode; everywhere else fp32.
`serving.dtype: float32|bfloat16|bf16-weights` skips the probe (full bfloat16 is never picked by it).

Recorded logprobs stay the trainer's business: a bf16 server samples from bf16-rounded logits, and
the trainer's truncated importance sampling (`train.tis_cap`) corrects the mismatch per token;
`bench/dtype.py` measures how large it is (mean |Δ logprob| per token against fp32).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any

import torch

log = logging.getLogger("clawflow.dtype")

PREFILL_TOKENS = 256
CONTEXT = 4096  # cached tokens before the timed decode steps (an agent's prompt is ~7.7k)
MIN_SPEEDUP = 1.15  # prefill; below this, bf16's rounding is not worth it (and noise could flip it)


@torch.inference_mode()
def time_model(model: Any, reps: int = 2, context: int = CONTEXT) -> tuple[float, float]:
    """(best prefill seconds, best decode-step seconds after `context` cached tokens) of `model`."""
    from transformers import DynamicCache

    cfg = model.config
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, PREFILL_TOKENS), generator=gen)
    heads_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache()
    for i in range(cfg.num_hidden_layers):
        kv = torch.randn(1, heads_kv, context, head_dim, generator=gen).to(dtype)
        cache.update(kv, kv.clone(), i)
    model(ids[:, :8], logits_to_keep=1)  # first call: kernel selection, packing
    prefill = decode = float("inf")
    for r in range(reps):
        t0 = time.perf_counter()
        model(ids, logits_to_keep=1)
        prefill = min(prefill, time.perf_counter() - t0)
        t0 = time.perf_counter()
        model(ids[:, r:r + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[context + r]]))
        decode = min(decode, time.perf_counter() - t0)
    return prefill, decode


def measure(path: str, context: int = CONTEXT) -> dict[str, float]:
    """bf16-weights' speed-up over fp32 (fp32 seconds / its seconds) for the model at `path`, in this process.
    Each is timed on prepacked weights too where oneDNN has them, and its faster way counts: the
    engine serves either that way where it pays (policy/packed_linear.py)."""
    from clawflow.policy import packed_linear
    from clawflow.policy.bf16_weights import bf16_weights
    from clawflow.policy.loader import load_policy

    def fastest(model) -> tuple[float, float]:  # plain, then packed where oneDNN has it; left unpacked
        plain = time_model(model, context=context)
        if not (packed_linear.available() and packed_linear.pack_linears(model)):
            return plain
        packed = time_model(model, context=context)
        packed_linear.unpack_linears(model)
        return min(plain[0], packed[0]), min(plain[1], packed[1])

    model = load_policy(path, torch.float32).eval()
    fp32 = fastest(model)
    bf16 = fastest(bf16_weights(model))
    return {"prefill_speedup": fp32[0] / bf16[0], "decode_speedup": fp32[1] / bf16[1]}


def probe(path: str, timeout_s: float = 300.0) -> dict[str, float]:
    """`measure` in a child process on this process's thread count. In the server process itself it
    left the fp32 model it then served 25-40 % slower at 8 streams (bench/serving.py, 2026-12-04:
    42-57 vs 73 tok/s with the probe skipped); a child leaves nothing behind."""
    out = subprocess.run([sys.executable, "-m", "clawflow.serving.dtype_probe", str(path),
                          str(torch.get_num_threads()), str(CONTEXT)],
                         capture_output=True, text=True, timeout=timeout_s, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def choose(setting: str, path: str) -> tuple[str, dict[str, float] | None]:
    """The dtype to serve in: `setting` itself unless it is "auto"; then the probe's answer."""
    if setting != "auto":
        return setting, None
    try:
        found = probe(path)
    except Exception as exc:  # a dtype this torch build cannot run, an unusual model: keep fp32
        log.warning("dtype probe failed (%s); serving float32", exc)
        return "float32", None
    fast = found["prefill_speedup"] >= MIN_SPEEDUP and found["decode_speedup"] >= 1.0
    pick = "bf16-weights" if fast else "float32"
    log.info("dtype probe: bf16-weights vs fp32 %.2fx at a %d-token prefill, %.2fx at a decode step after %d tokens: "
             "serving %s", found["prefill_speedup"], PREFILL_TOKENS, found["decode_speedup"], CONTEXT, pick)
    return pick, found


if __name__ == "__main__":  # the child of `probe`: path, threads, context -> one JSON line
    torch.set_num_threads(int(sys.argv[2]))
    print(json.dumps(measure(sys.argv[1], int(sys.argv[3]))))
