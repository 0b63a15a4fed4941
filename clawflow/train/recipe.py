"""Training recipe (binary RL + OPD), one class read top to bottom, run under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node=N -m clawflow.train.recipe \\
        --config CFG --base START_DIR --batch SAMPLES.parquet --out OUT_DIR \\
        [--parent-version V] [--frozen-base BASE_DIR] [--stop-after STEPS] \\
        [--preferences PREFS.json] [--cache-dir DIR] [--broad-seed S]

`--prepare` (no --batch, --out) only writes into --cache-dir the rewrites a run from --base with
--preferences will read: the flow runs it after a promotion, so the next run finds them done.
The rewrite phase (distillation's new replies, before training) is `recipe_rewrite.py`.

Math: `loss.py` and `advantages.py`; the objective is assembled once from config (`objective.py`).
pi_old is the policy at the start of the run: for the first optimizer step it is the training
forward itself (the weights have not moved yet); samples of later steps get it, with the OPD
teacher (the same start-of-run policy on the hint-augmented prompt, or the frozen base) and the
KL reference, from one no-grad pass before training. The recorded rollout logprobs only enter
through the TIS weight.

Steps: samples are packed into optimizer steps by `train.step_tokens` response tokens (gradient
accumulation), each step split over ranks and `train.micro_batch` sequences per forward. Each
micro-batch's loss numerator is divided by the step's global denominator (sequences or tokens,
summed over ranks), so N ranks take the same step as one process on the whole batch.

Output: rank 0 writes OUT.tmp and renames it to OUT (see `checkpoint.py`). A run stopped by
SIGTERM or `--stop-after` saves OUT.resume and exits 75; the same command resumes it.

Exit codes: 0 done, 2 bad arguments or inputs, 3 no trainable samples, 75 interrupted (resumable).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import time
import zlib
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from clawflow.config import ConfigError, TrainConfig, load_config
from clawflow.policy.loader import load_policy as load_full_policy
from clawflow.policy.logprobs import response_logprobs
from clawflow.train import checkpoint as ckpt
from clawflow.train import distributed as D
from clawflow.train import attention, optim, precision
from clawflow.train.flops import causal_context, matmul_peak_flops, param_counts, peak_memory_mb, train_flops
from clawflow.train.lora import load_policy
from clawflow.train.objective import STAT_KEYS, Objective
from clawflow.train.plan import (InputError, Item, collate_items, load_items, next_run_items, plan_steps,
                                 rank_micro_batches)
from clawflow.train.recipe_rewrite import RewritePhase
from clawflow.train.scoring import cached, cached_topk, dummy_forward, score_items, topk_items

EXIT_INTERRUPTED = 75
PREFERENCES_REPORT = "preferences.json"


class Interrupted(Exception):
    """Stopped at a step boundary with a resumable state saved."""


class Recipe(RewritePhase):
    def __init__(self, cfg: TrainConfig, args: argparse.Namespace, items: list[Item], counts: dict, turn_ids: list):
        self.cfg, self.args, self.items, self.counts, self.turn_ids = cfg, args, items, counts, turn_ids
        self.out: Path = args.out
        self.objective = Objective.from_config(cfg)
        self.plan = plan_steps(items, cfg.step_tokens, cfg.seed)
        self.total_steps = len(self.plan) * cfg.epochs
        self.history: list[dict] = []
        self.cache: dict[str, dict] = {"old": {}, "teacher": {}, "ref": {}, "topk": {}}
        self.start_step, self.stop_requested, self.started = 0, False, time.monotonic()
        self.preferences: list[dict] = getattr(args, "preferences_list", None) or []
        self.dropped: set[int] = set()  # items of preferences dropped for this run
        self.pref_report: dict | None = None
        self.taught_ids: list[str] = []  # the standing preferences the teacher reads (rewrite_cache keys)

    # -- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        model, resume = self.load_and_rewrite()
        self.prepare_training(model, resume)

    def load_and_rewrite(self):
        cfg = self.cfg
        self.rank, self.world, self.device = D.init()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        resume = ckpt.read_resume_state(self.out)
        if resume and resume["world"] != self.world:
            raise InputError(f"{ckpt.resume_dir(self.out)} was written by {resume['world']} ranks; "
                             f"resume it with --nproc_per_node={resume['world']}")
        start = self.start_dir = ckpt.resume_dir(self.out) / "model" if resume else self.args.base
        model, self.base_dir = load_policy(start, torch.float32, cfg.lora)
        self.save_dtype = ckpt.model_dtype(self.base_dir)
        self.pad_id = model.config.pad_token_id or 0
        if resume:
            self.cache = ckpt.load_cache(self.out, self.rank)
        t_rewrite = time.monotonic()
        self.rewrite(model.to(self.device))
        self.rewrite_seconds = round(time.monotonic() - t_rewrite, 1)
        return model, resume

    def prepare_training(self, model, resume) -> None:
        cfg = self.cfg
        bf16, speedup = precision.choose(cfg.autocast, model, self.device) if self.rank == 0 else (False, None)
        self.bf16 = bool(D.broadcast_from_rank0(bf16))  # every rank computes the same way
        if self.bf16:
            self._log("clawflow.train: bf16 autocast" + (f" (a training step {speedup:.2f}x faster than fp32)"
                                                         if speedup else " (train.autocast: bfloat16)"))
            attention.use(model)  # short rows: bf16 matmul attention, faster than SDPA's CPU kernel
        elif speedup:
            self._log(f"clawflow.train: fp32 (bf16 autocast only {speedup:.2f}x faster here)")
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        self.counts_params = param_counts(model)
        self.model = D.shard_model(model.to(self.device), self.world, self.device, cfg.mixed_precision)
        state = torch.load(ckpt.resume_dir(self.out) / "optimizer.pt", weights_only=False) if resume \
            else ckpt.load_optimizer(self.args.base) if cfg.keep_optimizer else None
        self.optimizer, self.scheduler = optim.build(self.model, cfg, self.total_steps, state, bool(resume),
                                                     self._log, str(self.args.base))
        if resume:
            self.scheduler.load_state_dict(resume["scheduler"])
            self.start_step, self.history = resume["step"], resume["history"]
            self._log(f"clawflow.train: resuming at step {self.start_step + 1} from {ckpt.resume_dir(self.out)}")
        peak_dtype = torch.bfloat16 if self.bf16 or (self.device.type == "cuda" and cfg.mixed_precision) \
            else torch.float32
        self.peak = cfg.peak_flops or matmul_peak_flops(self.device, peak_dtype, seconds=0.5)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_) -> None:
        self.stop_requested = True

    # -- start-of-run logprobs -----------------------------------------------------------------
    def prepass(self) -> None:
        """pi_old for samples after the first step, OPD teacher and KL reference logprobs."""
        if self.start_step > 0:
            return  # restored with the resumable state
        mine = sorted({i for step in self.plan for mb in
                       rank_micro_batches(step, self.rank, self.world, self.cfg.micro_batch) for i in mb})
        first, lora = set(self.plan[0]), self.cfg.lora is not None
        score = partial(score_items, items=self.items, micro_batch=self.cfg.micro_batch, pad_id=self.pad_id,
                        device=self.device)
        self.model.eval()
        with precision.autocast(self.bf16):  # as the training forward computes them
            self.cache["old"] = score(self.model, todo=[i for i in mine if i not in first], hinted=False)
            to_start = self.cfg.kl_reference == "start"
            base = self._frozen_base() if (self.objective.needs_teacher and self.cfg.teacher == "base") \
                or (self.cfg.kl_beta and not to_start) else None
            if self.objective.needs_teacher:
                hinted = [i for i in mine if self.items[i].teacher_prompt]
                by_base = self.cfg.teacher == "base"
                self.cache["teacher"] = score(base if by_base else self.model, todo=hinted, hinted=True,
                                              adapter_off=by_base and lora)
            if self.cfg.kl_beta and not to_start:  # `start`: the reference is pi_old, the fallback below
                self.cache["ref"] = score(base, todo=mine, hinted=False, adapter_off=lora)
            if self.objective.distill_topk:  # the start-of-run policy reading the hint: what a rewrite learns
                by_base = self.cfg.rewrite_teacher == "base"
                self.cache["topk"] = topk_items(self._frozen_base() if by_base else self.model, self.items,
                                                [i for i in mine if self.items[i].rewrite], self.objective.distill_topk,
                                                self.cfg.micro_batch, self.pad_id, self.device,
                                                adapter_off=by_base and lora)
        self.model.train()

    def _frozen_base(self):
        """The frozen base: the policy itself with its adapter switched off (LoRA), else loaded and sharded."""
        if self.cfg.lora is not None:
            return self.model
        path = self.args.frozen_base or self.base_dir
        model = load_full_policy(path, torch.float32).to(self.device).eval()
        return D.shard_model(model, self.world, self.device, self.cfg.mixed_precision)

    # -- one step --------------------------------------------------------------------------------
    def loss_step(self, b: dict, denominator: float) -> dict[str, float]:
        """Forward and backward one micro-batch; returns its summed stats."""
        its, k = b["items"], self.objective.distill_topk
        ids, teacher_topk = cached_topk(self.cache.get("topk", {}), its, k, b["mask"].shape[1]) if k else (None, None)
        with precision.autocast(self.bf16):
            lp = response_logprobs(self.model, [it.prompt for it in its], [it.response for it in its], self.pad_id,
                                   self.device, candidates=ids)  # [B, R] (and [B, R, k])
        if k:
            lp, student_topk = lp
            b.update(topk_student=student_topk, topk_teacher=teacher_topk)
        old = cached(self.cache["old"], its, lp)  # first step: the forward itself is pi_old
        for row, it in enumerate(its):
            self.cache["old"].setdefault(it.index, old[row, : len(it.response)].clone())
        b.update(old=old, teacher=cached(self.cache["teacher"], its, torch.zeros_like(old)),
                 ref=cached(self.cache["ref"], its, old))
        t = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        num, stats = self.objective(lp, t)
        (num * (self.world / denominator)).backward()
        return stats

    def train(self) -> None:
        self.model.train()
        cfg, params = self.cfg, [p for p in self.model.parameters() if p.requires_grad]
        n_layers, hidden = self.model.config.num_hidden_layers, self.model.config.hidden_size
        for step_idx in range(self.start_step, self.total_steps):
            t0, c0 = time.perf_counter(), time.process_time()
            plan_step = self.plan[step_idx % len(self.plan)]
            micros = rank_micro_batches(plan_step, self.rank, self.world, cfg.micro_batch)
            batches = [collate_items([self.items[i] for i in m], self.pad_id) if m else None for m in micros]
            (den,) = D.all_sum([sum(self.objective.denominator(b) for b in batches if b)], self.device)
            stats: dict[str, float] = defaultdict(float)
            rmin, rmax, flops, tokens = math.inf, -math.inf, 0.0, 0
            for b in batches:
                if b is None:
                    dummy_forward(self.model, self.pad_id, self.device).backward()
                    continue
                st = self.loss_step(b, den)
                for k in STAT_KEYS:
                    stats[k] += st[k]
                rmin, rmax = min(rmin, st.get("ratio_min", math.inf)), max(rmax, st.get("ratio_max", -math.inf))
                n_real = int(b["attention_mask"].sum())
                tokens += n_real
                flops += train_flops(self.counts_params, n_layers, hidden, self.model.config.vocab_size, n_real,
                                     causal_context(b["attention_mask"].sum(1).tolist()), int(b["mask"].numel()), cfg.lora is None)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            summed = D.all_sum([stats[k] for k in STAT_KEYS] + [tokens, flops / (dt * self.peak)], self.device)
            s = dict(zip(STAT_KEYS, summed))
            neg_min, ratio_max = D.all_max([-rmin, rmax], self.device)
            row = {"step": step_idx + 1, "epoch": step_idx // len(self.plan),
                   "loss": (s["pg"] + cfg.kl_beta * s["kl"]) / den, **Objective.metrics(s, den),
                   "ratio_min": -neg_min, "ratio_max": ratio_max,
                   "grad_norm": float(grad_norm), "lr": lr, "n_tokens": int(s["n_tok"]), "n_seqs": len(plan_step),
                   "tokens": int(summed[-2]), "tokens_per_s": summed[-2] / dt, "mfu": summed[-1] / self.world,
                   "peak_mem_mb": peak_memory_mb(self.device), "seconds": round(dt, 3),
                   "cpu_seconds": round(time.process_time() - c0, 3)}
            self.history.append(row)
            self._log(json.dumps(row))
            last = step_idx + 1 == self.total_steps
            stop = self.stop_requested or (self.args.stop_after and step_idx + 1 >= self.args.stop_after)
            if not last and (stop or (cfg.resume_every and (step_idx + 1) % cfg.resume_every == 0)):
                self.save_resume(step_idx + 1)
                if stop:
                    raise Interrupted(f"stopped after step {step_idx + 1}; resumable state in "
                                      f"{ckpt.resume_dir(self.out)}")

    # -- output -----------------------------------------------------------------------------------
    def _write_weights(self, target: Path, state: dict) -> None:
        if self.cfg.lora is not None:
            ckpt.write_adapter(target, self.model, state)
        else:
            ckpt.write_model(target, state, self.model.config, self.save_dtype)
        ckpt.copy_tokenizer(self.base_dir, target)

    def save_resume(self, step: int) -> None:
        """Weights, AdamW, schedule, history and every rank's start-of-run logprobs, published atomically."""
        state = D.full_model_state(self.model, trainable_only=self.cfg.lora is not None)
        optim_state = D.full_optimizer_state(self.model, self.optimizer)
        tmp = ckpt.resume_dir(self.out).with_suffix(".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        torch.save(self.cache, tmp / f"cache.rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            self._write_weights(tmp / "model", state)
            ckpt.write_resume(tmp, optim_state, {"step": step, "world": self.world, "history": self.history,
                                                 "scheduler": self.scheduler.state_dict()})
            ckpt.finish(tmp, ckpt.resume_dir(self.out))
        dist.barrier()

    def save_checkpoint(self) -> None:
        state = D.full_model_state(self.model, trainable_only=self.cfg.lora is not None)
        optim_state = D.full_optimizer_state(self.model, self.optimizer) if self.cfg.keep_optimizer else None
        if self.rank == 0:
            tmp = self.out.with_name(self.out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self._write_weights(tmp, state)
            totals = {"steps": len(self.history), "samples": self.counts["samples"], "trainable": len(self.items),
                      "tokens": sum(r["n_tokens"] for r in self.history), "world_size": self.world,
                      "seconds": round(time.monotonic() - self.started, 3), "peak_flops": self.peak,
                      "rewrite_seconds": self.rewrite_seconds,
                      "bf16_autocast": float(self.bf16)}
            meta = {"parent_version": self.args.parent_version, "base": str(self.base_dir),
                    "lora": self.cfg.lora is not None, "objective": self.cfg.objective, "teacher": self.cfg.teacher,
                    "turns_consumed": len(self.turn_ids), "turn_ids": self.turn_ids, "counts": self.counts}
            ckpt.write_final(tmp, meta, totals, self.history, optim_state)
            if self.pref_report is not None:  # read back by the flow: strengths, what was taught and dropped
                (tmp / PREFERENCES_REPORT).write_text(json.dumps(self.pref_report, indent=1))
            ckpt.finish(tmp, self.out)
            shutil.rmtree(ckpt.resume_dir(self.out), ignore_errors=True)
            self._log(f"clawflow.train: saved {self.out}")
        dist.barrier()

    def cleanup(self) -> None:
        dist.destroy_process_group()

    def _log(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawflow.train.recipe", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--base", required=True, type=Path, help="start weights: a HF directory or a LoRA adapter")
    p.add_argument("--batch", type=Path, help="Parquet file of scored samples")
    p.add_argument("--out", type=Path, help="checkpoint directory to create")
    p.add_argument("--parent-version", type=int, default=0, help="registry version of --base (staleness, metadata)")
    p.add_argument("--frozen-base", default=None, help="the frozen base, a directory or hub id (teacher: base, KL ref)")
    p.add_argument("--stop-after", type=int, default=0, help="stop resumably after this many steps (0: never)")
    p.add_argument("--preferences", type=Path, default=None,
                   help="JSON list of the user's standing preferences ({pref_id, text, variants}), strongest first")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="rewrites and preference strengths kept across runs (train/rewrite_cache.py)")
    p.add_argument("--broad-seed", type=int, default=None,
                   help="which general prompts this run draws (default: from --out's name)")
    p.add_argument("--gate-cache", type=Path, default=None,
                   help="--prepare: also write the gate's teacher answers for these weights into this directory")
    p.add_argument("--prepare", action="store_true",
                   help="only write the rewrites a run from --base with --preferences will read into --cache-dir "
                        "(no --batch, no training)")
    args = p.parse_args(argv)
    args.base = args.base.resolve()
    if args.prepare and not (args.cache_dir and args.preferences):
        p.error("--prepare needs --cache-dir and --preferences")
    if not args.prepare and not (args.batch and args.out):
        p.error("--batch and --out are required")
    args.out = (args.out or args.cache_dir / "prepare").resolve()
    try:
        cfg = load_config(args.config).train
        if not args.base.is_dir():
            raise InputError(f"base model directory not found: {args.base}")
        if args.out.exists() and not args.prepare:
            raise InputError(f"output already exists, refusing to overwrite: {args.out}")
        args.preferences_list = json.loads(args.preferences.read_text()) if args.preferences else []
        seed = args.broad_seed if args.broad_seed is not None else zlib.crc32(args.out.name.encode())
        if args.prepare:
            items, counts, turn_ids = next_run_items(cfg, args.base, args.parent_version, args.preferences_list,
                                                     seed), {}, []
        else:
            items, counts, turn_ids = load_items(cfg, args.batch, args.base, args.parent_version,
                                                 args.preferences_list, seed)
        recipe = Recipe(cfg, args, items, counts, turn_ids)
        if args.prepare:
            recipe.prepare_only()
            recipe.cleanup()
            return 0
        recipe.setup()
    except (InputError, ConfigError, ValueError, OSError) as exc:
        print(f"clawflow.train: error: {exc}", file=sys.stderr, flush=True)
        return getattr(exc, "code", 2)
    try:
        recipe.prepass()
        recipe.train()
    except Interrupted as exc:
        recipe._log(f"clawflow.train: {exc}")
        recipe.cleanup()
        return EXIT_INTERRUPTED
    recipe.save_checkpoint()
    recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
