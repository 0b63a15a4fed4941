"""What a generation request and its answer look like, and the errors an engine raises.

Shared by the engines, the torch engine's batcher and the gateway; it imports nothing of clawflow
(nor torch), so any of them can import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0  # also return the k most likely tokens at each position


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # stop | length | abort
    policy_version: int
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # (token id, logprob), per position
    # the version of the user's own adapter that decoded it (their registry line); None: the shared policy
    adapter_version: int | None = None


# on_token(token_id, logprob, text_so_far, top) -> False to abort (client went away); `top` is the
# position's k most likely (token id, logprob) when SamplingParams.top_logprobs asks for them, else None
TokenCallback = Callable[[int, float, str, "list[tuple[int, float]] | None"], bool]


class QueueFull(RuntimeError):
    """Every decode slot is busy and the waiting queue is at its bound: try again later."""


class ReloadError(RuntimeError):
    """The checkpoint could not be loaded; the serving weights are unchanged."""


class AdapterError(ValueError):
    """A user's adapter that cannot be served (unreadable, or not applicable exactly); nothing changed.
    The message is one line."""
