"""The SGLang engine: the embedded engine's interface over an SGLang server's native HTTP API.

SGLang pins its own torch/transformers and needs CUDA (its CPU backend needs AMX), so it runs as
its own server process and clawflow never imports it. Tokens in, tokens out: the gateway applies
the chat template here and sends `input_ids` to `/generate` with `return_logprob`, so the recorded
ids and logprobs are SGLang's own (`meta_info.output_token_logprobs`, `[logprob, token_id, _]`).
SGLang returns log_softmax(logits / temperature) unless its server runs with
`SGLANG_RETURN_ORIGINAL_LOGPROB=1` (then log_softmax(logits), what the trainer's ratio assumes, like
the torch engine). The setting is an environment variable of the SGLang process that none of its
HTTP routes reports, so at connect time the adapter measures it (`check_logprobs`): the top token's
logprob at temperature 1 and 0.5 is the same only for raw logprobs. Scaled ones are refused.
Reload is `/update_weights_from_disk` with `weight_version`; a LoRA adapter directory is loaded
with `/load_lora_adapter` and named in later requests' `lora_path`. A request's version is the
`weight_version` SGLang reports for it; SGLang by default waits for in-flight requests before it
swaps weights, so a reply is never a mix.

Users' own adapters (issue #29), as the embedded engine's `load_user_adapter`: each version is
loaded with `/load_lora_adapter` under its own name (`user-<name>-<n>`) and a user's requests name
it in `lora_path`; SGLang batches rows of different adapters itself. A replaced version is
unloaded (`/unload_lora_adapter`) once none of the requests this gateway sent with it is running.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from clawflow.serving.engine_protocol import EngineStats
from clawflow.serving.generation import AdapterError, Generation, QueueFull, ReloadError, SamplingParams, TokenCallback

log = logging.getLogger(__name__)


class LogprobsError(RuntimeError):
    """SGLang returns temperature-scaled logprobs: recording them would bias every training ratio."""


class SGLangEngine:  # an `engine_protocol.Engine`
    def __init__(self, url: str, model_path: str, version: int = 0, max_batch: int = 32, max_queue: int = 64,
                 timeout_s: float = 600.0):
        from transformers import AutoConfig, AutoTokenizer

        self.url = url.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._ctx = int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))
        self._version, self._path, self._lora = version, str(model_path), None
        self._http = httpx.Client(timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_batch, thread_name_prefix="clawflow-sglang")
        self._limit, self._outstanding, self._lock = max_batch + max_queue, 0, threading.Lock()
        self.eos_ids = {self.tokenizer.eos_token_id}
        self.dtype = None  # SGLang settles its own (its --dtype)
        self.linear_kernel = None  # and its own kernels
        self.last_rewarm: dict | None = None  # no re-warm here: SGLang manages its own cache
        # "raw" | "scaled" | None (not measured yet: the server was unreachable or the probe undecided)
        self.logprobs_kind: str | None = None
        self._check_lock = threading.Lock()
        # users' adapters: user -> (lora name, path, registry version); requests running per lora name;
        # names to unload
        self._users: dict[str, tuple[str, str, int | None]] = {}
        self._running: dict[str, int] = {}
        self._retiring: set[str] = set()
        self._loads = 0
        self.check_logprobs()

    # -- the engine interface (engine_protocol.Engine) --------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def model_path(self) -> str:
        return self._path

    @property
    def context_length(self) -> int:
        return self._ctx

    def stats(self) -> EngineStats:
        """Requests beyond the pool's threads are waiting; SGLang's own cache counters are not read."""
        n, slots = self._outstanding, self._pool._max_workers
        return EngineStats(queue_depth=max(n - slots, 0), active=min(n, slots))

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
               user: str | None = None) -> Future:
        with self._lock:
            if self._outstanding >= self._limit:
                raise QueueFull(f"server busy: {self._outstanding} requests outstanding")
            self._outstanding += 1
            mine = self._users.get(user) if user is not None else None
            lora = (mine[0], self._version) if mine is not None else self._lora  # pinned now
            if mine is not None:
                self._running[mine[0]] = self._running.get(mine[0], 0) + 1
        fut = self._pool.submit(self._generate, list(prompt_ids), params, on_token, lora,
                                mine[2] if mine is not None else None)
        fut.add_done_callback(lambda _: self._release(mine[0] if mine is not None else None))
        return fut

    def generate(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
                 user: str | None = None) -> Generation:
        return self.submit(prompt_ids, params, on_token, user).result()

    def load_user_adapter(self, user: str, path: str, version: int | None = None) -> dict:
        """`user`'s requests from now on name the adapter at `path`; an AdapterError changes nothing."""
        import time

        t0 = time.perf_counter()
        with self._lock:
            self._loads += 1
            name = f"user-{user}-{self._loads}"
        self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, AdapterError)
        with self._lock:
            old = self._users.get(user)
            self._users[user] = (name, str(path), version)
            if old is not None:
                self._retiring.add(old[0])
        self._unload_unused()
        return {"user": user, "path": str(path), "lora_name": name, "seconds": round(time.perf_counter() - t0, 3)}

    def unload_user_adapter(self, user: str) -> None:
        with self._lock:
            old = self._users.pop(user, None)
            if old is not None:
                self._retiring.add(old[0])
        self._unload_unused()

    def user_adapter(self, user: str | None) -> str | None:
        mine = self._users.get(user) if user is not None else None
        return mine[1] if mine is not None else None

    def user_adapter_version(self, user: str | None) -> int | None:
        mine = self._users.get(user) if user is not None else None
        return mine[2] if mine is not None else None

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprobs of a fixed reply: a 1-token generate that returns the input's logprobs."""
        body = {"input_ids": prompt_ids + response_ids, "return_logprob": True,
                "logprob_start_len": len(prompt_ids) - 1, "sampling_params": {"max_new_tokens": 1},
                **self._lora_field()}
        meta = self._post("/generate", body)["meta_info"]
        lps = [e[0] for e in meta["input_token_logprobs"]]
        return lps[-len(response_ids):]

    def reload(self, path: str, version: int) -> float:
        import time

        t0 = time.perf_counter()
        if (Path(path) / "adapter_config.json").is_file():
            name = f"v{version}"
            self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, ReloadError)
            self._lora = (name, version)
        else:
            self._post("/update_weights_from_disk",
                       {"model_path": str(path), "weight_version": str(version)}, ReloadError)
            self._lora = None
        self._version, self._path = version, str(path)
        return time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def check_logprobs(self) -> str | None:
        """Measure which logprobs the server returns (once it answers); raise LogprobsError for
        scaled ones. Returns "raw", or None while the server cannot tell (down, or a top token of
        probability ~1)."""
        with self._check_lock:
            if self.logprobs_kind is None:
                try:
                    top = [self._top_logprob(t) for t in (1.0, 0.5)]
                except (RuntimeError, KeyError, IndexError, TypeError, ValueError) as exc:
                    log.warning("SGLang logprob check postponed (%s)", exc)
                    return None
                self.logprobs_kind = _logprobs_kind(*top)
                log.info("SGLang at %s returns %s logprobs (top token: %.4f at T=1, %.4f at T=0.5)",
                         self.url, self.logprobs_kind or "undecided", *top)
            if self.logprobs_kind == "scaled":
                raise LogprobsError(f"SGLang at {self.url} returns temperature-scaled logprobs; restart it "
                                    "with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (docs/scaling-out.md)")
            return self.logprobs_kind

    def _top_logprob(self, temperature: float) -> float:
        prompt = self.encode_chat([{"role": "user", "content": "Say one word."}])
        body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 1,
                "sampling_params": {"max_new_tokens": 1, "temperature": temperature, "top_p": 1.0}}
        return float(self._post("/generate", body)["meta_info"]["output_top_logprobs"][0][0][0])

    # -- HTTP --------------------------------------------------------------------------------
    def _release(self, lora_name: str | None = None) -> None:
        with self._lock:
            self._outstanding -= 1
            if lora_name is not None:
                self._running[lora_name] -= 1
        if lora_name is not None:
            self._unload_unused()

    def _unload_unused(self) -> None:
        """Unload replaced user adapters no request of ours is running with (best effort: a failure
        leaves one unused adapter loaded in SGLang, and is logged)."""
        with self._lock:
            idle = [n for n in self._retiring if not self._running.get(n)]
            self._retiring.difference_update(idle)
            for n in idle:
                self._running.pop(n, None)
        for name in idle:
            try:
                self._post("/unload_lora_adapter", {"lora_name": name})
            except RuntimeError as exc:
                log.warning("could not unload replaced adapter %s: %s", name, exc)

    def _lora_field(self, lora: tuple[str, int] | None = None) -> dict:
        lora = lora or self._lora
        return {"lora_path": lora[0]} if lora else {}

    def _post(self, route: str, body: dict, error: type[Exception] = RuntimeError) -> dict:
        try:
            r = self._http.post(self.url + route, json=body)
        except httpx.HTTPError as exc:
            raise error(f"SGLang server {self.url} unreachable: {exc}") from exc
        out = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 200 or out.get("success") is False:
            raise error(f"SGLang {route} failed ({r.status_code}): "
                        f"{out.get('message') or out.get('error_message') or r.text[:200]}")
        return out

    def _generate(self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None,
                  lora: tuple[str, int] | None, adapter_version: int | None = None) -> Generation:
        if self.logprobs_kind is None:  # SGLang was not up when the gateway started
            self.check_logprobs()
        version = self._version  # SGLang's own weight_version wins when it reports one
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "stop": params.stop or None, "no_stop_trim": False}
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body = {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True, "stream": True,
                "top_logprobs_num": params.top_logprobs, **({"lora_path": lora[0]} if lora else {})}
        ids: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        meta: dict = {}
        with self._http.stream("POST", self.url + "/generate", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"SGLang /generate failed ({r.status_code}): {r.read()[:200]!r}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                meta = json.loads(line[5:])["meta_info"]
                new = _new_entries(meta.get("output_token_logprobs") or [], len(ids), meta["completion_tokens"])
                new_tops = [[(int(t), float(v)) for v, t, *_ in (e or [])] for e in
                            _new_entries(meta.get("output_top_logprobs") or [], len(tops), meta["completion_tokens"])]
                for i, (lp, tok, *_) in enumerate(new):
                    ids.append(int(tok))
                    lps.append(float(lp))
                    top = new_tops[i] if i < len(new_tops) else None
                    if top is not None:
                        tops.append(top)
                    if on_token is not None and not on_token(int(tok), float(lp), self.decode(ids),
                                                             top if params.top_logprobs else None):
                        return Generation(ids, lps, self.decode(ids), "abort", version, tops,
                                          adapter_version)  # leaving the stream aborts the request in SGLang
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        text = self.decode(ids)
        if finish == "stop" and params.stop:
            cuts = [text.index(s) for s in params.stop if s in text]
            text = text[: min(cuts)] if cuts else text
        reported = str(meta.get("weight_version") or "")
        if lora is None and reported.isdigit():  # with an adapter, the adapter is the version
            version = int(reported)
        return Generation(ids, lps, text, finish if finish in ("stop", "length", "abort") else "stop", version, tops,
                          adapter_version)


def _new_entries(entries: list, have: int, completion_tokens: int) -> list:
    """SGLang streams cumulative lists by default, increments with `--incremental-streaming-output`."""
    return entries[have:] if len(entries) == completion_tokens else entries


def _logprobs_kind(at_t1: float, at_half: float) -> str | None:
    """Raw logprobs do not depend on the temperature; scaled ones sharpen: the top token's rises
    (log_softmax(2z) vs log_softmax(z)). A top token of probability ~1 cannot tell them apart."""
    if at_t1 > -1e-3:
        return None
    tolerance = 0.01 + 0.02 * abs(at_t1)  # bf16 logits and batch composition move raw values a little
    if abs(at_half - at_t1) <= tolerance:
        return "raw"
    return "scaled" if at_half > at_t1 else None
