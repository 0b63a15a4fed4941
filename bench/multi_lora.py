"""One decode step over rows of many users' LoRA adapters (issue #29): is grouping worth it on CPU?

On SmolLM2-135M (the default model, fp32), B decode rows over a KV cache of --context tokens, each
step timed, the variants interleaved round by round so a busy machine slows them alike:

- `one adapter`: every row on the one served adapter, with peft (unmerged): the baseline;
- `shared, per row`: the same adapter as the default of a MultiLora, every row naming none: how the
  engine serves a LoRA shared policy, so that users' own adapters can replace it row by row;
- `grouped, B adapters`: clawflow/serving/multi_lora.py, every row on its own adapter, one forward;
- `apart, B adapters`: what serving B users costs without grouping: one forward per adapter
  (peft, one row each), the base weights read B times.

Adapters are r --rank on all seven projections with random A and B, as a trained one has.
Reported as tokens/s and as the ratio to `one adapter` (the issue's target: >= 0.8 at 8 users).

    PYTHONPATH=. .venv/bin/python bench/multi_lora.py [--batches 8 32 --context 256 --steps 8]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clawflow.base_model import base_model_dir  # noqa: E402
from clawflow.config import load_config  # noqa: E402

# the Linears users' adapters train as shipped (configs/default.yaml `train.lora.target_modules`)
TARGETS = load_config(Path(__file__).resolve().parents[1] / "configs" / "default.yaml").train.lora.target_modules


def make_adapters(base_dir: str, n: int, rank: int, out: Path) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            init_lora_weights=False))
    for i in range(n):
        torch.manual_seed(i)
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.data.normal_(0, 0.02)
        peft.save_pretrained(out / f"u{i}")
        paths.append(out / f"u{i}")
    return paths


def _rss() -> int:
    """This process's resident memory in bytes (Linux)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _decode_state(model, rows: int, context: int):
    from clawflow.serving.kv_cache import new_cache

    cache = new_cache()
    with torch.inference_mode():
        model(torch.randint(100, 10_000, (rows, context), generator=torch.Generator().manual_seed(0)),
              cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _fused_step(model, cache, rows: int, at: int) -> None:
    from clawflow.serving import fused_step

    mask = torch.ones(rows, at + 1, dtype=torch.long)
    fused_step.forward(model, torch.full((rows,), 42), torch.full((rows,), at), mask, cache, [])


def run(args) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from clawflow.serving.multi_lora import MultiLora, read_adapter

    torch.set_num_threads(args.threads)
    base_dir = base_model_dir(load_config())
    tmp = Path(tempfile.mkdtemp(prefix="multi-lora-"))
    top = max(args.batches)
    paths = make_adapters(base_dir, top, args.rank, tmp)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    shared = {id(t): t for t in itertools.chain(base.parameters(), base.buffers())}

    def shell():  # new modules on the same weight tensors, as the engine attaches adapters
        return copy.deepcopy(base, dict(shared))

    one = PeftModel.from_pretrained(shell(), paths[0]).eval()
    grouped_model = shell()
    multi = MultiLora(grouped_model)
    shared_model = shell()
    shared_multi = MultiLora(shared_model)
    shared_multi.load("shared", read_adapter(paths[0]))
    shared_multi.default = "shared"
    nbytes, load_s = [], []
    rss0 = _rss()
    for i, p in enumerate(paths):
        t0 = time.perf_counter()
        nbytes.append(multi.load(f"u{i}", read_adapter(p)))  # what load_user_adapter does
        load_s.append(time.perf_counter() - t0)
    print(f"SmolLM2-135M fp32, {args.threads} threads, context {args.context}, rank {args.rank}: "
          f"{nbytes[0] / 2**20:.1f} MiB of tensors per adapter, RSS +{(_rss() - rss0) / len(paths) / 2**20:.1f} MiB "
          f"per loaded adapter ({len(paths)} loaded), loaded in {statistics.median(load_s):.3f} s (median)")
    print(f"{'rows':>5} {'one adapter tok/s':>18} {'shared, per row':>16} {'ratio':>6} {'grouped tok/s':>14} "
          f"{'ratio':>6} {'apart tok/s':>12} {'ratio':>6}")
    for rows in args.batches:
        apart_models = [PeftModel.from_pretrained(shell(), p).eval() for p in paths[:rows]]
        caches = {"one": _decode_state(one, rows, args.context),
                  "shared": _decode_state(shared_model, rows, args.context),
                  "grouped": _decode_state(grouped_model, rows, args.context),
                  "apart": [_decode_state(m, 1, args.context) for m in apart_models]}
        times: dict[str, list[float]] = {"one": [], "shared": [], "grouped": [], "apart": []}
        keys = [f"u{i}" for i in range(rows)]
        with torch.inference_mode():
            for step in range(args.steps):
                at = args.context + step
                order = ["one", "shared", "grouped", "apart"]
                for name in itertools.islice(itertools.cycle(order), step % 4, step % 4 + 4):
                    t0 = time.perf_counter()
                    if name == "one":
                        _fused_step(one, caches["one"], rows, at)
                    elif name == "shared":
                        _fused_step(shared_model, caches["shared"], rows, at)
                    elif name == "grouped":
                        with multi.route(keys):
                            _fused_step(grouped_model, caches["grouped"], rows, at)
                    else:
                        for m, c in zip(apart_models, caches["apart"]):
                            _fused_step(m, c, 1, at)
                    times[name].append(time.perf_counter() - t0)
        tps = {k: rows / statistics.median(v[1:]) for k, v in times.items()}  # the first step warms up
        print(f"{rows:>5} {tps['one']:>18.1f} {tps['shared']:>16.1f} {tps['shared'] / tps['one']:>6.2f} "
              f"{tps['grouped']:>14.1f} {tps['grouped'] / tps['one']:>6.2f} "
              f"{tps['apart']:>12.1f} {tps['apart'] / tps['one']:>6.2f}")
    reload_check(grouped_model, multi, paths, min(8, top), args)


def reload_check(model, multi, paths: list[Path], rows: int, args) -> None:
    """A turn of the other users (`args.steps` decode steps of `rows` rows on their own adapters) while
    one user's adapter is loaded beside it on another thread, as `load_user_adapter` runs beside the
    decode loop, against the same turn without; alternated, 3 of each."""
    import threading

    from clawflow.serving.multi_lora import read_adapter

    keys = [f"u{i}" for i in range(rows)]
    cache = _decode_state(model, rows, args.context)
    times: dict[str, list[float]] = {"quiet": [], "reload": []}
    at = args.context
    with torch.inference_mode():
        for i, phase in enumerate(["quiet", "reload"] * 3):
            worker = threading.Thread(target=lambda k=f"again-{i}": multi.load(k, read_adapter(paths[0])))
            t0 = time.perf_counter()
            if phase == "reload":
                worker.start()
            for _ in range(args.steps):
                with multi.route(keys):
                    _fused_step(model, cache, rows, at)
                at += 1
            if phase == "reload":
                worker.join()
                multi.unload(f"again-{i}")
            times[phase].append(time.perf_counter() - t0)
    quiet, busy = statistics.median(times["quiet"]), statistics.median(times["reload"])
    print(f"{rows} rows on {rows} adapters, a turn of {args.steps} steps: {quiet:.2f} s, {busy:.2f} s with one "
          f"adapter loaded beside it ({busy / quiet:.2f}x)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
