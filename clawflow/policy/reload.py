"""Serve a version: tell the gateway to reload, roll back the champion, provision the base (flows and the CLI)."""

from __future__ import annotations

from typing import Any

import httpx

from clawflow import events
from clawflow.config import Config
from clawflow.policy import registry


class GatewayRefused(RuntimeError):
    """The gateway answered but would not load the checkpoint (it keeps serving the old one)."""


def reload_gateway(cfg: Config, version: int, checkpoint: str, timeout_s: float = 300) -> dict[str, Any] | None:
    """Ask the running gateway to serve `version`; None when no gateway is running (it loads the
    champion when it starts). 5xx/timeouts raise httpx errors so callers can retry."""
    from clawflow.artifacts import is_remote

    user = cfg.registry.user
    if user is not None:  # a user's own adapter: only their requests move (the path must be readable there)
        route, body = f"/admin/users/{user}/adapter", {"path": checkpoint, "version": version}
    else:  # with a tracking server the gateway may be another host: it fetches the version itself
        route = "/admin/reload"
        body = {"version": version} if is_remote(cfg) else {"path": checkpoint, "version": version}
    try:
        r = httpx.post(f"{cfg.gateway_url}{route}", json=body,
                       headers={"Authorization": f"Bearer {cfg.serving.admin_key}"}, timeout=timeout_s)
    except httpx.ConnectError:
        return None
    if r.status_code >= 500:
        r.raise_for_status()
    if r.status_code != 200:
        raise GatewayRefused(f"gateway refused v{version}{f' for {user}' if user else ''}: {r.text}")
    events.emit(events.POLICY_RELOADED, f"clawflow.policy.{registry.model_name(cfg)}.v{version}", r.json())
    return r.json()


def unload_user_adapter(cfg: Config, user: str) -> bool:
    """Tell the running gateway to serve `user` the shared policy again; False when none is running."""
    try:
        r = httpx.delete(f"{cfg.gateway_url}/admin/users/{user}/adapter",
                         headers={"Authorization": f"Bearer {cfg.serving.admin_key}"}, timeout=60)
    except httpx.ConnectError:
        return False
    if r.status_code != 200:
        raise GatewayRefused(f"gateway refused to unload {user}'s adapter: {r.text}")
    return True


def rollback(cfg: Config, target: int | str | None = None) -> dict[str, Any]:
    """Move `champion` back (to `previous` by default), reload the gateway, emit the event."""
    old, new, path = registry.rollback(cfg, target)
    if cfg.registry.user is not None:
        path = registry.checkpoint_dir(cfg, new, path)  # the gateway loads a user's adapter by path
    events.emit(events.POLICY_ROLLED_BACK, f"clawflow.policy.{registry.model_name(cfg)}.v{new}",
                {"from_version": old, "to_version": new})
    reloaded = reload_gateway(cfg, new, path)
    return {"from_version": old, "to_version": new, "path": path, "reloaded": reloaded is not None}


def provision(cfg: Config) -> tuple[int, str]:
    """First start: materialize the base model (a GGUF is converted once, ~40 s) and register it
    as the first version with alias `champion`, so rollback can return to it. Idempotent."""
    from clawflow.base_model import base_model_dir

    path = base_model_dir(cfg)
    return registry.ensure_base(cfg, path), path
