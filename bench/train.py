"""One training step on SmolLM2-135M: clawflow's recipe vs TRL's GRPOTrainer vs a plain HF step.

Same model, same batch (2 prompts x 4 completions, 64 prompt + 192 completion tokens, rewards
+1/-1 normalized per group), fp32 on CPU, side by side in one run; `clawflow-bf16` is the shipped
recipe under `train.autocast: bfloat16` (bf16 matmuls, fp32 weights) and `trl-bf16` TRL's under
`bf16=True` (accelerate's CPU autocast): their MFU is against the bf16 peak and each is compared
with TRL in its own dtype. Each contender does one warm-up step and then `--steps` timed optimizer
steps; the median is reported.

- clawflow: `clawflow.train.recipe.Recipe` itself (1-rank process group, its own step loop) on the
  recipe users get: configs/default.yaml's `train` section as it ships (LoRA, `objective: distill`
  with its `negative_weight`, `kl_beta`'s KL to the adapter-off base scored in the pre-pass, its
  lr, micro_batch, autocast, TIS cap). Only what a step benchmark must set is changed: epochs (the
  warm-up + timed steps), `step_tokens` (one optimizer step takes the whole batch, as TRL's does),
  no resumable saves. The synthetic batch has no correction hints, so no reply is rewritten and no
  rehearsal is generated: those prepare data before the first step and are not step time.
- clawflow-rl: the full-weight recipe this row measured before (`objective: rl`, no LoRA, no KL,
  no TIS, lr 1e-6, one micro-batch): full weights, labelled as such.
- TRL: `GRPOTrainer.compute_loss` on prepared inputs (the loss its `training_step` uses after
  generation), `accelerator.backward`, its own AdamW `optimizer.step()`; loss_type "grpo",
  epsilon 0.2 / 0.28, beta 0, full weights, `gradient_checkpointing=False` pinned (TRL's default
  turns it on, which recomputes the forward in the backward).
- HF: `model(input_ids).logits` over every position, log-softmax, token-mean PG loss, backward,
  torch AdamW: the plainest baseline.

MFU = model FLOPs of the step (clawflow.train.flops: 6N per token for trained weights, 4N for
frozen ones (LoRA's base), causal attention: each query against the keys it sees, (L + 1) / 2 on
average, LM head at the positions each contender computes) / step time / the measured fp32 matmul
peak. Both are given
twice: by wall clock, and by this process's CPU time (all threads; the peak measured the same
way, and the rate scaled back by the thread count), which stays honest when other work shares
the cores: on a busy machine compare the CPU-time columns.

    CLAWFLOW_HOME=/work/main/.clawflow .venv/bin/python bench/train.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import torch

from clawflow.base_model import base_model_dir
from clawflow.config import REPO_ROOT, load_config
from clawflow.train.flops import causal_context, matmul_peak_flops, param_counts, train_flops

N_PROMPTS, GROUP, PROMPT_LEN, COMPLETION_LEN = 2, 4, 64, 192


def make_batch(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(N_PROMPTS)]
    rows = []
    for p, prompt in enumerate(prompts):
        for k in range(GROUP):
            completion = torch.randint(100, vocab, (COMPLETION_LEN,), generator=g).tolist()
            rows.append({"prompt": prompt, "completion": completion, "reward": 1.0 if k % 2 == 0 else -1.0, "group": p})
    return {"rows": rows}


def group_advantages(rows: list[dict]) -> torch.Tensor:
    r = torch.tensor([row["reward"] for row in rows]).view(N_PROMPTS, GROUP)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def flops_of(config, counts: dict[str, int], tokens: int, context: float, logit_tokens: int,
             head_trainable: bool = True) -> float:
    c = config
    return train_flops(counts, c.num_hidden_layers, c.hidden_size, c.vocab_size, tokens, context, logit_tokens,
                       head_trainable)


# -- contenders ------------------------------------------------------------------------------------
Timing = list[tuple[float, float]]  # (wall seconds, CPU seconds) per timed step


def recipe_train(steps: int, rows: int, recipe: str, autocast: str | None) -> dict:
    """The `train` section the clawflow rows run: configs/default.yaml's as shipped (`default`), or
    the full-weight RL recipe (`rl`); a step benchmark's settings on top."""
    import yaml

    shipped = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())["train"]
    if recipe == "default":
        train = dict(shipped)
    else:  # full weights, binary RL, no KL / TIS: what this bench measured as "clawflow" before
        train = {"lr": 1e-6, "micro_batch": rows, "objective": "rl", "tis_cap": None,
                 "autocast": shipped.get("autocast", "auto")}
    train.update(epochs=steps + 1, step_tokens=rows * COMPLETION_LEN, resume_every=0, keep_optimizer=False)
    if autocast is not None:
        train["autocast"] = autocast
    return train


