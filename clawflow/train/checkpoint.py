"""What the trainer writes: a Hugging Face directory (or a LoRA adapter), its optimizer state for the
next run, and the resumable state of an interrupted run. Everything here runs on rank 0 with full
CPU tensors already gathered (see `distributed.py`).

Checkpoint directory (loadable by transformers, SGLang, vLLM):
    model*.safetensors (+ index when sharded), config.json, generation_config.json, tokenizer
    files, clawflow_meta.json (parent version, turns consumed, loss stats), and with
    train.keep_optimizer: trainer_state/optimizer.pt (AdamW moments keyed by parameter name).
A LoRA checkpoint holds adapter_model.safetensors + adapter_config.json instead of the weights.

Resumable state of a run (`<out>.resume/`, deleted when the run completes): the weights (or the
adapter), optimizer.pt, state.json (step, scheduler, history) and each rank's cache.rank<r>.pt
(the start-of-run logprobs: pi_old, teacher, reference), written to a temp dir then renamed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from clawflow.policy.loader import ADAPTER_CONFIG, is_adapter  # noqa: F401 - where the trainer writes adapters

TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab.*", "merges.txt",
                   "added_tokens.json")
META_FILE = "clawflow_meta.json"
OPTIMIZER_FILE = Path("trainer_state") / "optimizer.pt"
def copy_tokenizer(src: Path, dst: Path) -> None:
    for pattern in (*TOKENIZER_FILES, "generation_config.json"):
        for f in Path(src).glob(pattern):
            if f.is_file():
                shutil.copy2(f, dst / f.name)


def model_dtype(model_dir: Path) -> torch.dtype:
    """The dtype a model directory's config declares (float32 when it declares none)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(model_dir), "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def write_model(out: Path, state: dict[str, torch.Tensor], config, dtype: torch.dtype) -> None:
    """Full weights as safetensors in `dtype`, plus config.json and a generation config."""
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # FSDP2 returns the tied head as a separate copy
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state, out, metadata={"format": "pt"})
    config.dtype = dtype
    config.save_pretrained(out)
    if not (out / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(out)


def write_adapter(out: Path, model, state: dict[str, torch.Tensor]) -> None:
    """A peft adapter directory from the gathered trainable (LoRA) parameters."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=state)
    save_file({k: v.contiguous() for k, v in adapter.items()}, out / "adapter_model.safetensors",
              metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(out)


def write_final(out: Path, meta: dict, totals: dict, history: list[dict], optim_state: dict | None) -> None:
    """Metadata, per-step metrics and (optionally) the optimizer state beside the weights."""
    losses = [r["loss"] for r in history]
    loss = {"first": losses[0], "last": losses[-1], "mean": sum(losses) / len(losses)} if losses else {}
    (out / META_FILE).write_text(json.dumps({**meta, **totals, "loss": loss}, indent=1))
    (out / "train_metrics.json").write_text(json.dumps({**totals, "per_step": history}, indent=1))
    if optim_state is not None:
        path = out / OPTIMIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(optim_state, path)


def write_resume(tmp: Path, optim_state: dict, state: dict) -> None:
    torch.save(optim_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))


def load_optimizer(src: Path) -> dict | None:
    path = Path(src) / OPTIMIZER_FILE
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def finish(tmp: Path, out: Path) -> None:
    """Atomically publish a fully written directory."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def resume_dir(out: Path) -> Path:
    return out.with_name(out.name + ".resume")


def read_resume_state(out: Path) -> dict | None:
    path = resume_dir(out) / "state.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_cache(out: Path, rank: int) -> dict:
    return torch.load(resume_dir(out) / f"cache.rank{rank}.pt", map_location="cpu", weights_only=False)
