"""Embedded torch engine: a transformers causal LM with KV-cached decoding.

Token-in/token-out: callers pass prompt token ids and get back the sampled ids and the policy's
log-probabilities of them (log-softmax of the raw logits, i.e. temperature 1: the π_old the trainer's
importance ratio needs, whatever temperature was used to sample). Hot reload loads the new weights
into a fresh model object and swaps one reference: a request that started on version N keeps its
model object and finishes on N, new requests get N+1, and a broken checkpoint never replaces the
serving one. A LoRA adapter directory (`adapter_config.json`) is served on top of its base
model's weights, loaded once and shared by every adapter version: a reload copies only the
adapter. Decoding is continuous batching on one thread (clawflow/serving/batcher.py): requests
join and leave between decode steps, one batch per policy version. Before a swap the new weights
prefill the hottest cached prompts (`rewarm_tokens`, clawflow/serving/rewarm.py) in short steps
that give way to requests (none waits more than `rewarm_yield_s` behind them) while the old ones
keep serving, so the swap brings a warm prefix cache; a re-warm that fails only makes the swap cold.

Users' own adapters (issue #29; `load_user_adapter`): a LoRA adapter per user, on the served base
model's weights (clawflow/serving/multi_lora.py), and a request `submit`ted for that user decodes
with it, in the same batch and forward as everyone else's. A user's new adapter version is loaded
under a new key: requests already decoding on the old one finish on it, and it is dropped once
none is left. A reload of the shared weights carries every user's adapter over to the new model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawflow.policy.loader import adapter_base, is_adapter
from clawflow.serving.batcher import Batcher
from clawflow.serving.engine_protocol import EngineStats
from clawflow.serving.generation import AdapterError, Generation, ReloadError, SamplingParams, TokenCallback
from clawflow.serving.rewarm import SLICE_S, YIELD_S

log = logging.getLogger("clawflow.engine")


@dataclass(frozen=True)
class _Policy:
    model: Any
    version: int
    path: str


class TorchEngine:  # an `engine_protocol.Engine`
    def __init__(self, model_path: str, version: int = 0, dtype: str = "float32", threads: int | None = None,
                 max_batch: int = 32, max_queue: int = 64, prefix_cache_tokens: int = 8192,
                 prefix_cache_min_tokens: int = 16, rewarm_tokens: int = 8192, rewarm_max_s: float = 60.0,
                 prefill_chunk_tokens: int = 512, linear_kernel: str = "auto", rewarm_slice_s: float = SLICE_S,
                 rewarm_yield_s: float = YIELD_S, rewarm_min_tokens: int = 0, max_loaded_adapters: int = 32):
        from transformers import AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.dtype = dtype  # the setting served in: float32, bfloat16 or bf16-weights
        # bf16-weights: loaded in fp32, then its Linear weights stored in bf16 (policy/bf16_weights.py)
        self._load_dtype = torch.float32 if dtype == "bf16-weights" else getattr(torch, dtype)
        # Linears on oneDNN-prepacked weights (fp32, or bf16-weights' bf16; policy/packed_linear.py):
        # onednn, aten, or auto (timed on the first model loaded); settled to onednn or aten by then
        self.linear_kernel = linear_kernel
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._bases: dict[str, Any] = {}  # LoRA: base directory -> its model, shared by adapter versions
        # what new requests pin, swapped as one reference: the policy and which key each user's adapter
        # has on its model (a request must never read one without the other)
        first = _Policy(self._load(model_path), version, str(model_path))
        self._serving: tuple[_Policy, dict[str, tuple]] = (first, {})
        self._reload_lock = threading.Lock()
        self.rewarm_tokens, self.rewarm_max_s = rewarm_tokens, rewarm_max_s
        self.rewarm_min_tokens = rewarm_min_tokens  # shorter prompts are prefilled on demand
        self.last_rewarm: dict | None = None  # what the last reload's re-warm did (the reload's answer)
        # users' own adapters: user -> (key, path); the key changes with every version loaded
        self._user_adapters: dict[str, tuple[tuple, str]] = {}
        self._adapter_loads = 0
        self._retiring: list[tuple[Any, tuple]] = []  # (model, key) replaced, dropped once no request uses it
        # at most this many users' adapters held; the least recently used is dropped, its path kept
        self.max_loaded_adapters = max_loaded_adapters
        self._last_used: dict[str, float] = {}
        # user -> (path, version) of the adapter to load again on their next request
        self._evicted: dict[str, tuple[str, int | None]] = {}
        self.eos_ids = self._eos_ids()
        self.batcher = Batcher(self, max_batch, max_queue, prefix_cache_tokens, prefix_cache_min_tokens,
                               prefill_chunk_tokens, rewarm_slice_s, rewarm_yield_s)

    # -- weights ---------------------------------------------------------------------------
    def _load(self, path: str):
        from clawflow.policy.bf16_weights import bf16_weights
        from clawflow.policy.loader import load_policy

        if is_adapter(path):
            return self._load_adapter(path)
        # strict: transformers fills missing weights with random ones: never serve that
        model = load_policy(path, self._load_dtype, strict=True).eval()
        return self._pack(bf16_weights(model) if self.dtype == "bf16-weights" else model)

    def _pack(self, model):
        """`model` on prepacked Linear weights (fp32, or bf16-weights' bf16) where that was measured
        (or set) to be faster."""
        from clawflow.policy import packed_linear

        if self._load_dtype != torch.float32 or self.linear_kernel == "aten":
            return model
        if not packed_linear.available():
            if self.linear_kernel == "onednn":
                log.warning("serving.linear_kernel onednn: this torch has no oneDNN prepacked linear; using aten")
            self.linear_kernel = "aten"
            return model
        if self.linear_kernel == "auto":  # settled on the first model: the machine does not change
            self.linear_kernel = "onednn" if packed_linear.pack_if_faster(model) else "aten"
        elif self.linear_kernel == "onednn" and packed_linear.pack_linears(model) == 0:
            log.warning("serving.linear_kernel onednn: oneDNN cannot pack this model's weights on this CPU; using aten")
            self.linear_kernel = "aten"
        return model

    def _load_adapter(self, path: str):
        """Base weights shared with a cached base model (never modified) + this adapter, unmerged.
        Served as the default adapter of a MultiLora (serving/multi_lora.py), so a user's own
        adapter, trained on the same base, replaces it on that user's rows; an adapter MultiLora
        cannot apply exactly (DoRA, modules outside the decoder) is attached with peft instead,
        and users' adapters are then refused."""
        from clawflow.policy.bf16_weights import fp32_adapters
        from clawflow.policy.loader import load_policy
        from clawflow.serving.multi_lora import MultiLora, plain_copy, read_adapter

        base_dir = str(adapter_base(path))
        if base_dir not in self._bases:
            served = getattr(self, "_policy", None)  # serving the base itself: share its weights
            same = served is not None and Path(served.path).resolve() == Path(base_dir).resolve()
            self._bases[base_dir] = served.model if same and not is_adapter(served.path) else self._load(base_dir)
        shell = plain_copy(self._bases[base_dir])  # new modules, the same weight tensors
        try:
            deltas = read_adapter(path)
            multi = MultiLora(shell)
            key = ("policy", str(path))
            multi.load(key, deltas)
        except AdapterError as exc:
            log.info("serving %s with peft (%s); users' own adapters cannot ride on it", path, exc)
            model = load_policy(path, merge=False, base_model=plain_copy(self._bases[base_dir])).eval()
            return fp32_adapters(model) if self.dtype == "bf16-weights" else model
        multi.default = key
        shell.clawflow_multi_lora = multi  # read by the batcher's forwards
        shell.clawflow_adapter_base = base_dir  # users' adapters must be trained on this base too
        return shell

    @property
    def _policy(self) -> _Policy:
        return self._serving[0]

    def _pin(self, user: str | None) -> tuple[_Policy, tuple | None]:
        """The policy a new request of `user` decodes on, and the key of that user's adapter on its model."""
        policy, keys = self._serving
        return policy, keys.get(user) if user is not None else None

    def _table(self) -> dict[str, tuple]:
        return {user: key for user, (key, _) in self._user_adapters.items()}

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
            policy = _Policy(model, version, str(path))
            if self._user_adapters:  # every user's adapter rides on to the new shared weights
                try:
                    served = self._policy.model.clawflow_multi_lora
                    for key, user_path in self._user_adapters.values():
                        self._multi(model, str(path), user_path).load(key, served.deltas(key))
                except (AdapterError, ValueError) as exc:
                    raise ReloadError(f"checkpoint {path} cannot carry the users' adapters: {exc}") from exc
            self.last_rewarm = self._rewarm(policy)
            self._serving = (policy, self._table())
        return time.perf_counter() - t0

    # -- users' own adapters ------------------------------------------------------------------
    def _multi(self, model, model_path: str, adapter_path: str | None = None):
        """The model's MultiLora, installed on first use; AdapterError when `adapter_path` was trained
        on other weights than the ones served (its delta would ride on the wrong model)."""
        from clawflow.serving.multi_lora import MultiLora

        if hasattr(model, "peft_config"):
            raise AdapterError("the shared policy is served with peft (see the log); users' adapters cannot ride on it")
        served_base = getattr(model, "clawflow_adapter_base", None) or model_path
        if adapter_path is not None and is_adapter(adapter_path) \
                and Path(adapter_base(adapter_path)).resolve() != Path(served_base).resolve():
            raise AdapterError(f"adapter {adapter_path} was trained on {adapter_base(adapter_path)}, "
                               f"the shared policy is served on {served_base}")
        multi = getattr(model, "clawflow_multi_lora", None)
        if multi is None:
            multi = MultiLora(model)
            model.clawflow_multi_lora = multi  # read by the batcher's forwards
        return multi

    def load_user_adapter(self, user: str, path: str, version: int | None = None) -> dict:
        """Serve `user`'s requests from now on with the LoRA adapter at `path`, on the served weights.
        An AdapterError (unreadable, DoRA, shapes the base lacks) changes nothing: the user's old
        adapter, and everyone else's, keep serving. A new version of the user's adapter first
        re-warms the prompts cached under the old one (their requests keep decoding on the old one
        meanwhile), as a reload of the shared weights does."""
        return self._load_user_adapter(user, path, version, rewarm=True)

    def _load_user_adapter(self, user: str, path: str, version: int | None, rewarm: bool) -> dict:
        from clawflow.serving.multi_lora import read_adapter

        t0 = time.perf_counter()
        with self._reload_lock:
            deltas = read_adapter(path)
            self._adapter_loads += 1
            key = (user, self._adapter_loads, version)  # its version: recorded with every turn it decodes
            model = self._policy.model
            nbytes = self._multi(model, self._policy.path, path).load(key, deltas)
            old = self._user_adapters.get(user)
            self._user_adapters[user] = (key, str(path))
            self._evicted.pop(user, None)
            self._last_used[user] = time.monotonic()
            if old is not None:
                self._retiring.append((model, old[0]))
            while len(self._user_adapters) > self.max_loaded_adapters:  # the least recently used goes
                lru = min((u for u in self._user_adapters if u != user), key=lambda u: self._last_used.get(u, 0.0))
                gone = self._user_adapters.pop(lru)
                self._evicted[lru] = (gone[1], gone[0][2])
                self._retiring.append((model, gone[0]))
                log.info("dropped %s's adapter (serving.max_loaded_adapters %d); their next request loads it",
                         lru, self.max_loaded_adapters)
            warm = self._rewarm_user(old[0], key) if rewarm and old is not None else None
            self._serving = (self._policy, self._table())
        return {"user": user, "path": str(path), "bytes": nbytes, "seconds": round(time.perf_counter() - t0, 3),
                "rewarm": warm}

    def _rewarm_user(self, old: tuple, new: tuple) -> dict | None:
        """Prefill the prompts cached under a user's `old` adapter key with the `new` one, straight into
        the prefix cache; never raises (a failure swaps cold)."""
        if self.rewarm_tokens <= 0 or self.batcher.prefix is None:
            return None
        t0 = time.perf_counter()
        fut = self.batcher.rewarm(self._policy, self.rewarm_tokens, self.rewarm_max_s, self.rewarm_min_tokens,
                                  switch=(old, new))
        try:
            res = fut.result(timeout=self.rewarm_max_s + 60)
        except Exception as exc:  # noqa: BLE001 - out of memory, a time-out: the user's next turn prefills cold
            self.batcher.cancel_rewarm()
            log.warning("re-warm of %s's new adapter failed, swapping cold: %s: %s", new[0],
                        exc.__class__.__name__, exc)
            return {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"}
        return {"ok": True, "prompts": len(res.entries), "tokens": sum(len(t) for _, t, _ in res.entries),
                "complete": res.complete, "seconds": round(time.perf_counter() - t0, 3)}

    def unload_user_adapter(self, user: str) -> None:
        """`user`'s requests go back to the shared policy; in-flight ones finish on the adapter."""
        with self._reload_lock:
            old = self._user_adapters.pop(user, None)
            self._evicted.pop(user, None)
            self._serving = (self._policy, self._table())
            if old is not None:
                self._retiring.append((self._policy.model, old[0]))

    def _retire(self, in_use: Callable[[], set]) -> None:
        """Drop replaced adapters no request decodes with (the decode loop calls it each iteration;
        `in_use` is asked only when something waits to be dropped). Never waits for the lock: a
        reload holds it while this very thread re-warms, so it retires later."""
        if not self._retiring or not self._reload_lock.acquire(blocking=False):
            return
        try:
            used = in_use()
            for model, key in list(self._retiring):
                if key not in used:
                    model.clawflow_multi_lora.unload(key)
                    self._retiring.remove((model, key))
        finally:
            self._reload_lock.release()

    def user_adapter(self, user: str | None) -> str | None:
        """The path of the adapter `user`'s requests decode with, None for the shared policy."""
        if user in self._user_adapters:
            return self._user_adapters[user][1]
        evicted = self._evicted.get(user)  # dropped for max_loaded_adapters: loaded again on their next request
        return evicted[0] if evicted else None

    def user_adapter_version(self, user: str | None) -> int | None:
        """The registry version of the adapter `user`'s requests decode with (None: the shared policy,
        or an adapter loaded without a version)."""
        if user in self._user_adapters:
            return self._user_adapters[user][0][2]
        evicted = self._evicted.get(user)
        return evicted[1] if evicted else None

    def _rewarm(self, policy: _Policy) -> dict | None:
        """Prefill the hottest cached prompts on `policy` and stage their KV for the swap; never raises."""
        if self.rewarm_tokens <= 0 or self.batcher.prefix is None:
            return None
        t0 = time.perf_counter()
        fut = self.batcher.rewarm(policy, self.rewarm_tokens, self.rewarm_max_s, self.rewarm_min_tokens)
        try:  # the job stops itself at rewarm_max_s; the margin covers a request prefill it waits behind
            res = fut.result(timeout=self.rewarm_max_s + 60)
        except Exception as exc:  # out of memory, a time-out, anything: swap cold
            self.batcher.cancel_rewarm()  # a time-out: stop it at its next chunk, keep nothing
            log.warning("re-warm of v%s failed after %.1fs, swapping cold: %s: %s", policy.version,
                        time.perf_counter() - t0, exc.__class__.__name__, exc)
            return {"ok": False, "error": f"{exc.__class__.__name__}: {exc}",
                    "seconds": round(time.perf_counter() - t0, 3)}
        self.batcher.adopt(policy, res.entries)
        info = {"ok": True, "prompts": len(res.entries), "tokens": sum(len(t) for _, t, _ in res.entries),
                "users_prompts": sum(a is not None for a, _, _ in res.entries),
                "prefilled": res.prefilled, "complete": res.complete, "chunks": res.chunks, "yielded": res.yielded,
                "seconds": round(time.perf_counter() - t0, 3)}
        log.info("re-warmed v%s: %s", policy.version, info)
        return info

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
    def submit(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
               user: str | None = None):
        """Queue a request for the decode loop; a `concurrent.futures.Future` of its `Generation`.
        Raises `batcher.QueueFull` when the waiting queue is at its bound. `on_token` runs on the
        decode thread: keep it cheap. `user`: decode with that user's adapter, if they have one (an
        adapter dropped for `max_loaded_adapters` is loaded again first, on the caller's thread)."""
        if user is not None and user in self._user_adapters:
            self._last_used[user] = time.monotonic()
        elif user is not None and (evicted := self._evicted.get(user)) is not None:
            try:
                self._load_user_adapter(user, *evicted, rewarm=False)  # not on a request's thread
            except AdapterError as exc:  # gone or broken since: the shared policy answers, and says why
                log.warning("cannot load %s's adapter again (%s); serving the shared policy", user, exc)
                self._evicted.pop(user, None)
        return self.batcher.submit(prompt_ids, params, on_token, user=user)

    def generate(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
                 user: str | None = None) -> Generation:
        return self.submit(prompt_ids, params, on_token, user).result()

    def close(self) -> None:
        self.batcher.close()

    def stats(self) -> EngineStats:
        b, prefix = self.batcher, self.batcher.prefix  # prefix None: the cache is off
        return EngineStats(queue_depth=b.queue_depth, active=b.active, decode_aborted=b.aborted,
                           prefix_cache_hits=prefix.hits if prefix is not None else 0,
                           prefix_cache_reused_tokens=prefix.reused_tokens if prefix is not None else 0)

    @torch.inference_mode()  # evaluation: no graph, and the serving kernels (packed Linears)
    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Log-probabilities of a fixed reply under the serving policy (evaluation, tests)."""
        from clawflow.policy.logprobs import response_logprobs

        model = self._policy.model
        multi = getattr(model, "clawflow_multi_lora", None)  # its default adapter, not the decode loop's rows
        with multi.unrouted() if multi is not None else contextlib.nullcontext():
            return response_logprobs(model, [list(prompt_ids)], [list(response_ids)])[0].tolist()

