"""`clawflow` command line: up, down, status, serve.

Training runs through Prefect (`prefect deployment run train-on-new-feedback/train-on-new-feedback`)
or in-process with `python -m flows.train_on_new_feedback`; the library never imports flows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clawflow.config import ConfigError, load_config

app = typer.Typer(help="Continual learning for chat agents: record, judge, train, register, hot-reload.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config (default: $CLAWFLOW_CONFIG or configs/default.yaml)")


def _cfg(config: Optional[Path]):
    try:
        return load_config(config)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)  # one line, path verbatim
        raise typer.Exit(2) from None


@app.command()
def serve(config: Optional[Path] = ConfigOpt, port: Optional[int] = typer.Option(None, help="override serving.port"),
          host: Optional[str] = typer.Option(None, help="override serving.host")) -> None:
    """Run the gateway alone in the foreground (stops cleanly on SIGTERM / Ctrl-C)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from clawflow.serving.server import serve as run

    run(_cfg(config), host=host, port=port)


@app.command()
def up(config: Optional[Path] = ConfigOpt) -> None:
    """Start Prefect, MLflow, the worker, the deployments and the gateway in the background."""
    from clawflow import stack

    cfg = _cfg(config)
    try:
        stack.up(cfg, echo=console.print)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print("stack is up; stop it with [bold]clawflow down[/bold] (or make down)")


@app.command()
def down(config: Optional[Path] = ConfigOpt) -> None:
    """Stop everything `up` started (the gateway seals its pending turns first)."""
    from clawflow import stack

    stack.down(_cfg(config), echo=console.print)


@app.command()
def status(config: Optional[Path] = ConfigOpt) -> None:
    """Served version, shards and turns pending, last training."""
    import httpx

    from clawflow.store.catalog import Catalog

    cfg = _cfg(config)
    table = Table(show_header=False)
    try:
        r = httpx.get(f"{cfg.gateway_url}/admin/policy", timeout=3,
                      headers={"Authorization": f"Bearer {cfg.serving.admin_key}"})
        served = f"v{r.json()['version']} ({r.json()['path']})" if r.status_code == 200 else f"HTTP {r.status_code}"
    except httpx.HTTPError:
        served = "gateway not running"
    table.add_row("gateway", cfg.gateway_url)
    table.add_row("served policy", served)
    try:
        stats = Catalog(cfg.home / "catalog.duckdb", cfg.home / "shards").stats()
        table.add_row("shards", str(stats["shards"]))
        table.add_row("turns (consumed)", f"{stats['turns']} ({stats['consumed']})")
        table.add_row("turns pending training", str(stats["pending"]))
        last = stats.get("last_run")
        table.add_row("last training", f"{last['run_id']} → v{last['policy_version']} at {last['finished_at']}"
                      if last else "none yet")
    except Exception as exc:  # e.g. the catalog is locked by a running training
        table.add_row("catalog", f"unavailable: {exc.__class__.__name__}: {str(exc)[:120]}")
    console.print(table)


from clawflow import cli_policy  # noqa: E402 - registers train, versions, compare, rollback, chat

cli_policy.register(app, _cfg, ConfigOpt)

if __name__ == "__main__":
    app()
