"""Continuous batching for the embedded torch engine: one decode thread, requests join and leave
between decode steps.

Why our own and not transformers' `ContinuousBatchingManager` (transformers 5.x): its logprobs are
taken after the temperature/top-p processors (not the raw policy distribution the trainer's
importance ratio needs) and it samples every request with one global RNG (no per-request seed).
So this is a compact left-padded decoder over a `DynamicCache` whose layers append in place
(clawflow/serving/kv_cache.py):

- a request is admitted between steps and prefilled; while other requests are decoding or
  prefilling, in chunks of `prefill_chunk` tokens, one chunk per loop iteration (chunked prefill:
  an agent's 8k-token prompt no longer stalls the other streams for its whole prefill, and a short
  prompt admitted behind it is prefilled in the next iteration), else whole (faster alone). For a
  Llama-family model (clawflow/serving/fused_step.py) an iteration is one forward per policy: its
  batch's decode step and a chunk of each of its prompts ride together, so the weights are read
  once (other models: transformers' forward, each prompt alone, then the batch). Once a prompt is
  whole its first token is sampled and its KV cache left-padded (or the batch's is) to a common
  length and concatenated into the batch;
- every step decodes one token for every row (attention mask hides each row's padding, position
  ids count each row's real tokens), samples each row with its own `torch.Generator`, and records
  the log-softmax of the raw logits at the sampled token;
- finished or aborted rows are sliced out of the cache, and leading columns that are padding in
  every row are trimmed;
- one batch per policy version: a request pins the policy that was serving when it was admitted and
  finishes on it; a reload only changes where new requests go, and an old version's batch (and
  model) is dropped when its last request ends;
- a bounded waiting queue: `submit` raises `QueueFull` instead of queueing without limit;
- a prefix KV cache (clawflow/serving/prefix_cache.py): a prompt that starts with tokens an earlier
  prompt prefilled on the same policy prefills only its new tail; a request with no hit runs exactly
  as without the cache. Entries of a policy that no longer serves are dropped;
- a user's own LoRA adapter (clawflow/serving/multi_lora.py): a row may name an adapter loaded on
  its policy's model; the rows of every adapter (and of none) share one batch and one forward, each
  Linear adding each adapter's delta to its own rows only. Its prompts' KV is cached under the
  adapter, so no KV crosses between adapters;
- re-warm on reload (clawflow/serving/rewarm.py): before a swap, the engine has this thread prefill
  the hottest cached prompts with the new weights, a step of ~`SLICE_S` seconds per loop iteration
  between the old version's work, and no more than what is left of any live request's `YIELD_S`
  allowance; the staged KV enters the cache when the new policy's first request arrives.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from clawflow.serving import fused_step
from clawflow.serving.generation import Generation, QueueFull, SamplingParams, TokenCallback
from clawflow.serving.prefix_cache import PrefixCache
from clawflow.serving.adapter_rows import prefix_key, route
from clawflow.serving.rewarm import SLICE_S, YIELD_S, RewarmJob, RewarmResult
from clawflow.serving.sampling import sample

log = logging.getLogger("clawflow.batcher")


class _Owner(Protocol):
    """What the batcher reads of the TorchEngine that owns it (typed here, so neither module imports
    the other both ways)."""

    _policy: Any  # the serving policy (model, version, path): new requests pin it
    eos_ids: set[int]

    def _pin(self, user: str | None) -> tuple[Any, Any]: ...  # (policy, key of the user's adapter or None)

    def _retire(self, in_use: Callable[[], set]) -> None: ...  # drop replaced adapters no request uses

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class _Row:
    prompt_ids: list[int]
    params: SamplingParams
    on_token: TokenCallback | None
    future: Future
    gen: torch.Generator | None
    policy: Any = None
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish: str = "length"
    cache: Any = None  # the prompt's KV while it is prefilled chunk by chunk
    filled: int = 0  # prompt tokens in `cache`
    submitted: float = field(default_factory=time.monotonic)
    rewarm_wait: float = 0.0  # seconds this request waited behind re-warm steps
    user: str | None = None  # whose request: decoded with that user's adapter when one is loaded
    adapter: Any = None  # the key of that adapter on the policy's model (serving/multi_lora.py), pinned at admission


@dataclass
class _Batch:
    policy: Any
    rows: list[_Row] = field(default_factory=list)
    cache: Any = None  # DynamicCache, [B, heads, T, dim] per layer
    mask: torch.Tensor | None = None  # [B, T] 1 = real token, 0 = left padding
    pos: torch.Tensor | None = None  # [B] position id of each row's next input token
    last: torch.Tensor | None = None  # [B] each row's last sampled token (the next input)


class Batcher:
    def __init__(self, engine: _Owner, max_batch: int, max_queue: int, prefix_cache_tokens: int = 0,
                 prefix_cache_min_tokens: int = 16, prefill_chunk: int = 0, rewarm_slice_s: float = SLICE_S,
                 rewarm_yield_s: float = YIELD_S):
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        # re-warm steps: seconds each, and the most a request waits behind them (serving/rewarm.py)
        self.rewarm_slice_s, self.rewarm_yield_s = rewarm_slice_s, rewarm_yield_s
        self.prefill_chunk = prefill_chunk  # prompt tokens per prefill forward; 0 = the whole prompt at once
        self.prefix = PrefixCache(prefix_cache_tokens, prefix_cache_min_tokens) if prefix_cache_tokens > 0 else None
        # the policy whose KV the prefix cache holds (only the serving policy prefills); a weak
        # reference, so a replaced model is not kept alive by it
        self._prefix_owner: tuple[weakref.ref, int] | None = None
        self._rewarm: RewarmJob | None = None  # at most one; runs on the decode thread
        self._staged: tuple[weakref.ref, list] | None = None  # a re-warmed policy's KV, installed on its first use
        self._waiting: deque[_Row] = deque()
        self._prefilling: list[_Row] = []  # admitted, prompt not fully in their cache yet
        self._batches: dict[int, _Batch] = {}  # by id(policy): a reload to the same version number is another model
        self._running = 0  # admitted and not finished (prefilling or in a batch)
        self.aborted = 0  # requests stopped early because their client went away
        self.fused_chunks = 0  # prompt chunks prefilled by a fused forward (serving/fused_step.py)
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="clawflow-decode", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return self._running

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
               user: str | None = None) -> Future:
        fut: Future = Future()
        gen = torch.Generator().manual_seed(params.seed % (1 << 63)) if params.seed is not None else None  # any int
        with self._cv:
            if self.active + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFull(f"server busy: {len(self._waiting)} requests waiting")
            self._waiting.append(_Row(list(prompt_ids), params, on_token, fut, gen, user=user))
            self._cv.notify()
        return fut

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)
        if (job := self._rewarm) is not None:
            job.fail(RuntimeError("engine closed"))

    # -- re-warm on reload -------------------------------------------------------------------
    def rewarm(self, policy, budget_tokens: int, max_s: float, min_prompt_tokens: int = 0,
               switch: tuple[Any, Any] | None = None) -> Future:
        """Prefill the hottest cached prompts of at least `min_prompt_tokens` on `policy` (not serving
        yet), at most `budget_tokens` tokens and `max_s` seconds; a Future of a `RewarmResult` (or of
        the error that stopped it). `switch` = (old, new) adapter keys on the serving `policy`: a
        user's new adapter version instead, the prompts cached under `old` prefilled with `new`, and
        stored in the cache (on this thread) before the future is set."""
        if self.prefix is None or budget_tokens <= 0:
            fut: Future = Future()
            fut.set_result(RewarmResult([], 0, 0.0, True))
            return fut
        job = RewarmJob(policy, budget_tokens, time.monotonic() + max_s, self.prefix.max_tokens,
                        max(self.prefix.min_tokens, min_prompt_tokens), self.rewarm_slice_s)
        if switch is not None:
            old, new = switch
            job.prompts = lambda: [(new, t) for a, t in self.prefix.hottest_adapters(policy.version) if a == old]
            job.install = lambda entries: [self.prefix.store(prefix_key(policy, a), list(t), layers)
                                           for a, t, layers in reversed(entries)]  # hottest last
        with self._cv:
            if self._rewarm is not None:  # an earlier one its reload gave up on
                self._rewarm.cancelled = True
            self._rewarm = job  # the loop picks it up (the earlier one then ends without a waiter)
            self._cv.notify()
        return job.future

    def cancel_rewarm(self) -> None:
        if (job := self._rewarm) is not None:
            job.cancelled = True

    def adopt(self, policy, entries: list) -> None:
        """`policy`'s re-warmed KV (hottest first): it replaces the old version's entries when
        `policy` prefills its first request. Call before `policy` starts serving."""
        self._staged = (weakref.ref(policy), entries) if entries else None

    def _rewarm_step(self) -> None:
        """A step of the re-warm: `rewarm_slice_s` seconds, or what is left of the live requests'
        allowance (`rewarm_yield_s` of waiting behind re-warm steps each), or none when that is less
        than its shortest step; past its deadline the job ends here whatever is live."""
        job = self._rewarm
        try:
            if not job.started:  # which prompts are hot is read here: the cache is this thread's
                owner = self._prefix_owner
                job.begin(job.prompts() if job.prompts is not None else
                          self.prefix.hottest_adapters(owner[1]) if owner is not None else [])
            budget = self.rewarm_slice_s
            if not job.expired():
                with self._cv:
                    live = self._live()
                if live:
                    budget = min(budget, self.rewarm_yield_s - max(row.rewarm_wait for row in live))
                    if budget <= 0 or budget < job.floor_s():
                        job.yielded += 1
                        return
            t0 = time.monotonic()
            done = job.step(budget)
            t1 = time.monotonic()
            with self._cv:  # every request that waited for this step: those queued during it too
                for row in self._live():
                    row.rewarm_wait += max(0.0, t1 - max(t0, row.submitted))
        except Exception as exc:  # out of memory, anything: the reload goes ahead cold
            log.warning("re-warm of v%s failed: %s: %s", job.policy.version, exc.__class__.__name__, exc)
            job.fail(exc)
            done = True
        if done:
            with self._cv:
                if self._rewarm is job:
                    self._rewarm = None

    def _adapters_in_use(self) -> set:
        """The adapter keys admitted or waiting requests decode with."""
        with self._cv:
            return {row.adapter for row in self._live() if row.adapter is not None}

    def _live(self) -> list[_Row]:
        """Requests waiting, prefilling or decoding (call holding `_cv`: `_waiting` is shared)."""
        return [*self._waiting, *self._prefilling, *(row for b in self._batches.values() for row in b.rows)]

    # -- the decode loop ---------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stop or self._waiting or self._batches or self._prefilling
                               or self._rewarm is not None):
                        self._cv.wait()
                    if self._stop:
                        return
                    admit = []
                    while self._waiting and self.active + len(admit) < self.max_batch:
                        row = self._waiting.popleft()
                        if row.future.set_running_or_notify_cancel():  # False: the client left while queued
                            admit.append(row)
                        else:
                            self.aborted += 1
                    self._running += len(admit)
                for row in admit:
                    self._guard([row], lambda r=row: self._start(r))
                for policy, batch, riders in self._work():
                    if fused_step.supports(policy.model):  # one forward: the batch's token and every chunk
                        self._guard((batch.rows if batch else []) + riders,
                                    lambda p=policy, b=batch, r=riders: self._fused_or_apart(p, b, r))
                    else:
                        self._apart(batch, riders)
                for key, batch in list(self._batches.items()):
                    if not batch.rows:
                        del self._batches[key]  # an old version's model is freed with its last request
                        version = batch.policy.version
                        if self.prefix is not None and version != self.engine._policy.version:
                            self.prefix.drop_version(version)  # and so is its KV
                if self._rewarm is not None:  # a chunk at most per iteration: the old version keeps serving
                    self._rewarm_step()
                self.engine._retire(self._adapters_in_use)

    def _guard(self, rows: list[_Row], fn) -> None:
        try:
            fn()
        except Exception as exc:  # a failed forward fails its requests, never the loop
            log.exception("decode step failed")
            for row in rows:
                if row in self._prefilling:
                    self._prefilling.remove(row)
                if not row.future.done():
                    self._finish(row, exc)
            for key, batch in list(self._batches.items()):
                if any(r in rows for r in batch.rows):
                    del self._batches[key]

    def _start(self, row: _Row) -> None:
        """Pin the serving policy and seed the row's cache with the longest cached prefix."""
        from clawflow.serving.kv_cache import new_cache  # imports transformers: not at module load

        policy, row.adapter = self.engine._pin(row.user)  # pinned: it finishes on this version and adapter
        row.policy = policy
        row.cache = new_cache()
        row.filled, layers = self._prefix_lookup(policy, row.prompt_ids, row.adapter)
        for i, (k, v) in enumerate(layers or []):  # the cache holds prompt_ids[:filled]
            row.cache.update(k, v, i)  # copied into the row's own buffer: the stored KV stays intact
        self._prefilling.append(row)

    def _work(self) -> list[tuple[Any, _Batch | None, list[_Row]]]:
        """This iteration's work per policy: its batch (if any) and its rows still prefilling."""
        groups: dict[int, tuple[Any, _Batch | None, list[_Row]]] = {}
        for batch in self._batches.values():
            groups[id(batch.policy)] = (batch.policy, batch, [])
        for row in self._prefilling:
            groups.setdefault(id(row.policy), (row.policy, None, []))[2].append(row)
        return list(groups.values())

    def _chunk_end(self, row: _Row) -> int:
        # Chunks only while others wait on this thread: a chunk's attention over the cached part takes
        # the masked SDPA path, so a lone prompt is prefilled ~1.3x faster whole (bench/prefill.py).
        n = len(row.prompt_ids)
        busy = bool(self._batches) or len(self._prefilling) > 1
        return min(n, row.filled + self.prefill_chunk) if self.prefill_chunk > 0 and busy else n

    def _prefill(self, row: _Row) -> None:
        """The next chunk of the row's prompt, at its real positions; the first token once it is whole."""
        end = self._chunk_end(row)
        # logits_to_keep=1: only the last position is sampled; the prompt's other logits (the lm_head
        # over every prompt token, ~20 % of a prefill) would be thrown away.
        with route(row.policy, [row.adapter], [end - row.filled]):
            out = row.policy.model(torch.tensor([row.prompt_ids[row.filled:end]]), cache=row.cache, use_cache=True,
                                   logits_to_keep=1, position_ids=torch.arange(row.filled, end)[None])
        row.filled = end
        if end == len(row.prompt_ids):
            self._prefilled(row, out.logits[0, -1])

    def _apart(self, batch: _Batch | None, riders: list[_Row]) -> None:
        """transformers' forward: a chunk of each prompt alone, then the batch's step; a failure fails
        only the requests of that forward."""
        for row in riders:
            self._guard([row], lambda r=row: self._prefill(r))
        if batch is not None:
            self._guard(batch.rows, lambda b=batch: self._step(b))

    def _fused_or_apart(self, policy, batch: _Batch | None, riders: list[_Row]) -> None:
        try:
            self._fused(policy, batch, riders)
        except _FusedFailed as exc:  # e.g. one prompt's bad token id: don't fail the others with it
            log.warning("fused step failed (%s); running its parts apart", exc.__cause__)
            self._apart(batch, riders)

    def _fused(self, policy, batch: _Batch | None, riders: list[_Row]) -> None:
        """The batch's decode step and a chunk of each rider's prompt in one forward
        (serving/fused_step.py: the weights are read once for all of them). A forward that raises
        leaves every cache as it was and raises `_FusedFailed`."""
        ends = [self._chunk_end(row) for row in riders]
        chunks = [fused_step.Chunk(row.prompt_ids[row.filled:end], row.filled, row.cache)
                  for row, end in zip(riders, ends)]
        caches = [c.cache for c in chunks] + ([batch.cache] if batch is not None else [])
        before = [(len(c.layers), [(layer.keys, layer.values) for layer in c.layers]) for c in caches]
        decoding = batch.rows if batch is not None else []
        counts = [1] * len(decoding) + [len(c.ids) for c in chunks]  # a decode row is one row, a chunk its tokens
        try:
            with route(policy, [r.adapter for r in decoding + riders], counts):
                if batch is None:
                    none = torch.zeros(0, dtype=torch.long)
                    _, chunk_logits = fused_step.forward(policy.model, none, none, None, None, chunks)
                else:
                    mask = torch.cat([batch.mask, torch.ones(len(batch.rows), 1, dtype=torch.long)], 1)
                    logits, chunk_logits = fused_step.forward(policy.model, batch.last, batch.pos, mask, batch.cache,
                                                              chunks)
        except Exception as exc:
            for cache, (n, views) in zip(caches, before):  # positions written past a view are never read
                del cache.layers[n:]
                for layer, (k, v) in zip(cache.layers, views):
                    layer.keys, layer.values = k, v
            raise _FusedFailed from exc
        self.fused_chunks += len(chunks)
        if batch is not None:
            self._advance(batch, mask, logits)
        for j, (row, end) in enumerate(zip(riders, ends)):  # after the batch's rows left: joiners pad to what stays
            row.filled = end
            if end == len(row.prompt_ids):
                self._prefilled(row, chunk_logits[j])

    def _prefilled(self, row: _Row, logits: torch.Tensor) -> None:
        """The row's prompt is whole in its cache: keep it in the prefix cache, sample the first token,
        and join its policy's batch."""
        from clawflow.serving.kv_cache import pad_left  # imports transformers: not at module load

        policy, cache, n = row.policy, row.cache, len(row.prompt_ids)
        self._prefilling.remove(row)
        row.cache = None  # the batch owns it from here
        if self.prefix is not None:  # the cache holds exactly the prompt's KV here (no sampled token yet)
            self.prefix.store(prefix_key(policy, row.adapter), row.prompt_ids,
                              [(layer.keys, layer.values) for layer in cache.layers])
        if self._emit(row, logits):
            return self._finish(row)
        batch = self._batches.setdefault(id(policy), _Batch(policy))
        mask, pos, last = torch.ones(1, n, dtype=torch.long), torch.tensor([n]), torch.tensor([row.out_ids[-1]])
        if batch.cache is None:
            batch.cache, batch.mask, batch.pos, batch.last = cache, mask, pos, last
        else:
            t = batch.mask.shape[1]
            pad_left(cache, max(t - n, 0))
            pad_left(batch.cache, max(n - t, 0))
            mask = torch.cat([torch.zeros(1, max(t - n, 0), dtype=torch.long), mask], 1)
            batch.mask = torch.cat([torch.zeros(batch.mask.shape[0], max(n - t, 0), dtype=torch.long), batch.mask], 1)
            for bl, rl in zip(batch.cache.layers, cache.layers):
                bl.keys, bl.values = torch.cat([bl.keys, rl.keys]), torch.cat([bl.values, rl.values])
            batch.mask = torch.cat([batch.mask, mask])
            batch.pos, batch.last = torch.cat([batch.pos, pos]), torch.cat([batch.last, last])
        batch.rows.append(row)

    def _prefix_lookup(self, policy, prompt_ids: list[int], adapter: Any = None):
        if self.prefix is None:
            return 0, None
        owner = self._prefix_owner
        if owner is None or owner[0]() is not policy:  # a reload (even to the same version number)
            if owner is not None:
                self.prefix.drop_version(owner[1])
            staged, self._staged = self._staged, None
            if staged is not None and staged[0]() is policy:  # KV this very model re-warmed
                for staged_adapter, tokens, layers in reversed(staged[1]):  # hottest last: most recently used
                    self.prefix.store(prefix_key(policy, staged_adapter), list(tokens), layers)
        self._prefix_owner = (weakref.ref(policy), policy.version)
        return self.prefix.lookup(prefix_key(policy, adapter), prompt_ids)

    def _step(self, batch: _Batch) -> None:
        mask = torch.cat([batch.mask, torch.ones(len(batch.rows), 1, dtype=torch.long)], 1)
        with route(batch.policy, [r.adapter for r in batch.rows]):
            out = batch.policy.model(batch.last[:, None], attention_mask=mask, position_ids=batch.pos[:, None],
                                     cache=batch.cache, use_cache=True)
        self._advance(batch, mask, out.logits[:, -1])

    def _advance(self, batch: _Batch, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """Sample each row's token from its step's `logits` [B, V]; rows that finished leave the batch."""
        done = [self._emit(row, logits[i]) for i, row in enumerate(batch.rows)]
        batch.mask, batch.pos = mask, batch.pos + 1
        batch.last = torch.tensor([row.out_ids[-1] for row in batch.rows])
        if any(done):
            keep = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long)
            finished = [r for r, d in zip(batch.rows, done) if d]
            batch.rows = [r for r, d in zip(batch.rows, done) if not d]
            for row in finished:  # after they left the batch: a caller sees its slot free
                self._finish(row)
            if not batch.rows:  # a row that joins later starts it afresh
                batch.cache = batch.mask = batch.pos = batch.last = None
                return
            batch.mask, batch.pos, batch.last = batch.mask[keep], batch.pos[keep], batch.last[keep]
            skip = int((batch.mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
            batch.mask = batch.mask[:, skip:]
            for layer in batch.cache.layers:
                layer.keys, layer.values = layer.keys[keep, :, skip:], layer.values[keep, :, skip:]

    def _emit(self, row: _Row, logits: torch.Tensor) -> bool:
        """Sample one token for `row`, record it, call back; True when the row has finished."""
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        p = row.params
        token = sample(logits, p.temperature, p.top_p, row.gen)
        row.out_ids.append(token)
        row.logprobs.append(float(logp[token]))
        if p.top_logprobs:
            vals, idx = logp.topk(p.top_logprobs)
            row.top.append(list(zip(idx.tolist(), vals.tolist())))
        eng = self.engine
        finished = False
        if token in eng.eos_ids:
            row.finish, row.text, finished = "stop", eng.decode(row.out_ids), True
        else:
            row.text = eng.decode(row.out_ids)
            if cuts := [row.text.index(s) for s in p.stop if s in row.text]:
                row.text, row.finish, finished = row.text[: min(cuts)], "stop", True  # earliest stop wins
            elif row.on_token is not None and not _call(row, token):
                row.finish, finished = "abort", True
                self.aborted += 1
            elif len(row.out_ids) >= p.max_new_tokens:
                finished = True
        return finished

    def _finish(self, row: _Row, exc: BaseException | None = None) -> None:
        with self._cv:
            self._running -= 1  # before the caller can see it: its slot is free
        if exc is not None:
            row.future.set_exception(exc)
        else:
            row.future.set_result(Generation(row.out_ids, row.logprobs, row.text, row.finish,
                                             row.policy.version, row.top,
                                             adapter_version=row.adapter[2] if row.adapter is not None else None))


class _FusedFailed(Exception):
    """A fused forward raised; every cache it touched is as it was before."""


def _call(row: _Row, token: int) -> bool:
    try:
        return bool(row.on_token(token, row.logprobs[-1], row.text, row.top[-1] if row.params.top_logprobs else None))
    except Exception:  # a broken callback (closed event loop) means nobody is listening
        return False
