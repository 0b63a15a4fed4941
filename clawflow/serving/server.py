"""Build the gateway from config and run it with uvicorn (`clawflow serve`).

Starts on the registry's `champion` when there is one, else on the base model (version 0). Stops
cleanly on SIGTERM: uvicorn finishes in-flight requests, then the lifespan hook seals every
acknowledged turn into a Parquet shard.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from clawflow.base_model import base_model_dir
from clawflow.config import Config
from clawflow.home import Home

log = logging.getLogger("clawflow.server")


def _no_registry_yet(cfg: Config) -> bool:
    """A local registry file that does not exist yet: skip MLflow's table creation (seconds)."""
    uri = cfg.tracking_uri
    return uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists()


def initial_policy(cfg: Config) -> tuple[int, str]:
    from clawflow.policy import registry

    if _no_registry_yet(cfg):
        return 0, base_model_dir(cfg)
    try:
        found = registry.champion(cfg)
        found = (found[0], registry.checkpoint_dir(cfg, *found)) if found else None  # fetched if remote
    except Exception as exc:  # a registry that cannot be read must not keep users from being served
        log.warning("registry unavailable (%s); serving the base model", exc)
        found = None
    return found if found else (0, base_model_dir(cfg))


def build_app(cfg: Config):
    from clawflow.serving.app import create_app
    from clawflow.serving.engine import TorchEngine
    from clawflow.serving.gateway import Gateway
    from clawflow.store.sealer import open_store

    version, path = initial_policy(cfg)
    s = cfg.serving
    if s.engine == "sglang":  # SGLang serves the weights at `path` itself (launched with them)
        from clawflow.serving.sglang import SGLangEngine

        engine = SGLangEngine(s.sglang_url, path, version=version, max_batch=s.max_concurrency, max_queue=s.max_queue)
    else:
        engine = TorchEngine(path, version=version, dtype=serving_dtype(cfg, path), threads=s.threads,
                             max_batch=s.max_concurrency, max_queue=s.max_queue,
                             prefix_cache_tokens=s.prefix_cache_tokens,
                             prefix_cache_min_tokens=s.prefix_cache_min_tokens,
                             rewarm_tokens=s.rewarm_tokens, rewarm_max_s=s.rewarm_max_s,
                             rewarm_min_tokens=s.rewarm_min_tokens,
                             max_loaded_adapters=s.max_loaded_adapters,
                             prefill_chunk_tokens=s.prefill_chunk_tokens, linear_kernel=s.linear_kernel)
    load_users_adapters(cfg, engine)
    writer, sealer = open_store(cfg.home, cfg.store)
    gw = Gateway(cfg=cfg, engine=engine, writer=writer, sealer=sealer)
    log.info("serving %s v%s from %s", cfg.model.name, version, path)
    return create_app(gw, resolve=lambda ref: _resolve_local(cfg, ref))


def load_users_adapters(cfg: Config, engine) -> dict[str, int]:
    """Every user's own champion adapter (their registry line, issue #29), so a restarted gateway
    serves each user what it served them; one that cannot be loaded is logged and that user gets
    the shared policy. Returns {user: version} of those loaded."""
    from clawflow.policy import registry

    if _no_registry_yet(cfg):
        return {}
    loaded = {}
    for user in registry.user_lines(cfg):
        mine = registry.for_user(cfg, user)
        try:
            found = registry.champion(mine)
            if found is None:
                continue
            engine.load_user_adapter(user, registry.checkpoint_dir(mine, *found), found[0])
            loaded[user] = found[0]
        except Exception as exc:  # noqa: BLE001 - one user's adapter never keeps the gateway down
            log.warning("%s's adapter was not loaded (%s); they are served the shared policy", user, exc)
    if loaded:
        log.info("users' own adapters: %s", ", ".join(f"{u} v{v}" for u, v in loaded.items()))
    return loaded


def serving_dtype(cfg: Config, path: str) -> str:
    """`serving.dtype`, with auto settled by the start-up probe on the model's own matmul shapes."""
    from clawflow.serving.dtype_probe import choose

    if cfg.serving.dtype == "auto" and "dtype" in cfg.model.model_fields_set:
        return cfg.model.dtype  # set explicitly in the config: not second-guessed
    if cfg.serving.dtype != "auto":
        return cfg.serving.dtype
    import torch

    if cfg.serving.threads:  # measured on the threads it will serve with
        torch.set_num_threads(cfg.serving.threads)
    return choose("auto", path)[0]


def _resolve_local(cfg: Config, ref: int | str) -> tuple[int, str]:
    """A registry version as a local directory; a download that fails its checksum is a refused
    reload (the old weights keep serving)."""
    from clawflow.artifacts import ChecksumError
    from clawflow.policy import registry
    from clawflow.serving.generation import ReloadError

    try:
        return registry.resolve_local(cfg, ref)
    except ChecksumError as exc:
        raise ReloadError(str(exc)) from exc


def serve(cfg: Config, host: str | None = None, port: int | None = None) -> None:
    import uvicorn

    from clawflow.policy import warm

    app = build_app(cfg)
    warm.start(cfg)  # the gate's references of the base, measured while the gateway serves
    run_dir = Home(cfg.home).run
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "gateway.pid").write_text(str(os.getpid()))  # `clawflow down` stops it with SIGTERM
    uvicorn.run(app, host=host or cfg.serving.host, port=port or cfg.serving.port, log_level="info")
