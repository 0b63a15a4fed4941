"""The one way to load a policy: a full Hugging Face checkpoint, or a LoRA adapter on its base.

An adapter directory (`adapter_config.json`, written by the trainer) names the base model directory
it was trained on. How the adapter is used is the caller's choice:

- `merge=True` (default): base + adapter merged into plain weights; generation costs what the
  base's does (the gate, the helpfulness check, `python -m clawflow.train.lora` merge).
- `merge=False`: a peft model with the adapter attached, unmerged; `trainable=True` for the
  trainer (the adapter's weights train), `base_model=` to attach it to a base already in memory
  (the embedded engine shares one base's weight tensors across adapter versions).

Torch, transformers and peft are imported inside the function: importing this module stays cheap.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"  # written by the trainer (train/checkpoint.py) next to the adapter weights


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(adapter_dir: str | Path) -> Path:
    """The base model directory an adapter was trained on."""
    base = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter_dir}/{ADAPTER_CONFIG} names no base_model_name_or_path")
    return Path(base)


def weights_stamp(model_dir: str | Path) -> list:
    """What names a checkpoint's weights for a cache key: its real path and its weight files' names
    and mtimes, an adapter's base's too (a checkpoint directory is written once, then renamed in)."""
    d = Path(model_dir).resolve()
    dirs = [d]
    if (d / ADAPTER_CONFIG).is_file():
        dirs.append(adapter_base(d).resolve())
    return [(str(x), f.name, f.stat().st_mtime_ns) for x in dirs for f in sorted(x.glob("*.safetensors"))]


def weights_dir(path: str | Path) -> Path:
    """The directory holding the full weights (and the tokenizer) of `path`: an adapter's base, else `path`."""
    path = Path(path)
    return adapter_base(path) if is_adapter(path) else path


def tokenizer_for(path: str | Path):
    """The tokenizer of the policy at `path` (an adapter's: its base's), loaded once per process."""
    return _tokenizer(str(weights_dir(path).resolve()))


@functools.lru_cache(maxsize=4)
def _tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def load_policy(path: str | Path, dtype: Any = None, *, merge: bool = True, trainable: bool = False,
                base_model: Any = None, strict: bool = False):
    """The model at `path` (a full checkpoint or a LoRA adapter directory) in `dtype` (float32 when None).

    For an adapter: merged into its base when `merge`, else a peft model with the adapter attached
    (`trainable`: its weights train); `base_model` is a base already loaded to attach it to (used
    as it is: `dtype` and `strict` then apply to nothing). `strict`: a ValueError when the
    checkpoint lacks weights (transformers would fill them with random values). The model is
    returned as `from_pretrained` gives it; callers set eval() or train() themselves.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    adapter = is_adapter(path)
    if merge and trainable:
        raise ValueError("a trainable adapter cannot be merged")
    model = base_model
    if model is None:
        src = adapter_base(path) if adapter else path
        model, info = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or torch.float32, output_loading_info=True)
        if strict and info.get("missing_keys"):
            raise ValueError(f"checkpoint lacks weights {sorted(info['missing_keys'])[:3]}")
    if not adapter:
        return model
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, path, is_trainable=trainable)
    return model.merge_and_unload() if merge else model
