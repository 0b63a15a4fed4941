"""HTTP routes: auth, OpenAI error JSON, and the mapping from routes to the gateway."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from clawflow.serving.engine import ReloadError
from clawflow.serving.gateway import BadRequest, Gateway, TurnContext
from clawflow.serving.protocol import ChatCompletionRequest, error_body

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


def create_app(gw: Gateway, resolve: CheckpointResolver | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.sealer.start()
        yield
        gw.sealer.stop()  # every acknowledged turn ends in a sealed shard on a clean stop

    app = FastAPI(title="clawflow gateway", lifespan=lifespan)
    app.state.gateway = gw

    def require_key(authorization: str | None = Header(None)) -> None:
        if _bearer(authorization) != gw.cfg.serving.api_key:
            raise HTTPException(401, "Incorrect or missing API key (send `Authorization: Bearer <key>`).")

    def require_admin(authorization: str | None = Header(None)) -> None:
        if _bearer(authorization) != gw.cfg.serving.admin_key:
            raise HTTPException(401, "Incorrect or missing admin key.")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return _error(400, f"Invalid request: {where + ': ' if where else ''}{first['msg']}")

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "policy_version": gw.engine.policy_version}

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": gw.cfg.model.name, "object": "model", "owned_by": "clawflow",
            "policy_version": gw.engine.policy_version,
        }]}

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat(req: ChatCompletionRequest, x_session_id: str | None = Header(None),
                   x_turn_type: str | None = Header(None), x_session_done: str | None = Header(None),
                   x_clawflow_source: str | None = Header(None)):
        if x_turn_type not in (None, "main", "side"):
            raise BadRequest("X-Turn-Type must be `main` or `side`")
        ctx = TurnContext(session_id=x_session_id, turn_type=x_turn_type or "main",
                          session_done=(x_session_done or "").lower() in ("1", "true", "yes"),
                          source=x_clawflow_source or "live")
        if req.stream:
            return StreamingResponse(await gw.stream(req, ctx), media_type="text/event-stream")
        return await gw.complete(req, ctx)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        c = gw.counters
        lines = [
            f"clawflow_requests_total {c.requests}",
            f"clawflow_prompt_tokens_total {c.prompt_tokens}",
            f"clawflow_completion_tokens_total {c.completion_tokens}",
            f"clawflow_turns_recorded_total {c.turns_recorded}",
            f"clawflow_reloads_total {c.reloads}",
            f"clawflow_policy_version {gw.engine.policy_version}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.get("/admin/policy", dependencies=[Depends(require_admin)])
    async def policy() -> dict[str, Any]:
        return {"version": gw.engine.policy_version, "path": gw.engine.model_path, "model": gw.cfg.model.name}

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
        else:
            return _error(400, "give `path` (a checkpoint directory) or `version` (a registry version or alias)")
        try:
            seconds = await asyncio.to_thread(gw.engine.reload, path, version)
        except ReloadError as exc:
            log.warning("reload refused, still serving v%s: %s", gw.engine.policy_version, exc)
            return _error(400, f"{exc}; still serving version {gw.engine.policy_version}", code="reload_failed")
        gw.counters.reloads += 1
        log.info("reloaded v%s from %s in %.1fs", version, path, seconds)
        return {"version": version, "path": path, "seconds": round(seconds, 3)}

    @app.post("/admin/seal", dependencies=[Depends(require_admin)])
    async def seal():
        import asyncio

        shards = await asyncio.to_thread(gw.sealer.seal_all)
        return {"shards": [{"shard_id": s.shard_id, "path": str(s.path), "rows": s.rows} for s in shards]}

    return app
