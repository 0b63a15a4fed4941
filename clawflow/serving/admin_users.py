"""Admin routes for users' own adapters (issue #29): which adapter decodes a user's requests.

    POST   /admin/users/{user}/adapter  {"path": ADAPTER_DIR, "version": N}   load (or replace) it
    GET    /admin/users/{user}/adapter                                         what serves the user
    DELETE /admin/users/{user}/adapter                                         back to the shared policy

A refused adapter (unreadable, trained on other weights, not appliable per row) answers 400
`adapter_refused` and changes nothing: the user's old adapter, and everyone else's, keep serving.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from clawflow.serving.generation import AdapterError
from clawflow.serving.protocol import error_body
from clawflow.users import NAME_PATTERN

log = logging.getLogger("clawflow.gateway")


class UserAdapterRequest(BaseModel):
    path: str = Field(min_length=1)  # a LoRA adapter directory, trained on the served base
    version: int | None = Field(None, ge=0)  # its number in the user's registry line, recorded with each turn


def user_adapter_routes(engine: Any, require_admin: Callable[..., None]) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_admin)])

    def bad_name(user: str) -> JSONResponse | None:
        if re.fullmatch(NAME_PATTERN, user):
            return None
        return JSONResponse(error_body(f"user name {user!r}: use 1-64 characters of A-Z a-z 0-9 _ . -",
                                       "invalid_request_error", None), status_code=400)

    def state(user: str) -> dict[str, Any]:
        return {"user": user, "path": engine.user_adapter(user), "version": engine.user_adapter_version(user)}

    @router.post("/admin/users/{user}/adapter")
    async def load(user: str, body: UserAdapterRequest):
        if (refused := bad_name(user)) is not None:
            return refused
        try:
            info = await asyncio.to_thread(engine.load_user_adapter, user, body.path, body.version)
        except AdapterError as exc:
            log.warning("adapter for %s refused, still serving %s: %s", user, engine.user_adapter(user) or "the shared "
                        "policy", exc)
            return JSONResponse(error_body(f"{exc}; {user} keeps what served them", "invalid_request_error",
                                           "adapter_refused"), status_code=400)
        log.info("%s's requests now decode with adapter v%s from %s (%.3f s)", user, body.version, body.path,
                 info.get("seconds", 0.0))
        return {**state(user), "seconds": info.get("seconds"), "rewarm": info.get("rewarm")}

    @router.get("/admin/users/{user}/adapter")
    async def show(user: str):
        return bad_name(user) or state(user)

    @router.delete("/admin/users/{user}/adapter")
    async def unload(user: str):
        if (refused := bad_name(user)) is not None:
            return refused
        await asyncio.to_thread(engine.unload_user_adapter, user)
        return state(user)

    return router
