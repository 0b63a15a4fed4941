"""Embedded torch engine: a transformers causal LM with KV-cached decoding.

Token-in/token-out: callers pass prompt token ids and get back the sampled ids and the policy's
log-probabilities of them (log-softmax of the raw logits, i.e. temperature 1: the π_old the trainer's
importance ratio needs, whatever temperature was used to sample). Hot reload loads the new weights
into a fresh model object and swaps one reference: a request that started on version N keeps its
model object and finishes on N, new requests get N+1, and a broken checkpoint never replaces the
serving one. (Batching across requests comes with the serving issue; here requests run side by
side in threads, bounded by the gateway's semaphore.)
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("clawflow.engine")


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # stop | length | abort
    policy_version: int


@dataclass(frozen=True)
class _Policy:
    model: Any
    version: int
    path: str


class ReloadError(RuntimeError):
    """The checkpoint could not be loaded; the serving weights are unchanged."""


# on_token(token_id, logprob, text_so_far) -> False to abort (client went away)
TokenCallback = Callable[[int, float, str], bool]


class TorchEngine:
    def __init__(self, model_path: str, version: int = 0, dtype: str = "float32", threads: int | None = None):
        from transformers import AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.dtype = getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._policy = _Policy(self._load(model_path), version, str(model_path))
        self._reload_lock = threading.Lock()
        self.eos_ids = self._eos_ids()

    # -- weights ---------------------------------------------------------------------------
    def _load(self, path: str):
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, output_loading_info=True)
        if info.get("missing_keys"):  # transformers fills them with random weights: never serve that
            raise ValueError(f"checkpoint lacks weights {sorted(info['missing_keys'])[:3]}")
        model.eval()
        return model

    @property
    def policy_version(self) -> int:
        return self._policy.version

    @property
    def model_path(self) -> str:
        return self._policy.path

    @property
    def context_length(self) -> int:
        return int(getattr(self._policy.model.config, "max_position_embeddings", 2048))

    def reload(self, path: str, version: int) -> float:
        """Swap in the checkpoint at `path` as `version`; returns seconds taken."""
        t0 = time.perf_counter()
        with self._reload_lock:
            if not Path(path).is_dir():
                raise ReloadError(f"checkpoint directory not found: {path}")
            try:
                model = self._load(path)
            except Exception as exc:  # any load failure keeps the old weights serving
                raise ReloadError(f"cannot load checkpoint {path}: {exc.__class__.__name__}: {exc}") from exc
            if model.config.vocab_size != self._policy.model.config.vocab_size:
                raise ReloadError(f"checkpoint {path} has another vocabulary size")
            self._policy = _Policy(model, version, str(path))
        return time.perf_counter() - t0

    # -- tokens ----------------------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen = getattr(self._policy.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos])
        return {i for i in ids if i is not None}

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- decoding --------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None) -> Generation:
        policy = self._policy  # pinned for the whole request: a reload never changes it mid-reply
        model = policy.model
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        out_ids: list[int] = []
        logprobs: list[float] = []
        text, finish = "", "length"
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(params.max_new_tokens):
            logits = out.logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            token = _sample(logits, params.temperature, params.top_p, gen)
            out_ids.append(token)
            logprobs.append(float(logp[token]))
            if token in self.eos_ids:
                finish = "stop"
                break
            text = self.decode(out_ids)
            if cuts := [text.index(s) for s in params.stop if s in text]:
                text, finish = text[: min(cuts)], "stop"  # the earliest stop string wins
                break
            if on_token is not None and not on_token(token, logprobs[-1], text):
                finish = "abort"
                break
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
        if finish == "stop" and out_ids and out_ids[-1] in self.eos_ids:
            text = self.decode(out_ids)
        return Generation(out_ids, logprobs, text, finish, policy.version)

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Log-probabilities of a fixed reply under the serving policy (evaluation, tests)."""
        ids = torch.tensor([prompt_ids + response_ids])
        logits = self._policy.model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0].tolist()


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
