"""LoRA with peft: wrap the policy for training, continue from an adapter checkpoint, merge to full.

A LoRA run trains only the adapter; its checkpoint is the adapter directory (a few MB) whose
`adapter_config.json` names the base model directory. The next run starts from that base plus
the champion's adapter; the embedded engine serves it by attaching the adapter to the base
weights it already holds (no full weight copy). `merge` writes a plain Hugging Face directory
for engines that take full weights:

    python -m clawflow.train.lora ADAPTER_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from clawflow.config import LoraSpec
from clawflow.policy import loader
from clawflow.policy.loader import adapter_base, weights_dir
from clawflow.train.checkpoint import copy_tokenizer, is_adapter


def merged_copy(model):
    """For generation: a copy of a LoRA-wrapped `model` with its adapter merged into the weights (one
    matmul per Linear instead of three); `model` itself when it has no adapter."""
    if not hasattr(model, "merge_and_unload"):
        return model
    import copy

    return copy.deepcopy(model).merge_and_unload().eval()


def load_policy(path: Path, dtype: torch.dtype, lora: LoraSpec | None):
    """The model to train from `path`: a full checkpoint, or base + adapter; LoRA-wrapped if asked.

    Returns (model, base_dir): base_dir holds the full weights and the tokenizer.
    """
    path = Path(path)
    base_dir = weights_dir(path)
    if lora is None:
        if is_adapter(path):
            raise ValueError(f"{path} is a LoRA adapter but train.lora is not set")
        return loader.load_policy(path, dtype), base_dir
    if is_adapter(path):  # continue the champion's adapter
        return loader.load_policy(path, dtype, merge=False, trainable=True), base_dir
    from peft import LoraConfig, get_peft_model

    spec = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    model = get_peft_model(loader.load_policy(path, dtype), spec)
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    return model, base_dir


def merge(adapter_dir: Path, out: Path) -> Path:
    """Write base + adapter merged as a full Hugging Face checkpoint directory at `out`."""
    merged = loader.load_policy(adapter_dir, torch.float32, merge=True)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    copy_tokenizer(adapter_base(adapter_dir), out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawflow.train.lora", description="Merge a LoRA adapter into full weights.")
    p.add_argument("adapter", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if not is_adapter(args.adapter):
        print(f"clawflow.train.lora: error: {args.adapter} is not a LoRA adapter directory", file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"clawflow.train.lora: error: {args.out} exists, refusing to overwrite", file=sys.stderr)
        return 2
    print(merge(args.adapter, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
