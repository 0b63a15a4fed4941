"""Re-warm on reload: prefill the hottest cached prompts with the NEW weights before the swap.

A reload must drop the old version's prefix KV (its keys and values are stale), and in this product
a reload follows every training run, so without this the user's next turn after each new version
would prefill its whole agent prompt again (~16 s for OpenClaw's 7.7k tokens on 2 CPU cores).

A `RewarmJob` runs on the batcher's decode thread, one chunk of prefill per loop iteration, between
the old version's decode steps and prefills: the old version keeps serving meanwhile, and the prefix
cache stays a one-thread structure. When no request is active, a prompt is prefilled in one pass
(SDPA's causal kernel: on 2 cores a 7.4k-token prompt took 67 s in one pass under load, 104 s in
2k-token chunks, whose attention runs with an explicit mask over the whole past); a request that
arrives meanwhile waits for that pass. While requests are active the job gets at most half of the
thread's time: a BUSY_CHUNK runs only once the requests' work since the job started exceeds the
job's own, so streams slow to about half speed and never stall behind a whole prompt.

The job's results go to its own staging `PrefixCache`, keyed by the new version, which also lets a
later prompt reuse the re-warmed KV of an earlier one (agents share their system prompt: it is
prefilled once). The engine installs the staged entries when it swaps; if the job fails (out
of memory, any exception), the swap goes ahead cold. At the deadline the job stops and keeps what it
has: a prompt prefilled part-way is kept as the prefix it reached.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from clawflow.serving.prefix_cache import Layers, PrefixCache

BUSY_CHUNK = 256  # tokens per turn while requests are active (each chunk re-copies the KV so far: not tiny)
WHOLE = 1 << 30  # idle: the rest of the prompt in one pass


@dataclass
class RewarmResult:
    entries: list[tuple[tuple[int, ...], Layers]]  # hottest first
    prefilled: int  # tokens run through the new model
    seconds: float
    complete: bool  # False: stopped at the deadline or by the budget before every hot prompt


class RewarmJob:
    def __init__(self, policy: Any, budget_tokens: int, deadline: float, cache_tokens: int, min_tokens: int):
        self.policy, self.budget, self.deadline = policy, budget_tokens, deadline
        self.staging = PrefixCache(cache_tokens, min_tokens)
        self.queue: deque[tuple[int, ...]] = deque()
        self.started = False
        self.future: Future = Future()
        self.prefilled = 0
        self.skipped = 0  # hot prompts left out: over the budget
        self._tokens: tuple[int, ...] | None = None  # the prompt being prefilled
        self._done = 0  # how many of its tokens the cache below holds
        self._cache: Any = None
        self._order: list[tuple[int, ...]] = []  # prompts staged, hottest first
        self._t0 = time.perf_counter()
        self.cancelled = False
        self.spent = 0.0  # seconds this job has run
        self.owed = 0.0  # seconds of request work the decode thread did while this job waited its turn

    def begin(self, prompts: list[tuple[int, ...]]) -> None:
        """The prompts to re-warm, hottest first (read by the decode thread, which owns the cache)."""
        self.queue.extend(p for p in prompts if len(p) >= self.staging.min_tokens)
        self.started = True

    def step(self, chunk: int) -> bool:
        """Prefill up to `chunk` tokens; True when the job has finished (its future is set)."""
        if self.cancelled or time.monotonic() >= self.deadline:
            return self._finish(complete=False)
        while self._tokens is None:
            if not self.queue:
                return self._finish(complete=self.skipped == 0)
            self._start(self.queue.popleft())
        end = min(self._done + chunk, len(self._tokens))
        ids = torch.tensor([self._tokens[self._done:end]])
        t0 = time.perf_counter()
        # logits_to_keep=1: nothing samples from these logits; skip the lm_head over the chunk
        self.policy.model(ids, cache=self._cache, use_cache=True, logits_to_keep=1,
                          position_ids=torch.arange(self._done, end)[None])
        self.spent += time.perf_counter() - t0
        self.prefilled += end - self._done
        self._done = end
        if end == len(self._tokens):
            self._stage(self._tokens)
        return False

    def fail(self, exc: BaseException) -> None:
        self._cache = None  # free the KV (an out-of-memory failure needs it back)
        if not self.future.done():
            self.future.set_exception(exc)

    def _start(self, tokens: tuple[int, ...]) -> None:
        from transformers import DynamicCache

        reused, layers = self.staging.lookup(self.policy.version, list(tokens))
        if reused == len(tokens) - 1 and any(t[: len(tokens)] == tokens for t, _ in self.staging.entries(
                self.policy.version)):
            self._order.append(tokens)  # a prefix of a prompt already re-warmed: nothing to do
            return
        left = self.budget - self.prefilled
        if len(tokens) - reused > left:  # over the budget: re-warm the prefix it allows (the system
            self.skipped += 1  # prompt, most of the time), if that is worth keeping
            tokens = tokens[: reused + left]
            if left <= 0 or len(tokens) < self.staging.min_tokens:
                return
        self._cache = DynamicCache()
        for i, (k, v) in enumerate(layers or []):
            self._cache.update(k, v, i)  # copies (torch.cat): the staged KV stays intact
        self._tokens, self._done = tokens, reused

    def _stage(self, tokens: tuple[int, ...]) -> None:
        self.staging.store(self.policy.version, list(tokens), [(ly.keys, ly.values) for ly in self._cache.layers])
        self._order.append(tokens)
        self._tokens, self._cache = None, None

    def _finish(self, complete: bool) -> bool:
        if self._tokens is not None and self._done >= self.staging.min_tokens:  # keep the part reached
            self._stage(self._tokens[: self._done])
        staged = dict(self.staging.entries(self.policy.version))
        entries, seen = [], set()
        for tokens in self._order:  # hottest first; a prompt covered by a longer staged one maps to it
            key = next((t for t in staged if t[: len(tokens)] == tokens), None)
            if key is not None and key not in seen:
                seen.add(key)
                entries.append((key, staged[key]))
        if not self.future.done():
            self.future.set_result(RewarmResult(entries, self.prefilled, time.perf_counter() - self._t0, complete))
        return True
