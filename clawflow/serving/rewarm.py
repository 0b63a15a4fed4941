"""Re-warm on reload: prefill the hottest cached prompts with the NEW weights before the swap.

A reload must drop the old version's prefix KV (its keys and values are stale), and in this product
a reload follows every training run, so without this the user's next turn after each new version
would prefill its whole agent prompt again (~16 s for OpenClaw's 7.7k tokens on 2 CPU cores).

A `RewarmJob` runs on the batcher's decode thread, one step of prefill per loop iteration, between
the old version's decode steps and prefills: the old version keeps serving meanwhile (with its own
warm prefix cache: a turn that shares the prompt being re-warmed reuses the old version's KV, so
nothing the job does is done twice), and the prefix cache stays a one-thread structure.

No turn waits behind a reload (issue 28). The job advances in steps of about `SLICE_S` seconds, also
when it started alone, and a request that arrives meanwhile is admitted after the step in progress.
A Llama-family model (serving/fused_step.py) prefills a prompt in chunks (re-fitted after each one
so that one decoder layer of a chunk takes at most half a slice, 128 to 2,048 tokens: big chunks
keep the weights' re-reads and the chunked attention's fixed cost small), and a step runs
whole decoder layers of the chunk in progress until its time is spent, so it can stop between two
layers; other models run one chunk a step, sized from the last chunk's time per token. From a
request's arrival on, the job runs a step only within what is left of every live request's
(waiting, prefilling or decoding) allowance, `YIELD_S` of re-warm time in all, counting the step it
arrived during: a turn is served at its normal latency plus at most about `YIELD_S`. Under steady
traffic the job moves on by what each request lends it, at full speed in the gaps between turns,
and at its deadline it ends with what it has (the swap then goes ahead part-warm: a reload is
delayed by at most `rewarm_max_s`, a turn never). In 256-512-token chunks the re-warm alone took as
long as one pass (SmolLM2, OpenClaw-sized 7.4k-token prompt, 2 cores: 19.8 s vs 19.3 s).

The job's results go to its own staging `PrefixCache`, keyed by the new version, which also lets a
later prompt reuse the re-warmed KV of an earlier one (agents share their system prompt: it is
prefilled once). The engine installs the staged entries when it swaps; if the job fails (out
of memory, any exception), the swap goes ahead cold. At the deadline the job stops and keeps what it
has, even while requests hold it off: a prompt prefilled part-way is kept as the prefix it reached.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from clawflow.serving import fused_step
from clawflow.serving.adapter_rows import loaded, prefix_key, route
from clawflow.serving.prefix_cache import Layers, PrefixCache

SLICE_S = 0.25  # seconds a re-warm step aims at: what a request arriving mid-step waits at most
# re-warm seconds a live request may wait behind, all steps together: 0.5 put a turn sent 1 s into a
# reload at 2.54 s against 2.19 s for the next turn (docs/performance.md run 5), over issue #28's 2.5 s
YIELD_S = 0.25
FIRST_CHUNK = 256  # tokens of a job's first chunk, before any was timed
MAX_CHUNK = 2048
# A step that stops between decoder layers keeps its chunks >= 128 tokens: a chunk's attention has a
# fixed cost over the whole cached past (SmolLM2 at a 6k past, 2 loaded cores: ~50 ms a layer for 16
# or 64 tokens, ~150 ms for 256), so smaller ones spend most of their time on it (a re-warm shrunk to
# 32-token chunks under a load spike took 240 s where 256-512 took 20 s, as long as one pass).
MIN_LAYERED_CHUNK = 128
MIN_CHUNK = 32  # a model prefilled a chunk per step (not layer by layer): its chunk is the step


@dataclass
class RewarmResult:
    entries: list[tuple[Any, tuple[int, ...], Layers]]  # (adapter key or None, prompt, KV), hottest first
    prefilled: int  # tokens run through the new model
    seconds: float
    complete: bool  # False: stopped at the deadline or by the budget before every hot prompt
    chunks: int = 0  # prompt chunks it prefilled
    yielded: int = 0  # loop iterations it gave way to requests


class RewarmJob:
    def __init__(self, policy: Any, budget_tokens: int, deadline: float, cache_tokens: int, min_tokens: int,
                 slice_s: float = SLICE_S):
        self.policy, self.budget, self.deadline = policy, budget_tokens, deadline
        self.staging = PrefixCache(cache_tokens, min_tokens)
        self.queue: deque[tuple[Any, tuple[int, ...]]] = deque()  # (adapter, prompt)
        self.started = False
        self.future: Future = Future()
        self.prefilled = 0
        self.skipped = 0  # hot prompts left out: over the budget
        self._tokens: tuple[int, ...] | None = None  # the prompt being prefilled
        self._adapter: Any = None  # the user's adapter it is prefilled with (None: the shared policy)
        self._done = 0  # how many of its tokens the cache below holds in every layer
        self._cache: Any = None
        self._order: list[tuple[Any, tuple[int, ...]]] = []  # (adapter, prompt) staged, hottest first
        self._t0 = time.perf_counter()
        self.cancelled = False
        self.slice_s = slice_s
        self.layered = fused_step.supports(policy.model)  # a step can stop between decoder layers
        self.chunk = FIRST_CHUNK  # tokens of the next chunk (re-fitted after each)
        self._run: Iterator[int] | None = None  # the chunk in progress, layer by layer (layered)
        self._end = 0  # where that chunk ends
        self._layers_s: list[float] = []  # its layers' seconds so far
        self.layer_s: float | None = None  # seconds of the last decoder layer (layered)
        self.per_token: float | None = None  # seconds per token of the last chunk (not layered)
        self.chunks = 0
        self.yielded = 0  # counted by the batcher
        self.prompts: Callable[[], list] | None = None  # the (adapter, prompt) pairs; None: the old version's hottest
        self.install: Callable[[list], None] | None = None  # stores the result itself, before the future is set

    def begin(self, prompts: list[tuple[Any, tuple[int, ...]]]) -> None:
        """The (adapter, prompt) pairs to re-warm, hottest first (read by the decode thread, which owns
        the cache); a prompt of a user's adapter the new model does not carry (replaced meanwhile)
        is left out."""
        self.queue.extend((a, p) for a, p in prompts if len(p) >= self.staging.min_tokens and loaded(self.policy, a))
        self.started = True

    def expired(self) -> bool:
        return self.cancelled or time.monotonic() >= self.deadline

    def floor_s(self) -> float:
        """Seconds of the shortest step the job can take (one decoder layer, or a MIN_CHUNK chunk);
        0 before it has timed one."""
        if self.layered:
            return self.layer_s or 0.0
        return self.per_token * MIN_CHUNK if self.per_token is not None else 0.0

    def step(self, budget_s: float) -> bool:
        """Prefill for about `budget_s` seconds (at least one decoder layer, or one chunk); True when
        the job has finished (its future is set)."""
        if self.expired():
            return self._finish(complete=False)
        t0 = time.perf_counter()
        while True:
            if self._run is None:
                while self._tokens is None:
                    if not self.queue:
                        return self._finish(complete=self.skipped == 0)
                    self._start(self.queue.popleft())
                if not self.layered:
                    self._whole_chunk(budget_s)
                    return False
                self._end = min(self._done + self.chunk, len(self._tokens))
                chunk = fused_step.Chunk(list(self._tokens[self._done:self._end]), self._done, self._cache)
                self._run, self._layers_s = fused_step.prefill_layers(self.policy.model, chunk), []
            t1 = time.perf_counter()
            with route(self.policy, [self._adapter], [self._end - self._done]):  # per layer: the decode
                left = next(self._run)  # loop routes its own forwards in between
            self.layer_s = time.perf_counter() - t1
            self._layers_s.append(self.layer_s)
            if left == 0:
                self._run = None
                self._chunk_done(self._end)
                # a layer of a chunk within half a slice: big chunks (few weight reads, little fixed
                # attention cost) that a step can still stop in between
                mean = sum(self._layers_s) / len(self._layers_s)
                if mean > self.slice_s / 2:
                    self.chunk = max(MIN_LAYERED_CHUNK, self.chunk // 2)
                elif mean < self.slice_s / 8:
                    self.chunk = min(MAX_CHUNK, self.chunk * 2)
            if time.perf_counter() - t0 + (self.layer_s or 0.0) > budget_s:
                return False

    def _whole_chunk(self, budget_s: float) -> None:
        """Other models: one chunk through transformers' forward, sized to take about `budget_s`."""
        n = 2 * MIN_CHUNK if self.per_token is None else int(budget_s / self.per_token)
        end = min(self._done + max(MIN_CHUNK, min(MAX_CHUNK, n)), len(self._tokens))
        t0 = time.perf_counter()
        # logits_to_keep=1: nothing samples from these logits; skip the lm_head over the chunk
        with route(self.policy, [self._adapter], [end - self._done]):
            self.policy.model(torch.tensor([self._tokens[self._done:end]]), cache=self._cache, use_cache=True,
                              logits_to_keep=1, position_ids=torch.arange(self._done, end)[None])
        if end - self._done >= MIN_CHUNK or self.per_token is None:  # a short tail times overheads
            self.per_token = (time.perf_counter() - t0) / (end - self._done)
        self._chunk_done(end)

    def _chunk_done(self, end: int) -> None:
        self.chunks += 1
        self.prefilled += end - self._done
        self._done = end
        if end == len(self._tokens):
            self._stage(self._tokens)

    def fail(self, exc: BaseException) -> None:
        self._run = self._cache = None  # free the KV (an out-of-memory failure needs it back)
        if not self.future.done():
            self.future.set_exception(exc)

    def _start(self, item: tuple[Any, tuple[int, ...]]) -> None:
        from clawflow.serving.kv_cache import new_cache  # appends in place: a chunk does not re-copy the KV

        adapter, tokens = item
        key = prefix_key(self.policy, adapter)
        reused, layers = self.staging.lookup(key, list(tokens))
        if reused == len(tokens) - 1 and any(t[: len(tokens)] == tokens for t, _ in self.staging.entries(key)):
            self._order.append(item)  # a prefix of a prompt already re-warmed: nothing to do
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
        self._tokens, self._done, self._adapter = tokens, reused, adapter

    def _stage(self, tokens: tuple[int, ...]) -> None:
        # views of the job's buffers; nothing writes to them again (the job drops its cache here)
        self.staging.store(prefix_key(self.policy, self._adapter), list(tokens),
                           [(ly.keys, ly.values) for ly in self._cache.layers])
        self._order.append((self._adapter, tokens))
        self._tokens, self._cache = None, None

    def _finish(self, complete: bool) -> bool:
        self._run = None  # a chunk part-way through its layers: only `_done` positions are whole in all
        if self._tokens is not None and self._done >= self.staging.min_tokens:  # keep the part reached
            self._stage(self._tokens[: self._done])
        entries, seen, staged = [], set(), {}
        for adapter, tokens in self._order:  # hottest first; a prompt covered by a longer staged one maps to it
            if adapter not in staged:
                staged[adapter] = dict(self.staging.entries(prefix_key(self.policy, adapter)))
            key = next((t for t in staged[adapter] if t[: len(tokens)] == tokens), None)
            if key is not None and (adapter, key) not in seen:
                seen.add((adapter, key))
                entries.append((adapter, key, staged[adapter][key]))
        if self.install is not None and not self.cancelled:  # on the decode thread: the cache is its own
            self.install(entries)
        if not self.future.done():
            self.future.set_result(RewarmResult(entries, self.prefilled, time.perf_counter() - self._t0, complete,
                                                self.chunks, self.yielded))
        return True
