"""What the prefix KV cache saves: an agent's turns share a long system prompt and re-send the whole
conversation each turn, so without the cache every turn prefills all of it again.

Side by side in one run, on SmolLM2-135M (fp32) in the embedded engine: the same agent sessions
(a system prompt of --system-words words, --turns turns each, greedy, --max-tokens per reply) against
an engine with `serving.prefix_cache_tokens` at its default and one with it at 0 (the baseline),
alternating session by session. Printed: mean time to first token per turn and the wall time of
whole sessions, cache vs no cache, as ratios; and that both engines produced the same tokens.

    .venv/bin/python bench/prefix.py [--sessions 4 --turns 4 --system-words 400 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RULES = ("Always answer briefly and cite the file you changed. Prefer small diffs, run the tests after each "
         "edit, never push to main, ask before deleting anything, keep secrets out of logs, and write commit "
         "messages in the imperative mood. ")
QUESTIONS = ["What does the deploy script do?", "Rename the config loader.", "Why is the build slow?",
             "Add a retry to the HTTP client.", "Summarize the last error.", "Which tests are flaky?"]


def session(engine, system: str, turns: int, max_tokens: int, offset: int) -> tuple[list[float], float, list]:
    from clawflow.serving.engine import SamplingParams

    messages, ttft, outs = [{"role": "system", "content": system}], [], []
    start = time.perf_counter()
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(offset + t) % len(QUESTIONS)]})
        t0, first = time.perf_counter(), []
        gen = engine.generate(engine.encode_chat(messages), SamplingParams(max_tokens, temperature=0.0),
                              lambda *a: first.append(time.perf_counter()) or True)
        ttft.append(first[0] - t0)
        outs.append(gen.token_ids)
        messages.append({"role": "assistant", "content": gen.text})
    return ttft, time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from clawflow.base_model import base_model_dir
    from clawflow.config import REPO_ROOT, ServingConfig, load_config
    from clawflow.serving.engine import TorchEngine

    path = base_model_dir(load_config(REPO_ROOT / "configs" / "default.yaml"))
    words = RULES.split()
    system = " ".join(words[i % len(words)] for i in range(args.system_words))
    engines = {"prefix cache": TorchEngine(path, prefix_cache_tokens=ServingConfig().prefix_cache_tokens),
               "no cache": TorchEngine(path, prefix_cache_tokens=0)}
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    wall: dict[str, list[float]] = {k: [] for k in engines}
    same = True
    for s in range(args.sessions):
        outs = {}
        for name in (list(engines) if s % 2 == 0 else list(engines)[::-1]):
            t, w, outs[name] = session(engines[name], f"{system} (session {s})", args.turns, args.max_tokens, s)
            ttft[name] += t
            wall[name].append(w)
        same &= outs["prefix cache"] == outs["no cache"]
    n = len(engines["prefix cache"].encode_chat([{"role": "system", "content": system}]))
    print(f"SmolLM2-135M fp32, {args.threads} threads; {args.sessions} sessions × {args.turns} turns, system prompt "
          f"{n} tokens, {args.max_tokens} tokens per reply, greedy")
    print(f"{'engine':<14} {'TTFT mean ms':>12} {'session s':>10}")
    for name in engines:
        print(f"{name:<14} {1e3 * statistics.mean(ttft[name]):12.0f} {statistics.mean(wall[name]):10.2f}")
    a, b = statistics.mean(ttft["no cache"]), statistics.mean(ttft["prefix cache"])
    wa, wb = statistics.mean(wall["no cache"]), statistics.mean(wall["prefix cache"])
    print(f"prefix cache vs none: time to first token {a / b:.2f}x faster, sessions {wa / wb:.2f}x faster; "
          f"same tokens: {same}; hits {engines['prefix cache'].batcher.prefix.hits}, reused tokens "
          f"{engines['prefix cache'].batcher.prefix.reused_tokens}")
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
