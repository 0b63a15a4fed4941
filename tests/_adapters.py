"""LoRA adapters with random A and B for the tests of users' adapters (an untrained LoRA's B is zero:
it would change nothing), of different ranks and target modules, as peft saves them."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = [(8, TARGETS), (4, ["q_proj", "v_proj"]), (16, ["down_proj", "o_proj"])]


def make_adapters(base_dir: str, root: Path) -> dict[str, Path]:
    """{"a0": dir, "a1": dir, "a2": dir}, each naming `base_dir` as its base, with its tokenizer."""
    out = {}
    for i, (r, targets) in enumerate(SHAPES):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                 init_lora_weights=False))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.3)
        model.peft_config["default"].base_model_name_or_path = str(base_dir)
        model.save_pretrained(root / f"a{i}")
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(root / f"a{i}")  # as the trainer's checkpoints
        out[f"a{i}"] = root / f"a{i}"
    return out
