"""The engine interface: what the gateway, its HTTP routes and the champion follower use of an engine.

The embedded torch engine (engine.py) and the SGLang adapter (sglang.py) both implement it
structurally; the gateway is typed against this, so a third engine is one more small class, not
`getattr` probes in the routes. (protocol.py is the OpenAI request models, not this.)
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from clawflow.serving.generation import Generation, SamplingParams, TokenCallback


@dataclass(frozen=True)
class EngineStats:
    """An engine's own gauges and counters for /metrics; 0 where an engine has no such thing."""

    queue_depth: int  # requests waiting for a decode slot
    active: int  # requests decoding
    decode_aborted: int = 0  # requests stopped early because their client went away
    prefix_cache_hits: int = 0
    prefix_cache_reused_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    tokenizer: Any  # the model's transformers tokenizer (logprobs spell each token with it)
    dtype: str | None  # float32, bfloat16 or bf16-weights; None where the engine settles it itself (SGLang)
    linear_kernel: str | None  # onednn or aten (fp32 Linears, torch engine); None where it does not apply
    last_rewarm: dict | None  # what the last reload's re-warm did (its /admin/reload answer); None: none

    @property
    def policy_version(self) -> int: ...

    @property
    def model_path(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat template's prompt token ids, generation prompt included."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_token: TokenCallback | None = None, user: str | None = None) -> Future[Generation]:
        """Queue a request; raises `QueueFull` at the engine's bound, before anything is decoded.
        `user`: decode with that user's own adapter when one is loaded (else the shared policy)."""
        ...

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_token: TokenCallback | None = None, user: str | None = None) -> Generation: ...

    def load_user_adapter(self, user: str, path: str, version: int | None = None) -> dict:
        """`user`'s requests from now on decode with the LoRA adapter at `path` (`version`: its number in
        the user's registry line, recorded with each turn it decodes); raises `AdapterError` and
        changes nothing when it cannot be served."""
        ...

    def unload_user_adapter(self, user: str) -> None: ...

    def user_adapter(self, user: str | None) -> str | None:
        """The path of the adapter `user`'s requests decode with; None: the shared policy."""
        ...

    def user_adapter_version(self, user: str | None) -> int | None:
        """The registry version of that adapter; None: the shared policy (or loaded without one)."""
        ...

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Log-probabilities of a fixed reply under the serving policy."""
        ...

    def reload(self, path: str, version: int) -> float:
        """Serve the checkpoint at `path` as `version`; seconds taken. `ReloadError` keeps the old one."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
