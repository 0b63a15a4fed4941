"""What a user's own key may read (issue #29): their standing preferences, their adapter versions,
and an export of their turns; never another user's. The admin key reads anyone's (`?user=NAME`).

    GET /v1/clawflow/me                  who the key is, the adapter serving them, preferences, versions
    GET /v1/clawflow/export[?format=jsonl|parquet]   every sealed turn of theirs, as a file

Another user's name with a user key: 403. These read the store and the registry the CLI reads
(`clawflow prefs`, `versions --user`, `export --user`), in a worker thread.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Header, HTTPException
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask


def user_routes(gw: Any, require_key: Callable[..., str], is_admin: Callable[[str | None], bool]) -> APIRouter:
    """`require_key(authorization)`: the key's user (or a 401); `is_admin(authorization)`: the admin key."""
    router = APIRouter()
    cfg = gw.cfg

    def whose(asked: str | None, authorization: str | None) -> str:
        """The user these routes act for: the key's owner, or with the admin key whoever `user`
        names (default: the default user). 401 for an unknown key, 403 for another user's name."""
        if is_admin(authorization):
            return asked or cfg.serving.user
        key_user = require_key(authorization)
        if asked is None or asked == key_user:
            return key_user
        raise HTTPException(403, "a user's key reads only that user's own data")

    def me(user: str) -> dict[str, Any]:
        from clawflow.policy import registry
        from clawflow.prefs.record import ranked
        from clawflow.prefs.store import PreferenceStore

        prefs = [{"id": p.pref_id, "text": p.text, "strength": p.strength, "sessions": p.sessions}
                 for p in ranked(PreferenceStore.for_config(cfg).load(), user)]
        try:
            versions = [{"version": v["version"], "aliases": v["aliases"], "gate": v["tags"].get("gate"),
                         "dose": v["tags"].get("dose")}
                        for v in registry.list_versions(registry.for_user(cfg, user))] \
                if user != cfg.serving.user else []
        except Exception:  # noqa: BLE001 - no registry yet: no versions
            versions = []
        return {"user": user, "adapter_version": gw.engine.user_adapter_version(user),
                "preferences": prefs, "versions": versions}

    @router.get("/v1/clawflow/me")
    async def read_me(user: str | None = None, authorization: str | None = Header(None)):
        who = whose(user, authorization)
        return await asyncio.to_thread(me, who)

    @router.get("/v1/clawflow/export")
    async def export(user: str | None = None, format: str = "jsonl", authorization: str | None = Header(None)):
        from clawflow.store.catalog import Catalog
        from clawflow.store.privacy import FORMATS, export_sessions

        who = whose(user, authorization)
        if format not in FORMATS:
            raise HTTPException(400, f"unknown export format {format!r} (choose parquet or jsonl)")
        tmp = Path(tempfile.mkdtemp(prefix="clawflow-export-"))
        out = tmp / f"{who}.{format}"
        await asyncio.to_thread(export_sessions, Catalog.for_config(cfg), out, None, format, who)
        return FileResponse(out, filename=out.name, background=BackgroundTask(_remove, tmp))

    return router


def _remove(tmp: Path) -> None:
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
