"""Prefill of an agent's prompt on the embedded engine: speed against the machine's matmul peak, and
how long it stalls a stream that is already decoding, whole-prompt vs chunked (`serving.prefill_chunk_tokens`).

SmolLM2-135M-Instruct in-process (`TorchEngine`, fp32, no prefix cache: every prefill is cold), an
OpenClaw-shaped prompt (bench/agent_prompt.py, ~7.4k tokens). Per setting, side by side in one run:

- cold prefill: seconds to the first token of the agent prompt alone, prompt tokens/s, and MFU =
  forward FLOPs (2N per token + attention over the causal context) / seconds / the measured fp32
  matmul peak (`clawflow.train.flops.matmul_peak_flops`, 1024² and 2048² matmuls);
- stall: a short chat streams (sampled, seeded, up to 400 tokens) while the agent prompt arrives; the longest gap
  between two of its tokens, and its tokens during the agent prompt's prefill.

    .venv/bin/python bench/prefill.py [--chunks 0,512,1024] [--prompt-tokens 7400] [--kernels aten,onednn]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent_prompt import build  # noqa: E402

from clawflow.base_model import base_model_dir  # noqa: E402
from clawflow.config import load_config  # noqa: E402
from clawflow.serving.engine import SamplingParams, TorchEngine  # noqa: E402
from clawflow.train.flops import matmul_peak_flops  # noqa: E402


def prefill_flops(model, n: int) -> float:
    c = model.config
    params = sum(p.numel() for p in model.parameters()) - c.vocab_size * c.hidden_size  # body (tied head)
    return 2 * params * n + 2 * 2 * c.num_hidden_layers * c.hidden_size * n * n / 2 + 2 * c.vocab_size * c.hidden_size


def run(path: str, chunk: int, agent: list[int], chat: list[int], kernel: str = "auto") -> dict:
    engine = TorchEngine(path, max_batch=4, prefix_cache_tokens=0, rewarm_tokens=0, prefill_chunk_tokens=chunk,
                         linear_kernel=kernel)
    try:
        engine.generate(chat, SamplingParams(max_new_tokens=4))  # warm-up
        t0 = time.perf_counter()
        engine.generate(agent, SamplingParams(max_new_tokens=1))
        cold = time.perf_counter() - t0
        stamps, first = [], threading.Event()

        def on_token(*_):
            stamps.append(time.perf_counter())
            first.set()
            return True

        stream = engine.submit(chat, SamplingParams(max_new_tokens=400, temperature=1.0, seed=0), on_token)
        first.wait(60)
        time.sleep(0.5)
        t1 = time.perf_counter()
        engine.generate(agent, SamplingParams(max_new_tokens=1))
        t2 = time.perf_counter()
        stream.result(timeout=600)
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > t1 - 0.5]
        return {"cold_s": cold, "stall_s": max(gaps) if gaps else float("nan"),
                "during": sum(t1 <= s <= t2 for s in stamps), "prefill_s": t2 - t1,
                "model": engine._policy.model, "kernel": engine.linear_kernel}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="0,512,1024", help="prefill_chunk_tokens settings (0 = whole prompt)")
    ap.add_argument("--prompt-tokens", type=int, default=7400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="auto", help="serving.linear_kernel settings, e.g. aten,onednn")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(base_model_dir(load_config()))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    system, tools, _ = build(tok, args.prompt_tokens)
    agent = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
                                    tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    peak = max(matmul_peak_flops("cpu", torch.float32, n, seconds=2.0) for n in (1024, 2048))
    print(f"agent prompt {len(agent)} tokens, {args.threads} threads, fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'kernel':>7s} {'chunk':>6s} {'cold s':>7s} {'tok/s':>7s} {'MFU':>6s} | {'stall s':>8s} {'tokens during':>13s} "
          f"{'prefill s (busy)':>16s}")
    for chunk, kernel in ((int(c), k) for c in args.chunks.split(",") for k in args.kernels.split(",")):
        r = run(path, chunk, agent, chat, kernel)
        mfu = prefill_flops(r["model"], len(agent)) / r["cold_s"] / peak
        print(f"{r['kernel']:>7s} {chunk:6d} {r['cold_s']:7.2f} {len(agent) / r['cold_s']:7.0f} {mfu:6.1%} | {r['stall_s']:8.2f} "
              f"{r['during']:13d} {r['prefill_s']:16.2f}", flush=True)


if __name__ == "__main__":
    main()
