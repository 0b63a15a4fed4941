"""HTTP routes: auth, OpenAI error JSON, and the mapping from routes to the gateway.

`/internal/v1/chat/completions` is the same endpoint for internal callers (the judge): admin key
only, and its turns are never recorded, so judge calls never become training data.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from clawflow.serving.admin_users import user_adapter_routes
from clawflow.serving.user_routes import user_routes
from clawflow.serving.gateway import BadRequest, Gateway, TurnContext
from clawflow.serving.generation import QueueFull, ReloadError
from clawflow.serving.protocol import ChatCompletionRequest, error_body
from clawflow.serving.limits import BodyLimitAndRequestIds
from clawflow.store.metrics import STORE as STORE_METRICS
from clawflow.users import KeyRefused, KeyResolver

log = logging.getLogger("clawflow.gateway")

# version (int) or alias ("champion") → (version, checkpoint path); the registry provides it.
CheckpointResolver = Callable[[int | str], tuple[int, str]]


class ReloadRequest(BaseModel):
    path: str | None = None
    version: int | str | None = None


def _error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status)


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def _key_ok(authorization: str | None, key: str) -> bool:
    given = _bearer(authorization)
    return given is not None and hmac.compare_digest(given.encode(), key.encode())  # constant time


async def _unless_disconnected(request: Request, work):
    """Await `work` (a non-streamed completion) unless the client disconnects first: then cancel it,
    which takes its requests out of the decode batch. Once the body is read, the ASGI `receive`
    only returns when the client has gone (`http.disconnect`) or the response is complete."""
    import asyncio

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watch.done() and watch.result().get("type") == "http.disconnect":
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its requests are out of the batch queue or marked to leave it
            log.info("client disconnected; request cancelled")
            return Response(status_code=499)  # nobody reads it
        return await task
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


def create_app(gw: Gateway, resolve: CheckpointResolver | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.sealer.start()
        follower = None
        if gw.cfg.registry.follow_champion_s and resolve is not None:  # replicas: serve what `champion` names
            from clawflow.serving.follow import ChampionFollower

            follower = ChampionFollower(gw.cfg, gw.engine, resolve, gw.cfg.registry.follow_champion_s,
                                        on_reload=lambda *_: setattr(gw.counters, "reloads", gw.counters.reloads + 1))
            follower.start()
        yield
        if follower is not None:
            follower.stop()
        gw.sealer.stop()  # every acknowledged turn ends in a sealed shard on a clean stop
        gw.engine.close()

    app = FastAPI(title="clawflow gateway", lifespan=lifespan)
    app.state.gateway = gw
    app.add_middleware(BodyLimitAndRequestIds, max_bytes=gw.cfg.serving.max_body_bytes)

    keys = KeyResolver(gw.cfg)

    def require_key(authorization: str | None = Header(None)) -> str:
        """The user the request's API key belongs to (clawflow/users.py); every turn it sends is
        recorded under that user."""
        try:
            return keys.resolve(_bearer(authorization))
        except KeyRefused as exc:
            raise HTTPException(401, str(exc)) from None

    def require_admin(authorization: str | None = Header(None)) -> None:
        if not _key_ok(authorization, gw.cfg.serving.admin_key):
            raise HTTPException(401, "Incorrect or missing admin key.")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 403: "permission_error"}.get(exc.status_code, "invalid_request_error")
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return _error(400, f"Invalid request: {where + ': ' if where else ''}{first['msg']}")

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(QueueFull)
    async def _busy(_: Request, exc: QueueFull) -> JSONResponse:
        resp = _error(429, f"{exc}; retry shortly", "rate_limit_error", "server_busy")
        resp.headers["Retry-After"] = "1"
        return resp

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "policy_version": gw.engine.policy_version}

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models() -> dict[str, Any]:
        # The context length under the names other servers use (vLLM, SGLang: max_model_len;
        # OpenRouter, LM Studio: context_length), so clients such as `clawflow connect` discover it.
        n = gw.engine.context_length
        return {"object": "list", "data": [{
            "id": gw.cfg.model.name, "object": "model", "owned_by": "clawflow",
            "policy_version": gw.engine.policy_version, "context_length": n, "max_model_len": n,
        }]}

    async def _chat(request: Request, req: ChatCompletionRequest, x_session_id: str | None, x_turn_type: str | None,
                    x_session_done: str | None, x_clawflow_source: str | None, record: bool, user: str):
        if x_turn_type not in (None, "main", "side"):
            raise BadRequest("X-Turn-Type must be `main` or `side`")
        ctx = TurnContext(session_id=x_session_id, turn_type=x_turn_type or "main",
                          session_done=(x_session_done or "").lower() in ("1", "true", "yes"),
                          source=x_clawflow_source or "live", record=record, user=user)
        if req.stream:  # a disconnect closes the generator, which aborts the decode
            return StreamingResponse(await gw.stream(req, ctx), media_type="text/event-stream")
        return await _unless_disconnected(request, gw.complete(req, ctx))

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatCompletionRequest, x_session_id: str | None = Header(None),
                   x_turn_type: str | None = Header(None), x_session_done: str | None = Header(None),
                   x_clawflow_source: str | None = Header(None), user: str = Depends(require_key)):
        return await _chat(request, req, x_session_id, x_turn_type, x_session_done, x_clawflow_source,
                           record=True, user=user)

    @app.post("/internal/v1/chat/completions", dependencies=[Depends(require_admin)])
    async def internal_chat(request: Request, req: ChatCompletionRequest):  # never recorded: no user
        return await _chat(request, req, None, None, None, "internal", record=False, user=gw.cfg.serving.user)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        c, e = gw.counters, gw.engine.stats()
        lines = [
            f"clawflow_requests_total {c.requests}",
            f"clawflow_prompt_tokens_total {c.prompt_tokens}",
            f"clawflow_completion_tokens_total {c.completion_tokens}",
            f"clawflow_turns_recorded_total {c.turns_recorded}",
            f"clawflow_reloads_total {c.reloads}",
            f"clawflow_policy_version {gw.engine.policy_version}",
            f"clawflow_unrecorded_requests_total {c.unrecorded}",
            f"clawflow_requests_cancelled_total {c.cancelled}",
            f"clawflow_decode_aborted_total {e.decode_aborted}",
            f"clawflow_queue_depth {e.queue_depth}",
            f"clawflow_prefix_cache_hits_total {e.prefix_cache_hits}",
            f"clawflow_prefix_cache_reused_tokens_total {e.prefix_cache_reused_tokens}",
            f"clawflow_active_requests {e.active}",
            *c.latency.prometheus("clawflow_request_latency_seconds"),
            *STORE_METRICS.prometheus(),  # torn WAL records, quarantined shards, sealed turns
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/admin/policy", dependencies=[Depends(require_admin)])
    async def policy() -> dict[str, Any]:
        answer = {"version": gw.engine.policy_version, "path": gw.engine.model_path, "model": gw.cfg.model.name}
        if gw.engine.dtype is not None:  # torch engine: what serving.dtype settled on
            answer["dtype"] = gw.engine.dtype
            answer["linear_kernel"] = gw.engine.linear_kernel
        return answer

    @app.post("/admin/reload", dependencies=[Depends(require_admin)])
    async def reload(body: ReloadRequest):
        import asyncio

        if body.path:
            version = body.version if isinstance(body.version, int) else gw.engine.policy_version + 1
            path = body.path
        elif body.version is not None:
            if resolve is None:
                return _error(400, "this gateway has no registry: reload by `path`")
            try:
                version, path = await asyncio.to_thread(resolve, body.version)
            except LookupError as exc:
                return _error(404, str(exc), code="version_not_found")
            except ReloadError as exc:  # fetched from the registry but refused (checksum)
                log.warning("reload refused, still serving v%s: %s", gw.engine.policy_version, exc)
                return _error(400, f"{exc}; still serving version {gw.engine.policy_version}", code="reload_failed")
        else:
            return _error(400, "give `path` (a checkpoint directory) or `version` (a registry version or alias)")
        try:
            seconds = await asyncio.to_thread(gw.engine.reload, path, version)
        except ReloadError as exc:
            log.warning("reload refused, still serving v%s: %s", gw.engine.policy_version, exc)
            return _error(400, f"{exc}; still serving version {gw.engine.policy_version}", code="reload_failed")
        gw.counters.reloads += 1
        log.info("reloaded v%s from %s in %.1fs", version, path, seconds)
        answer = {"version": version, "path": path, "seconds": round(seconds, 3)}
        if gw.engine.last_rewarm is not None:  # torch engine: what it re-warmed
            answer["rewarm"] = gw.engine.last_rewarm
        return answer

    app.include_router(user_adapter_routes(gw.engine, require_admin))
    app.include_router(user_routes(gw, require_key, lambda auth: _key_ok(auth, gw.cfg.serving.admin_key)))

    @app.post("/admin/seal", dependencies=[Depends(require_admin)])
    async def seal():
        import asyncio

        shards = await asyncio.to_thread(gw.sealer.seal_all)
        return {"shards": [{"shard_id": s.shard_id, "path": str(s.path), "rows": s.rows} for s in shards]}

    return app