def bench_clawflow(model_dir: str, batch: dict, steps: int, tmp: Path, autocast: str | None = None,
                   recipe: str = "default") -> tuple[Timing, dict[str, int], bool]:
    """(timing, parameter counts of the model trained, whether the LM head trains)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from clawflow.train.batch import load_samples
    from clawflow.train.objective import Objective
    from clawflow.train.plan import prepare_items
    from clawflow.train.recipe import Recipe

    rows = [{"prompt_token_ids": r["prompt"], "response_token_ids": r["completion"],
             "response_logprobs": [0.0] * COMPLETION_LEN, "reward": r["reward"], "group_id": f"g{r['group']}"}
            for r in batch["rows"]]
    pq.write_table(pa.Table.from_pylist(rows), tmp / "samples.parquet")
    raw = yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text())
    raw["train"] = recipe_train(steps, len(rows), recipe, autocast)
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "cfg.yaml").train
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    samples = load_samples(tmp / "samples.parquet")
    items, counts = prepare_items(cfg, Objective.from_config(cfg), samples, None, 0)
    args = Namespace(base=Path(model_dir), out=tmp / "out", parent_version=0, frozen_base=None, stop_after=0)
    run = Recipe(cfg, args, items, counts, [])
    run.setup()
    run.prepass()
    run.train()
    assert len(run.history) == steps + 1, f"{len(run.history)} optimizer steps, expected {steps + 1}"
    print(f"  {'clawflow' if recipe == 'default' else 'clawflow-rl'}: objective {cfg.objective}, "
          f"{'LoRA r=%d' % cfg.lora.r if cfg.lora else 'full weights'}, kl_beta {cfg.kl_beta}, lr {cfg.lr}, "
          f"micro_batch {cfg.micro_batch}, autocast {cfg.autocast}, {len(run.items)} sequences per step", flush=True)
    seconds = [(r["seconds"], r["cpu_seconds"]) for r in run.history[1:]]
    param_counts_ = dict(run.counts_params)
    run.cleanup()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the recipe's resumable-stop handler
    head_trainable = cfg.lora is None
    del run
    return seconds, param_counts_, head_trainable


def bench_trl(model_dir: str, batch: dict, steps: int, tmp: Path, bf16: bool = False) -> Timing:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=N_PROMPTS * GROUP,
                      num_generations=GROUP, learning_rate=1e-6, beta=0.0, loss_type="grpo", epsilon=0.2,
                      epsilon_high=0.28, use_cpu=True, bf16=bf16, report_to=[], max_grad_norm=1.0,
                      max_completion_length=COMPLETION_LEN, logging_steps=1000,
                      gradient_checkpointing=False)  # pinned: TRL's default recomputes activations
    data = Dataset.from_list([{"prompt": "hi"}] * (N_PROMPTS * GROUP))
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=data, processing_class=tok)
    assert not getattr(trainer.model, "is_gradient_checkpointing", False), "TRL turned gradient checkpointing on"
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop, which we bypass
    rows = batch["rows"]
    inputs = {"prompt_ids": torch.tensor([r["prompt"] for r in rows]),
              "prompt_mask": torch.ones(len(rows), PROMPT_LEN, dtype=torch.long),
              "completion_ids": torch.tensor([r["completion"] for r in rows]),
              "completion_mask": torch.ones(len(rows), COMPLETION_LEN, dtype=torch.long),
              "advantages": group_advantages(rows), "num_items_in_batch": torch.tensor(len(rows) * COMPLETION_LEN)}
    model.train()
    seconds = []
    for _ in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        seconds.append((time.perf_counter() - t0, time.process_time() - c0))
    return seconds[1:]


def bench_hf(model_dir: str, batch: dict, steps: int) -> Timing:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = batch["rows"]
    ids = torch.tensor([r["prompt"] + r["completion"] for r in rows])
    adv = group_advantages(rows)[:, None]
    seconds = []
    for _ in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)
        loss = -(torch.exp(lp - lp.detach()) * adv).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append((time.perf_counter() - t0, time.process_time() - c0))
    return seconds[1:]


# clawflow: configs/default.yaml's recipe (LoRA, distill, kl_beta); clawflow-rl: full weights, objective rl;
# clawflow-bf16: the default recipe under train.autocast bfloat16 (CPU); trl-bf16: GRPOConfig(bf16=True),
# accelerate's CPU autocast
CONTENDERS = ["clawflow", "clawflow-rl", "clawflow-bf16", "trl", "trl-bf16", "hf"]
LABELS = {"clawflow": "clawflow (default.yaml: LoRA, distill, kl_beta)", "clawflow-rl": "clawflow-rl (full weights, rl)",
          "clawflow-bf16": "clawflow-bf16 (default.yaml, bf16 autocast)", "trl": "trl (full weights)",
          "trl-bf16": "trl-bf16 (full weights)", "hf": "hf (full weights)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender (after one warm-up)")
    p.add_argument("--only", choices=CONTENDERS, action="append")
    args = p.parse_args()
    model_dir = base_model_dir(load_config(REPO_ROOT / "configs" / "default.yaml"))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config, full_counts = ref.config, param_counts(ref)
    batch = make_batch(config.vocab_size)
    del ref
    B, L = N_PROMPTS * GROUP, PROMPT_LEN + COMPLETION_LEN
    tokens, context = B * L, causal_context([L] * B)  # causal attention: (L + 1) / 2 keys per query
    logit_tokens = {"clawflow": B * (COMPLETION_LEN + 1), "clawflow-rl": B * (COMPLETION_LEN + 1),
                    "clawflow-bf16": B * (COMPLETION_LEN + 1), "trl": B * COMPLETION_LEN,
                    "trl-bf16": B * COMPLETION_LEN, "hf": B * L}
    flops = {}  # clawflow's rows: from the parameters the recipe really trains (LoRA: adapter only)
    threads = torch.get_num_threads()
    peak = max(matmul_peak_flops("cpu", torch.float32, n, seconds=2.0) for n in (1024, 2048))
    peak_cpu = max(matmul_peak_flops("cpu", torch.float32, n, 2.0, time.process_time) for n in (1024, 2048))
    bf16_peak = max(matmul_peak_flops("cpu", torch.bfloat16, n, seconds=2.0) for n in (1024, 2048))
    bf16_peak_cpu = max(matmul_peak_flops("cpu", torch.bfloat16, n, 2.0, time.process_time) for n in (1024, 2048))
    print(f"model {model_dir}, batch {B} x ({PROMPT_LEN} + {COMPLETION_LEN}) = {tokens} tokens, {threads} threads, "
          f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s wall, {peak_cpu * threads / 1e9:.1f} by CPU time; "
          f"bf16 {bf16_peak / 1e9:.1f} / {bf16_peak_cpu * threads / 1e9:.1f} (MFU of clawflow-bf16 is against it)",
          flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.only or CONTENDERS:
            tmp = Path(d) / name
            tmp.mkdir()
            if name.startswith("clawflow"):
                timing, counts, head = bench_clawflow(model_dir, batch, args.steps, tmp,
                                                      "bfloat16" if name == "clawflow-bf16" else None,
                                                      "rl" if name == "clawflow-rl" else "default")
            else:
                timing, counts, head = {"trl": lambda: bench_trl(model_dir, batch, args.steps, tmp),
                                        "trl-bf16": lambda: bench_trl(model_dir, batch, args.steps, tmp, bf16=True),
                                        "hf": lambda: bench_hf(model_dir, batch, args.steps)}[name](), full_counts, True
            flops[name] = flops_of(config, counts, tokens, context, logit_tokens[name], head)
            results[name] = (statistics.median(w for w, _ in timing), statistics.median(c for _, c in timing))
            print(f"  {name:13s} steps (wall s / cpu s) " + ", ".join(f"{w:.2f}/{c:.2f}" for w, c in timing)
                  + f"; {flops[name] / 1e9:.0f} GFLOP per step", flush=True)
    print(f"\n{'contender':46s} {'wall s':>7s} {'tok/s':>7s} {'MFU':>6s} {'vs TRL':>7s} | "
          f"{'cpu s':>7s} {'tok/s*':>7s} {'MFU*':>6s} {'vs TRL*':>7s}   (* by CPU time)")
    for name, (wall, cpu) in results.items():
        trl = "trl-bf16" if name.endswith("bf16") else "trl"  # each dtype against TRL in the same dtype
        vs = f"{results[trl][0] / wall:6.2f}x" if trl in results else "-"
        vs_cpu = f"{results[trl][1] / cpu:6.2f}x" if trl in results else "-"
        pw, pc = (bf16_peak, bf16_peak_cpu) if name.endswith("bf16") else (peak, peak_cpu)
        print(f"{LABELS[name]:46s} {wall:7.2f} {tokens / wall:7.1f} {flops[name] / wall / pw:6.1%} {vs:>7s} | "
              f"{cpu:7.2f} {tokens * threads / cpu:7.1f} {flops[name] / cpu / pc:6.1%} {vs_cpu:>7s}")


if __name__ == "__main__":
    main()
