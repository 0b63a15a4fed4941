"""bf16 and bf16-weights vs fp32 serving on this CPU: speed, and how far the recorded logprobs move.

Side by side in one run, on SmolLM2-135M-Instruct in the embedded engine (one engine per dtype, no
server; bf16-weights is bf16 Linear weights under fp32 attention and KV, policy/bf16_weights.py):
the start-up probe's verdict (clawflow/serving/dtype_probe.py: the model's own prefill and
long-context decode step in both dtypes), prefill tokens/s of a
--prompt-tokens prompt, decode ms/token at batch 1 after a short prompt and after --context cached
tokens (an agent's next turn), and the honesty of the recorded logprobs: greedy replies served in each bf16 mode (the
logprobs the gateway would record) scored again by the fp32 model the trainer holds, per token: mean |Δ logprob|,
its 99th percentile, the share beyond ln(train.tis_cap) (what truncated importance sampling can no
longer correct), and how many greedy replies are the same in both dtypes.

    .venv/bin/python bench/dtype.py [--replies 8 --max-tokens 48 --prompt-tokens 2048]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

QUESTIONS = ["What is the capital of France?", "How do plants make food?", "Explain what a CPU cache is.",
             "Give me three tips for sleeping better.", "Why is the sky blue?", "How do I boil an egg?",
             "What does HTTP stand for?", "Write a haiku about autumn.", "What causes the seasons?",
             "How does a bicycle stay upright?", "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?"]


@torch.inference_mode()
def prefill_tok_s(model, n: int, reps: int = 2) -> float:
    ids = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model(ids, use_cache=True, logits_to_keep=1)
        best = min(best, time.perf_counter() - t0)
    return n / best


@torch.inference_mode()
def long_decode_ms(model, context: int, steps: int = 8) -> float:
    """ms per decode step after `context` cached tokens (one-pass prefill first, not timed)."""
    from transformers import DynamicCache

    ids = torch.randint(100, 40000, (1, context + steps), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    model(ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    t0 = time.perf_counter()
    for i in range(context, context + steps):
        model(ids[:, i:i + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[i]]))
    return 1e3 * (time.perf_counter() - t0) / steps


def decode_ms(engine, prompt: list[int], tokens: int = 32) -> float:
    from clawflow.serving.engine import SamplingParams

    t0 = time.perf_counter()
    g = engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0.0))
    return 1e3 * (time.perf_counter() - t0) / max(1, len(g.token_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replies", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=4096, help="cached tokens for the long-context decode")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from clawflow.base_model import base_model_dir
    from clawflow.config import REPO_ROOT, TrainConfig, load_config
    from clawflow.serving.dtype_probe import choose
    from clawflow.serving.engine import SamplingParams, TorchEngine

    path = base_model_dir(load_config(REPO_ROOT / "configs" / "default.yaml"))
    engines = {d: TorchEngine(path, dtype=d, prefix_cache_tokens=0) for d in ("float32", "bfloat16", "bf16-weights")}
    picked, found = choose("auto", path)
    speed = {}
    for d, e in engines.items():
        e.generate(e.encode_chat([{"role": "user", "content": "hi"}]), SamplingParams(max_new_tokens=2))
        speed[d] = (prefill_tok_s(e._policy.model, args.prompt_tokens),
                    decode_ms(e, e.encode_chat([{"role": "user", "content": QUESTIONS[0]}])),
                    long_decode_ms(e._policy.model, args.context))

    fp32 = engines["float32"]
    greedy = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0)
    refs = {q: fp32.generate(fp32.encode_chat([{"role": "user", "content": q}]), greedy).token_ids
            for q in QUESTIONS[: args.replies]}
    cap = math.log(TrainConfig().tis_cap or 2.0)
    print(f"\nbf16 modes vs fp32, SmolLM2-135M-Instruct ({time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f})")
    print(f"start-up probe: bf16-weights {found['prefill_speedup']:.2f}x at prefill, {found['decode_speedup']:.2f}x "
          f"at a long-context decode step -> serves {picked}")
    print(f"{'dtype':<13} {'prefill tok/s':>14} {'decode ms/token':>16} {f'after {args.context} tokens':>18}")
    for d, (p, ms, long_ms) in speed.items():
        print(f"{d:<13} {p:>14.0f} {ms:>16.1f} {long_ms:>18.1f}")
    f = speed["float32"]
    for d, e in engines.items():
        if d == "float32":
            continue
        b = speed[d]
        deltas, agree = [], 0
        for q, ref in refs.items():
            prompt = e.encode_chat([{"role": "user", "content": q}])
            served = e.generate(prompt, greedy)  # what a gateway serving in `d` records
            exact = fp32.score(prompt, served.token_ids)  # the fp32 policy's logprobs of the same tokens
            deltas += [abs(x - y) for x, y in zip(served.logprobs, exact)]
            agree += served.token_ids == ref
        deltas.sort()
        print(f"{d} / fp32 speed: prefill {b[0] / f[0]:.2f}x (prompt {args.prompt_tokens} tokens), decode "
              f"{f[1] / b[1]:.2f}x after a short prompt, {f[2] / b[2]:.2f}x after {args.context} tokens")
        print(f"  recorded logprobs, {len(deltas)} tokens of {len(refs)} greedy replies re-scored in fp32: mean "
              f"|Δ| {statistics.mean(deltas):.4f} nats/token, p99 {deltas[int(0.99 * (len(deltas) - 1))]:.4f}, max "
              f"{deltas[-1]:.4f}; beyond ln(tis_cap)={cap:.2f}: {sum(x > cap for x in deltas) / len(deltas):.2%}; "
              f"greedy replies identical to fp32's: {agree}/{len(refs)}")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
