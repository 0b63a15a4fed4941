"""`clawflow connect openclaw`: point an agent's own config at the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

console = Console()


def register(app: typer.Typer, load, config_opt) -> None:
    """Add `connect …` to `app`; `load(config)` returns the Config or exits with a one-line error."""
    connect = typer.Typer(help="Point an agent at the gateway (writes the agent's own config).", no_args_is_help=True)
    app.add_typer(connect, name="connect")

    def _fail(message: str) -> None:
        console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
        raise typer.Exit(1)

    @connect.command()
    def openclaw(config_file: Optional[Path] = typer.Option(
                     None, "--config-file",
                     help="OpenClaw's config (default: where OpenClaw looks: $OPENCLAW_CONFIG_PATH, "
                          "else ~/.openclaw/openclaw.json)"),
                 context_window: Optional[int] = typer.Option(
                     None, "--context-window", min=1, help="the served model's window, when the gateway is not running"),
                 config: Optional[Path] = config_opt) -> None:
        """Add the gateway to OpenClaw as provider `clawflow` and make its model the default.

        Merged into the file: other settings kept, the old file backed up, a tools profile that fits
        the window."""
        import os

        from clawflow import openclaw as oc

        cfg = load(config)
        path = config_file.expanduser() if config_file else oc.default_path(os.environ)
        model, window = cfg.model.name, context_window
        if window is None:
            served = _served_model(cfg)
            if served is None:
                _fail(f"gateway at {cfg.gateway_url} is not running: start it (clawflow up) "
                      "or pass --context-window N")
            model, window = served
        s = oc.Served(f"{cfg.gateway_url}/v1", cfg.serving.api_key, model, window, cfg.serving.max_new_tokens)
        try:
            changes, backup = oc.connect(path, s)
        except oc.OpenClawConfigError as exc:
            _fail(f"{exc} (file left untouched)")
        except OSError as exc:
            _fail(f"cannot write {path}: {exc.strerror or exc}")
        if not changes:
            console.print(f"{escape(str(path))} already points at {s.base_url} (model {escape(model)}); unchanged",
                          soft_wrap=True, highlight=False)
            return
        for line in changes:
            console.print(f"  {escape(line)}", soft_wrap=True, highlight=False)
        kept = f"; previous file kept as {backup}" if backup else ""
        console.print(escape(f"wrote {path}{kept}"), soft_wrap=True, highlight=False)
        if window < oc.MINIMAL_PROMPT_TOKENS + cfg.serving.max_new_tokens:
            console.print(f"[yellow]warning:[/yellow] a {window}-token window is smaller than OpenClaw's minimal "
                          f"prompt (~{oc.MINIMAL_PROMPT_TOKENS} tokens) plus a reply: expect context overflows",
                          soft_wrap=True, highlight=False)
        console.print(f"try it: openclaw agent --local --session-id demo -m 'Hello' "
                      f"(model clawflow/{escape(model)}, window {window} enforced by the gateway)",
                      soft_wrap=True, highlight=False)


def _served_model(cfg) -> tuple[str, int] | None:
    """(model id, context length) from the gateway's /v1/models; None when it does not answer."""
    import httpx

    try:
        r = httpx.get(f"{cfg.gateway_url}/v1/models", timeout=5,
                      headers={"Authorization": f"Bearer {cfg.serving.api_key}"})
        model = r.json()["data"][0]
        return str(model["id"]), int(model["context_length"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
