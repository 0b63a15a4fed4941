"""Binary-RL training recipe, one file, run under torchrun (one process or many, same code):

    python -m torch.distributed.run --standalone --nproc_per_node=N -m clawflow.train.recipe \\
        --config CFG --base MODEL_DIR --batch SAMPLES.parquet --out OUT_DIR

Math (see `loss.py`): A = reward (+1/-1) on every response token; PPO clip (eps_low, eps_high)
with the ratio taken against the *recorded rollout logprobs* (pi_old = the serving policy, so
no TIS weight is needed yet); token-mean per sequence, mean over sequences. Simplifications:
reward-0 turns are skipped, no KL to the base, no group normalization, samples in file order
(no shuffle), one AdamW step per micro-batch, fp32 weights.

Data parallel: rank r takes samples[r::world]; each rank's loss is weighted by its share of the
micro-batch's sequences and gradients are summed with `all_reduce`, so a step equals one
process on the whole micro-batch. Rank 0 writes a Hugging Face checkpoint to OUT.tmp (weights,
config, tokenizer files, train_metrics.json) and renames it to OUT last.

Exit codes: 0 done, 2 bad arguments or inputs, 3 no trainable samples in the batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from clawflow.config import ConfigError, TrainConfig, load_config
from clawflow.train.batch import Sample, collate, load_samples
from clawflow.train.loss import binary_rl_advantages, ppo_clip_loss, sequence_logprobs

TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "chat_template*",
                   "generation_config.json", "vocab.*", "merges.txt", "added_tokens.json")


class InputError(Exception):
    """Bad arguments or inputs; `code` is the process exit status."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def shard_model(model: nn.Module, world_size: int) -> nn.Module:
    """Place for FSDP2 (`fully_shard` per decoder layer, then the root). For now every rank
    holds the full model and `sync_gradients` averages gradients (plain data parallel)."""
    return model


def sync_gradients(model: nn.Module, world_size: int) -> None:
    """Sum gradients across ranks (each rank's loss is already weighted by its share)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)  # a rank with no sequences this step still joins
        if world_size > 1 and p.grad is not None:
            dist.all_reduce(p.grad)


class BinaryRLRecipe:
    def __init__(self, cfg: TrainConfig, base: Path, out: Path):
        if not base.is_dir():
            raise InputError(f"base model directory not found: {base}")
        if out.exists():
            raise InputError(f"output already exists, refusing to overwrite: {out}")
        if cfg.micro_batch < 1 or cfg.epochs < 1:
            raise InputError("train.micro_batch and train.epochs must be >= 1")
        self.cfg, self.base, self.out = cfg, base, out
        self.loss_fn = partial(ppo_clip_loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
        self.history: list[dict] = []
        self.started = time.monotonic()

    def setup(self, samples: list[Sample]) -> None:
        from transformers import AutoModelForCausalLM

        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        model = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
        self.model = shard_model(model.to(self.device), self.world)
        self.pad_id = model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        self.n_samples = len(samples)
        self.samples = samples[self.rank :: self.world]
        per_rank = math.ceil(len(samples) / self.world)  # the most any rank holds
        self.steps_per_epoch = math.ceil(per_rank / self.cfg.micro_batch)

    def loss_step(self, micro: list[Sample]) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Forward one micro-batch; returns (loss, metrics), loss None for an empty slice."""
        if not micro:
            return None, {"clip_fraction": 0.0, "ratio_mean": 0.0, "n_tokens": 0.0, "n_seqs": 0.0}
        b = {k: v.to(self.device) for k, v in collate(micro, self.pad_id).items()}
        logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        logprobs = sequence_logprobs(logits[:, :-1], b["targets"])  # [B, L-1]
        advantages = binary_rl_advantages(b["rewards"], b["response_mask"])  # [B, L-1]
        return self.loss_fn(logprobs, b["old_logprobs"], advantages, b["response_mask"])

    def train(self) -> None:
        self.model.train()
        mb = self.cfg.micro_batch
        for epoch in range(self.cfg.epochs):
            for i in range(self.steps_per_epoch):
                loss, m = self.loss_step(self.samples[i * mb : (i + 1) * mb])
                n_local = m["n_seqs"]
                stats = torch.tensor(  # summed across ranks: global step metrics and weights
                    [n_local, m["n_tokens"], m["clip_fraction"] * m["n_tokens"],
                     m["ratio_mean"] * m["n_tokens"], 0.0 if loss is None else loss.item() * n_local],
                    dtype=torch.float64, device=self.device,
                )
                if self.world > 1:
                    dist.all_reduce(stats)
                n_seqs, n_tok, n_clip, ratio_sum, loss_sum = stats.tolist()
                if loss is not None and n_local:
                    (loss * (n_local / n_seqs)).backward()
                sync_gradients(self.model, self.world)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                row = {"step": len(self.history) + 1, "epoch": epoch,
                       "loss": loss_sum / max(n_seqs, 1), "clip_fraction": n_clip / max(n_tok, 1),
                       "ratio_mean": ratio_sum / max(n_tok, 1), "n_tokens": int(n_tok),
                       "n_seqs": int(n_seqs)}
                self.history.append(row)
                if self.rank == 0:
                    print(json.dumps(row), flush=True)

    def save_checkpoint(self) -> None:
        if self.rank == 0:
            tmp = self.out.with_name(self.out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self.model.save_pretrained(tmp)  # transformers 5: always safetensors
            for pattern in TOKENIZER_FILES:
                for f in self.base.glob(pattern):
                    if f.is_file():
                        shutil.copy2(f, tmp / f.name)
            totals = {"steps": len(self.history), "samples": self.n_samples,
                      "tokens": sum(r["n_tokens"] for r in self.history),
                      "seconds": round(time.monotonic() - self.started, 3),
                      "world_size": self.world}
            (tmp / "train_metrics.json").write_text(json.dumps({**totals, "per_step": self.history}, indent=1))
            os.replace(tmp, self.out)
            print(f"clawflow.train: saved {self.out}", flush=True)
        dist.barrier()

    def cleanup(self) -> None:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawflow.train.recipe", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--base", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--batch", required=True, type=Path, help="Parquet file of scored samples")
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if not args.batch.is_file():
            raise InputError(f"batch file not found: {args.batch}")
        rows = load_samples(args.batch)
        samples = [s for s in rows if s.reward != 0 and s.response_token_ids]
        if not samples:
            raise InputError(f"no trainable samples in {args.batch}: {len(rows)} rows, all with "
                             "reward 0 or an empty response", code=3)
        recipe = BinaryRLRecipe(cfg.train, args.base.resolve(), args.out.resolve())
    except (InputError, ConfigError, ValueError) as exc:
        print(f"clawflow.train: error: {exc}", file=sys.stderr, flush=True)
        return getattr(exc, "code", 2)
    recipe.setup(samples)
    recipe.train()
    recipe.save_checkpoint()
    recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
