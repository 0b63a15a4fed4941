"""Re-warm on reload: prefill the hottest cached prompts with the NEW weights before the swap.

A reload must drop the old version's prefix KV (its keys and values are stale), and in this product
a reload follows every training run, so without this the user's next turn after each new version
would prefill its whole agent prompt again (~16 s for OpenClaw's 7.7k tokens on 2 CPU cores).

A `RewarmJob` runs on the batcher's decode thread, one chunk of prefill per loop iteration, between
the old version's decode steps and prefills: the old version keeps serving meanwhile (with its own
warm prefix cache: a turn that shares the prompt being re-warmed reuses the old version's KV, so
nothing the job does is done twice), and the prefix cache stays a one-thread structure.

No turn waits behind a reload (issue 28): the job never runs a chunk longer than about `CHUNK_S`
(the chunk's size in tokens is re-fitted after every chunk from the time per token the last one
took, so it holds on any machine, model and position in the prompt), also when it started alone,
and a request that arrives meanwhile is admitted after the chunk in progress. From then on the job
runs a chunk only while every live request (waiting, prefilling or decoding) has waited behind the
re-warm less than its allowance, `YIELD_S` in all, counting the chunk it arrived during: a turn is
served at its normal latency plus at most about `YIELD_S`, and the job still moves on under steady
traffic (each request lends it up to `YIELD_S`), and at full speed in the gaps between turns.
Chunking costs the re-warm itself some speed (a chunk's attention over the cached part runs SDPA
with an explicit mask, and each chunk re-reads the weights): the swap comes a little later, no
request waits for it.

The job's results go to its own staging `PrefixCache`, keyed by the new version, which also lets a
later prompt reuse the re-warmed KV of an earlier one (agents share their system prompt: it is
prefilled once). The engine installs the staged entries when it swaps; if the job fails (out
of memory, any exception), the swap goes ahead cold. At the deadline the job stops and keeps what it
has, even while requests hold it off: a prompt prefilled part-way is kept as the prefix it reached.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from clawflow.serving import fused_step
from clawflow.serving.prefix_cache import Layers, PrefixCache

CHUNK_S = 0.25  # seconds one re-warm chunk aims at: what a request arriving mid-chunk waits at most
YIELD_S = 0.5  # re-warm seconds a live request may wait behind, all chunks together
FIRST_CHUNK = 32  # tokens of a job's first chunk, before any chunk was timed
MIN_CHUNK, MAX_CHUNK = 16, 4096


@dataclass
class RewarmResult:
    entries: list[tuple[tuple[int, ...], Layers]]  # hottest first
    prefilled: int  # tokens run through the new model
    seconds: float
    complete: bool  # False: stopped at the deadline or by the budget before every hot prompt
    chunks: int = 0  # forwards it took
    yielded: int = 0  # loop iterations it gave way to requests


class RewarmJob:
    def __init__(self, policy: Any, budget_tokens: int, deadline: float, cache_tokens: int, min_tokens: int,
                 chunk_s: float = CHUNK_S):
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
        self.chunk_s = chunk_s
        self.chunk = FIRST_CHUNK  # tokens of the next chunk: re-fitted to `chunk_s` after each one
        self.per_token: float | None = None  # seconds per token of the last chunk
        self.chunks = 0
        self.yielded = 0  # counted by the batcher

    def begin(self, prompts: list[tuple[int, ...]]) -> None:
        """The prompts to re-warm, hottest first (read by the decode thread, which owns the cache)."""
        self.queue.extend(p for p in prompts if len(p) >= self.staging.min_tokens)
        self.started = True

    def expired(self) -> bool:
        return self.cancelled or time.monotonic() >= self.deadline

    def estimate_s(self) -> float:
        """Seconds the next chunk should take."""
        return self.chunk_s if self.per_token is None else self.per_token * self.chunk

    def step(self, chunk: int) -> bool:
        """Prefill up to `chunk` tokens; True when the job has finished (its future is set)."""
        if self.expired():
            return self._finish(complete=False)
        while self._tokens is None:
            if not self.queue:
                return self._finish(complete=self.skipped == 0)
            self._start(self.queue.popleft())
        end = min(self._done + max(chunk, 1), len(self._tokens))
        t0 = time.perf_counter()
        self._forward(list(self._tokens[self._done:end]))
        dt = time.perf_counter() - t0
        self.chunks += 1
        n = end - self._done
        if n >= MIN_CHUNK or self.per_token is None:  # a prompt's short tail times overheads, not tokens
            self.per_token = dt / n
            self.chunk = max(MIN_CHUNK, min(MAX_CHUNK, int(self.chunk_s / self.per_token)))
        self.prefilled += n
        self._done = end
        if end == len(self._tokens):
            self._stage(self._tokens)
        return False

    def _forward(self, ids: list[int]) -> None:
        """`ids` at positions `_done`.. into the job's cache; the logits are not needed."""
        model, start = self.policy.model, self._done
        if fused_step.supports(model):  # the forward the batcher's chunked prefill runs
            none = torch.zeros(0, dtype=torch.long)
            fused_step.forward(model, none, none, None, None, [fused_step.Chunk(ids, start, self._cache)])
        else:  # logits_to_keep=1: skip the lm_head over the chunk
            model(torch.tensor([ids]), cache=self._cache, use_cache=True, logits_to_keep=1,
                  position_ids=torch.arange(start, start + len(ids))[None])

    def fail(self, exc: BaseException) -> None:
        self._cache = None  # free the KV (an out-of-memory failure needs it back)
        if not self.future.done():
            self.future.set_exception(exc)

    def _start(self, tokens: tuple[int, ...]) -> None:
        from clawflow.serving.kv_cache import new_cache  # appends in place: a chunk does not re-copy the KV

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
        self._cache = new_cache()
        for i, (k, v) in enumerate(layers or []):
            self._cache.update(k, v, i)  # copied into the job's buffer: the staged KV stays intact
        self._tokens, self._done = tokens, reused

    def _stage(self, tokens: tuple[int, ...]) -> None:
        # views of the job's buffers; nothing writes to them again (the job drops its cache here)
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
            self.future.set_result(RewarmResult(entries, self.prefilled, time.perf_counter() - self._t0, complete,
                                                self.chunks, self.yielded))
        return True
