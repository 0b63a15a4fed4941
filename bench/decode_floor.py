"""The decode ceiling of the model itself: what any server on this machine can reach at batch B.

A decode step at batch B (one token per row, a KV cache of --context tokens) is timed on the bare
transformers model, no server around it: B / step time is the best tokens/s a server decoding B
streams can report, whatever its scheduler. Compare `bench/serving.py`'s figures with it.

Also measured, and why we don't ship it: weight-only-ish int8 (PyTorch dynamic quantization of the
decoder's Linear layers; the tied lm_head stays fp32) is faster, but the served policy's logprobs
then differ from the fp32 weights the trainer holds, which is the train/serve gap clawflow exists
to avoid. The gap is the mean |log p_int8 − log p_fp32| of the actual next tokens of a real text.

Columns, each a change on the one before: fp32 with transformers' DynamicCache (copies the whole
cache every step), fp32 with the engine's append-in-place cache (serving/kv_cache.py), fp32 on
oneDNN-prepacked Linear weights (policy/packed_linear.py: what the default serves where its
start-up timing finds it faster), and bf16-weights, packed too (policy/bf16_weights.py, what the
opt-in `serving.dtype: auto` picks where bf16 matmuls are fast). Then a new request's prompt joining
a decode step: prefilled apart, or in one fused forward with the step (serving/fused_step.py).

    .venv/bin/python bench/decode_floor.py [--batches 1 8 32 --context 120]
    .venv/bin/python bench/decode_floor.py --batches 1 8 --context 4096   # an agent's next turn
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = ("The Roman Empire grew out of the Roman Republic, and for centuries it ruled the lands around the "
        "Mediterranean Sea. Its roads, laws and language shaped Europe long after the western half fell in 476. ") * 4


def step_time(model, batch: int, context: int, steps: int, append: bool = False) -> float:
    from transformers import DynamicCache

    from clawflow.serving.kv_cache import new_cache

    with torch.inference_mode():
        cache = new_cache() if append else DynamicCache()
        model(torch.randint(100, 10_000, (batch, context), generator=torch.Generator().manual_seed(0)),
              cache=cache, use_cache=True, logits_to_keep=1)
        last = torch.full((batch, 1), 42)
        mask = torch.ones(batch, context, dtype=torch.long)
        t0 = time.perf_counter()
        for i in range(steps):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], 1)
            model(last, attention_mask=mask, position_ids=torch.full((batch, 1), context + i), cache=cache,
                  use_cache=True)
        return (time.perf_counter() - t0) / steps


def join_times(model, batch: int, context: int, prompt: int, steps: int) -> tuple[float, float]:
    """Seconds of a decode step at `batch` rows plus a `prompt`-token prefill joining: run apart
    (transformers' forward for each, what the engine did before) and as one fused forward
    (clawflow/serving/fused_step.py, what it does for Llama-family models). Alternated step by step
    over the same growing cache; medians."""
    import statistics

    from clawflow.serving import fused_step
    from clawflow.serving.kv_cache import new_cache

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = new_cache()
        model(torch.randint(100, 10_000, (batch, context), generator=g), cache=cache, use_cache=True, logits_to_keep=1)
        last, ids = torch.full((batch,), 42), torch.randint(100, 10_000, (prompt,), generator=g).tolist()
        mask, times = torch.ones(batch, context, dtype=torch.long), {True: [], False: []}
        for i in range(2 * steps):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], 1)
            pos, fused = torch.full((batch,), context + i), i % 2 == 1
            t0 = time.perf_counter()
            if fused:
                fused_step.forward(model, last, pos, mask, cache, [fused_step.Chunk(ids, 0, new_cache())])
            else:
                model(last[:, None], attention_mask=mask, position_ids=pos[:, None], cache=cache, use_cache=True)
                model(torch.tensor([ids]), cache=new_cache(), use_cache=True, logits_to_keep=1)
            times[fused].append(time.perf_counter() - t0)
    return statistics.median(times[False][1:]), statistics.median(times[True][1:])


def next_token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp, logp.gather(-1, ids[0, 1:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=120, help="KV cache length (prompt + reply so far)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--join", type=int, default=44, help="prompt tokens joining (bench/serving.py's prompts: 44)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawflow.base_model import base_model_dir
    from clawflow.config import REPO_ROOT, load_config

    path = base_model_dir(load_config(REPO_ROOT / "configs" / "default.yaml"))
    from clawflow.policy.bf16_weights import bf16_weights
    from clawflow.policy.packed_linear import pack_linears

    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pack_linears(packed)
    bf16w = bf16_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    pack_linears(bf16w)
    int8 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    int8.model = torch.ao.quantization.quantize_dynamic(int8.model, {torch.nn.Linear}, dtype=torch.qint8)

    print(f"SmolLM2-135M, {args.threads} threads, KV context {args.context}; decode step on the bare model, ms (tok/s)")
    print(f"{'batch':>5} {'fp32 DynamicCache':>18} {'fp32 append KV':>16} {'+ packed Linears':>17} "
          f"{'bf16-w. packed':>14} {'int8 (not shipped)':>19}")
    for b in args.batches:
        runs = [step_time(fp32, b, args.context, args.steps), step_time(fp32, b, args.context, args.steps, True),
                step_time(packed, b, args.context, args.steps, True),
                step_time(bf16w, b, args.context, args.steps, True), step_time(int8, b, args.context, args.steps)]
        cells = [f"{t * 1e3:.1f} ({b / t:.0f})" for t in runs]
        print(f"{b:5d} {cells[0]:>18} {cells[1]:>16} {cells[2]:>17} {cells[3]:>14} {cells[4]:>19}   "
              f"append {runs[0] / runs[1]:.2f}x, +packed {runs[0] / runs[2]:.2f}x, bf16-weights packed {runs[0] / runs[3]:.2f}x")
    print(f"\na {args.join}-token prompt joining a decode step (fp32, packed Linears): ms, apart -> fused")
    for b in args.batches:
        apart, fused = join_times(packed, b, args.context, args.join, max(args.steps // 2, 4))
        print(f"{b:5d} {apart * 1e3:8.1f} -> {fused * 1e3:6.1f}   {apart / fused:.2f}x")
    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(TEXT)["input_ids"]])
    (full_a, a), (full_q, q) = next_token_logprobs(fp32, ids), next_token_logprobs(int8, ids)
    agree = (full_a.argmax(-1) == full_q.argmax(-1)).float().mean()
    print(f"int8 vs fp32 on {ids.shape[1]} tokens of text: mean |dlogprob| {float((a - q).abs().mean()):.3f} nats, "
          f"max {float((a - q).abs().max()):.3f}; same argmax at {float(agree):.0%} of positions")


if __name__ == "__main__":
    main()
