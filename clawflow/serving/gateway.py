"""Serving logic: one chat completion from request model to recorded turn. No HTTP here.

Requests go straight to the engine's continuous-batching queue (`engine.submit`, a future): the
engine bounds how many decode at once and how many wait; a full queue raises `QueueFull` (HTTP
429) before any byte of a reply is sent."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from clawflow.config import Config
from clawflow.serving.engine_protocol import Engine
from clawflow.serving.generation import Generation, SamplingParams
from clawflow.serving.protocol import ChatCompletionRequest, completion_id, now
from clawflow.serving.sessions import SessionTracker, split_new_messages
from clawflow.serving.toolcalls import TOOL_CALL_OPEN, parse_tool_calls
from clawflow.contracts.turn import DEFAULT_USER, TurnRecord
from clawflow.store.sealer import Sealer
from clawflow.store.wal import SegmentWriter


class BadRequest(ValueError):
    """Maps to HTTP 400 with an OpenAI error body."""


@dataclass
class TurnContext:
    session_id: str | None = None
    turn_type: str = "main"
    session_done: bool = False
    source: str = "live"
    record: bool = True  # False: internal callers (the judge), never training data
    user: str = DEFAULT_USER  # the authenticated API key's owner (app.py sets it from the key)


def _adapter_user(ctx: TurnContext) -> str | None:
    """Whose adapter decodes the request: its key's owner; internal callers (the judge) get the
    shared policy."""
    return ctx.user if ctx.record else None


@dataclass
class Counters:
    requests: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    turns_recorded: int = 0
    reloads: int = 0
    unrecorded: int = 0
    cancelled: int = 0  # clients that left before their reply was complete (decode stopped, nothing recorded)
    latency: "Histogram" = field(default_factory=lambda: Histogram())


# seconds; end-to-end latency of one chat completion (all choices, recording included)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: int = 0
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
        self.total += 1
        self.sum += seconds

    def prometheus(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(LATENCY_BUCKETS, self.counts)]
        return [*lines, f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}",
                f"{name}_count {self.total}"]


@dataclass
class Gateway:
    cfg: Config
    engine: Engine
    writer: SegmentWriter
    sealer: Sealer
    tracker: SessionTracker = field(default_factory=SessionTracker)
    counters: Counters = field(default_factory=Counters)

    # -- shared steps ----------------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest) -> tuple[list[dict], list[int], SamplingParams]:
        messages = [m.to_template() for m in req.messages]
        try:
            prompt_ids = self.engine.encode_chat(messages, req.tools)
        except Exception as exc:  # a template that rejects the conversation is the client's error
            raise BadRequest(f"messages cannot be formatted with the model's chat template: {exc}") from exc
        max_new = req.max_new(self.cfg.serving.max_new_tokens)
        limit = self.engine.context_length
        if len(prompt_ids) + max_new > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens; the messages use "
                f"{len(prompt_ids)} and max_tokens asks for {max_new}."
            )
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = SamplingParams(max_new, req.temperature, req.top_p, req.seed, req.stop_list(), top)
        return messages, prompt_ids, params

    def reply_message(self, gen: Generation, req: ChatCompletionRequest) -> tuple[dict[str, Any], str]:
        content, calls = parse_tool_calls(gen.text) if req.tools else (gen.text, [])
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        finish = gen.finish_reason
        if calls:
            msg["tool_calls"] = calls
            finish = "tool_calls"
        return msg, finish

    async def record(self, ctx: TurnContext, req: ChatCompletionRequest, messages: list[dict],
                     prompt_ids: list[int], gen: Generation, reply: dict, finish: str, group_id: str | None) -> None:
        if not ctx.record:
            self.counters.unrecorded += 1
            return
        session_id = self.tracker.resolve(messages, ctx.session_id, user=ctx.user)
        turn_index, new_messages = split_new_messages(messages)
        rec = TurnRecord(
            session_id=session_id, turn_index=turn_index, policy_version=gen.policy_version,
            messages=messages, prompt_token_ids=prompt_ids, response_token_ids=gen.token_ids,
            response_logprobs=gen.logprobs, response_text=gen.text, finish_reason=finish,
            new_messages=new_messages, turn_type=ctx.turn_type, source=ctx.source, group_id=group_id,
            tools=req.tools, tool_calls=reply.get("tool_calls"), session_done=ctx.session_done, user=ctx.user,
            adapter_version=gen.adapter_version,
        )
        await asyncio.to_thread(self.writer.append, rec)  # durable before the reply completes
        self.tracker.remember(session_id, messages, {"role": "assistant", "content": reply.get("content") or "",
                                                     "tool_calls": reply.get("tool_calls")}, user=ctx.user)
        self.counters.turns_recorded += 1

    def logprob_entry(self, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> dict:
        text = self.engine.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                "top_logprobs": [self.logprob_entry(t, lp) for t, lp in top or []] if top is not None else []}

    def logprobs_block(self, gen: Generation) -> dict[str, Any]:
        tops = gen.top_logprobs or [[] for _ in gen.token_ids]
        return {"content": [self.logprob_entry(t, lp, top) for t, lp, top in zip(gen.token_ids, gen.logprobs, tops)]}

    # -- non-streaming ---------------------------------------------------------------------
    async def complete(self, req: ChatCompletionRequest, ctx: TurnContext) -> dict[str, Any]:
        messages, prompt_ids, params = self.prepare(req)
        t0 = time.perf_counter()
        futures = []
        live = {"cancelled": False}  # set when the caller is cancelled (the HTTP client went away)
        try:
            for i in range(req.n):  # all n choices decode side by side in the batch
                p = params if params.seed is None else SamplingParams(**{**params.__dict__, "seed": params.seed + i})
                futures.append(self.engine.submit(prompt_ids, p, lambda *_: not live["cancelled"],
                                                  user=_adapter_user(ctx)))
        except BaseException:
            _abort(futures, live)
            raise
        self.counters.requests += 1
        group_id = completion_id() if req.n > 1 else None
        choices, completion_tokens = [], 0
        try:
            for i, fut in enumerate(futures):
                gen = await asyncio.wrap_future(fut)
                reply, finish = self.reply_message(gen, req)
                await self.record(ctx, req, messages, prompt_ids, gen, reply, finish, group_id)
                completion_tokens += len(gen.token_ids)
                choice = {"index": i, "message": reply, "finish_reason": finish,
                          "logprobs": self.logprobs_block(gen) if req.logprobs else None}
                choices.append(choice)
        except BaseException:  # cancelled: every choice still decoding leaves the batch at its next step
            _abort(futures, live)
            self.counters.cancelled += 1
            raise
        self._count(len(prompt_ids), completion_tokens)
        self.counters.latency.observe(time.perf_counter() - t0)
        return {
            "id": completion_id(), "object": "chat.completion", "created": now(),
            "model": self.cfg.model.name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "system_fingerprint": f"policy-v{gen.policy_version}",
        }

    def _count(self, prompt: int, completion: int) -> None:
        self.counters.prompt_tokens += prompt
        self.counters.completion_tokens += completion

    # -- streaming -------------------------------------------------------------------------
    async def stream(self, req: ChatCompletionRequest, ctx: TurnContext) -> AsyncIterator[str]:
        messages, prompt_ids, params = self.prepare(req)  # raises before the first byte is sent
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        live = {"cancelled": False}

        def on_token(token: int, logprob: float, text: str, top: list | None) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, (token, logprob, text, top))
            return not live["cancelled"]

        fut = self.engine.submit(prompt_ids, params, on_token, user=_adapter_user(ctx))  # QueueFull → 429
        self.counters.requests += 1
        return self._stream(req, ctx, messages, prompt_ids, params, fut, queue, live)

    async def _stream(self, req, ctx, messages, prompt_ids, params, fut, queue, live) -> AsyncIterator[str]:
        cid, created, model = completion_id(), now(), self.cfg.model.name
        t0 = time.perf_counter()
        sent, finished = "", False
        pending_lp: list[dict] = []  # logprobs of tokens whose text is not sent yet

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            yield chunk({"role": "assistant", "content": ""})
            task = asyncio.wrap_future(fut)
            while not task.done() or not queue.empty():
                try:
                    token, logprob, text, top = await asyncio.wait_for(queue.get(), timeout=0.05)
                except TimeoutError:
                    continue
                if req.logprobs:
                    pending_lp.append(self.logprob_entry(token, logprob, top))  # as in the non-streamed reply
                if req.tools:  # text streams until a tool call starts; the calls come parsed at the end
                    text = text.lstrip().split(TOOL_CALL_OPEN, 1)[0]
                safe = _streamable(text, [*params.stop, TOOL_CALL_OPEN] if req.tools else params.stop)
                if safe.startswith(sent) and len(safe) > len(sent):
                    extra = {"logprobs": {"content": pending_lp}} if req.logprobs else {}
                    yield chunk({"content": safe[len(sent):]}, **extra)
                    sent, pending_lp = safe, []
            gen = await task
            reply, finish = self.reply_message(gen, req)
            if req.tools:
                rest = reply.get("content") or ""
                if rest.startswith(sent) and len(rest) > len(sent):  # e.g. a malformed call kept as text
                    extra = {"logprobs": {"content": pending_lp}} if req.logprobs and pending_lp else {}
                    yield chunk({"content": rest[len(sent):]}, **extra)
            elif len(gen.text) > len(sent) and gen.text.startswith(sent):
                extra = {"logprobs": {"content": pending_lp}} if req.logprobs and pending_lp else {}
                yield chunk({"content": gen.text[len(sent):]}, **extra)
            if reply.get("tool_calls"):
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(reply["tool_calls"])]})
            await self.record(ctx, req, messages, prompt_ids, gen, reply, finish, None)
            finished = True  # decoded and recorded: a client leaving now cancels nothing
            self._count(len(prompt_ids), len(gen.token_ids))
            self.counters.latency.observe(time.perf_counter() - t0)
            yield chunk({}, finish)
            if req.stream_options and req.stream_options.include_usage:
                usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                         "total_tokens": len(prompt_ids) + len(gen.token_ids)}
                yield f"data: {json.dumps({'id': cid, 'object': 'chat.completion.chunk', 'created': created, 'model': model, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.counters.cancelled += 1
            _abort([fut], live)  # a client that disconnects mid-stream leaves the batch at the next step


def _abort(futures: list, live: dict) -> None:
    """Stop requests whose caller went away: running ones see `live["cancelled"]` in their token
    callback and leave the batch at the next decode step; queued ones are never admitted."""
    live["cancelled"] = True
    for f in futures:
        f.cancel()


def _streamable(text: str, stops: list[str]) -> str:
    """The part of the decoded text that is safe to stream: without a trailing incomplete UTF-8
    character (decoded as U+FFFD until its last byte token arrives) and without a tail that could
    be the start of a stop string (the engine cuts the reply there if the stop string completes)."""
    text = text.rstrip("\ufffd")
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]
