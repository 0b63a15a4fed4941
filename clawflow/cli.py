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
    from clawflow import local_stack

    cfg = _cfg(config)
    try:
        local_stack.check_ports(cfg)
        _provision(cfg)
        local_stack.up(cfg, echo=console.print)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print("stack is up; stop it with [bold]clawflow down[/bold] (or make down)")


def _provision(cfg) -> None:
    """The base model on disk and registered as the first version, with a progress display (the
    first start converts the GGUF: about a minute; later starts take seconds)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from clawflow.policy import reload

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(f"base model {cfg.model.name} (the first start converts it, ~1 min)", total=None)
        version, path = reload.provision(cfg)
        bar.update(task, total=1, completed=1, description=f"base model ready: {path}")
    console.print(f"base model registered as v{version} (`clawflow rollback {version}` returns to it)")


@app.command()
def down(config: Optional[Path] = ConfigOpt) -> None:
    """Stop everything `up` started (the gateway seals its pending turns first)."""
    from clawflow import local_stack

    local_stack.down(_cfg(config), echo=console.print)


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
    if cfg.store.root:  # shared storage: where the shards go, and what this host has not uploaded yet
        from clawflow.store.outbox import waiting

        table.add_row("store", f"{escape(cfg.store.root)} ({waiting(cfg.home)} sealed shards waiting to upload)")
    try:
        stats = Catalog.for_config(cfg).stats()  # shards wherever store.root puts them
        table.add_row("shards", str(stats["shards"]))
        table.add_row("turns (consumed)", f"{stats['turns']} ({stats['consumed']})")
        table.add_row("turns pending training", str(stats["pending"]))
        last = stats.get("last_run")
        table.add_row("last training", f"{last['run_id']} → v{last['policy_version']} at {last['finished_at']}"
                      if last else "none yet")
    except Exception as exc:  # e.g. the catalog is locked by a running training
        table.add_row("catalog", f"unavailable: {exc.__class__.__name__}: {str(exc)[:120]}")
    console.print(table)


@app.command()
def export(out: Path = typer.Argument(..., help="file to write (.parquet or .jsonl)"),
           session: Optional[list[str]] = typer.Option(None, "--session", "-s", help="a session id (repeatable)"),
           all_sessions: bool = typer.Option(False, "--all", help="every session"),
           fmt: Optional[str] = typer.Option(None, "--format", help="parquet | jsonl (default: from the suffix)"),
           user: Optional[str] = typer.Option(None, "--user", "-u", help="only this user's turns"),
           config: Optional[Path] = ConfigOpt) -> None:
    """Export the sealed turns of chosen sessions (DuckDB, pandas and polars read the Parquet);
    --user: only that user's (with --all: every turn of theirs)."""
    import duckdb

    from clawflow.store.catalog import Catalog
    from clawflow.store.privacy import export_sessions

    cfg = _cfg(config)
    if not session and not all_sessions:
        console.print("[red]error:[/red] name sessions with --session ID (repeatable) or pass --all")
        raise typer.Exit(2)
    try:
        n = export_sessions(Catalog.for_config(cfg), out, None if all_sessions else session, fmt, user)
    except (ValueError, OSError, duckdb.Error) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2 if isinstance(exc, ValueError) else 1) from None
    console.print(f"exported {n} turns to {escape(str(out))}", soft_wrap=True)


@app.command()
def forget(session: Optional[str] = typer.Argument(None, help="the session id to remove"),
           user: Optional[str] = typer.Option(None, "--user", "-u", help="instead: every turn of this user, their "
                                              "standing preferences and their own adapter versions"),
           yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
           config: Optional[Path] = ConfigOpt) -> None:
    """Remove a session's turns everywhere: shards, WAL, catalog, judgments, training samples (--user:
    all of a user's, and their preferences and adapter versions)."""
    import duckdb

    from clawflow.prefs.store import PreferenceStore
    from clawflow.store.catalog import Catalog
    from clawflow.store.privacy import forget_session, forget_user

    if (session is None) == (user is None):
        console.print("[red]error:[/red] name a SESSION, or a user with --user NAME (not both)")
        raise typer.Exit(2)
    cfg = _cfg(config)
    what = f"every turn, preference and adapter version of user {user!r}" if user else \
        f"every turn of session {session!r}"
    if not yes and not typer.confirm(f"Permanently remove {what}?"):
        raise typer.Exit(1)
    try:
        r = forget_user(Catalog.for_config(cfg), user) if user else forget_session(Catalog.for_config(cfg), session)
        prefs = PreferenceStore.for_config(cfg)
        dropped = prefs.forget_user(user) if user else prefs.forget_session(session)
    except (OSError, duckdb.Error) as exc:  # e.g. the catalog stayed locked by a running training
        console.print(f"[red]error:[/red] {escape(f'{exc.__class__.__name__}: {exc}')}", soft_wrap=True)
        raise typer.Exit(1) from None
    gone = f"forgot {'user ' + user if user else 'session'}: {r.turns} turns from {r.shards} shards, " \
           f"{r.wal_records} unsealed turns, {r.judgments} judgments, {r.samples} training samples, " \
           f"{r.catalog_rows} catalog rows, {len(dropped)} standing preferences"
    if user:
        gone += ", " + _forget_adapters(cfg, user)
    else:
        gone += " that came only from it" + (f" ({', '.join(dropped)})" if dropped else "")
    console.print(escape(gone), soft_wrap=True)


def _forget_adapters(cfg, user: str) -> str:
    """A forgotten user's own adapter versions: out of the gateway, the registry and the disk."""
    from clawflow.policy import registry, reload

    if user == cfg.serving.user:
        return "their versions are the shared policy's and stay (roll them back with `clawflow rollback`)"
    try:
        reload.unload_user_adapter(cfg, user)  # no gateway running: it loads no adapter for a deleted line
    except reload.GatewayRefused as exc:
        console.print(f"[yellow]warning:[/yellow] {escape(str(exc))}; restart the gateway", soft_wrap=True)
    deleted = registry.delete_line(registry.for_user(cfg, user))
    return f"{len(deleted)} adapter versions"


prefs_app = typer.Typer(help="Standing preferences: what users asked for, distilled by every training run.",
                        invoke_without_command=True)
app.add_typer(prefs_app, name="prefs")


@prefs_app.callback()
def prefs(ctx: typer.Context, user: Optional[str] = typer.Option(None, "--user", help="one user's (default: all)"),
          all_: bool = typer.Option(False, "--all", help="also superseded ones"),
          config: Optional[Path] = ConfigOpt) -> None:
    """List standing preferences, strongest first, with the sessions they came from."""
    if ctx.invoked_subcommand is not None:
        return
    from clawflow.prefs.record import ACTIVE, ranked
    from clawflow.prefs.store import PreferenceStore

    cfg = _cfg(config)
    every = PreferenceStore.for_config(cfg).load()
    rows = ranked(every, user) + ([p for p in every if p.status != ACTIVE and (user is None or p.user == user)]
                                  if all_ else [])
    if not rows:
        console.print("no standing preferences" + (f" for {user}" if user else ""))
        return
    table = Table()
    for name in ("id", "user", "preference", "kind", "strength", "status", "sessions"):
        table.add_column(name, overflow="fold", no_wrap=name in ("id", "strength"))
    for p in rows:
        table.add_row(p.pref_id, p.user, escape(p.text), f"{p.axis}/{p.pole}".rstrip("/"),
                      f"{p.strength:.2f}" if p.strength is not None else "-",
                      p.status + (f" by {p.superseded_by}" if p.superseded_by else ""), ", ".join(p.sessions))
    console.print(table)


@prefs_app.command("forget")
def prefs_forget(pref_id: str = typer.Argument(..., help="the preference id (`clawflow prefs` lists them)"),
                 config: Optional[Path] = ConfigOpt) -> None:
    """Drop a standing preference: the next version is trained without it (from the base, when the
    champion had learned it)."""
    from clawflow.prefs.store import PreferenceStore

    gone = PreferenceStore.for_config(_cfg(config)).forget(pref_id)
    if gone is None:
        console.print(f"[red]error:[/red] no standing preference {escape(pref_id)!s} (see `clawflow prefs`)")
        raise typer.Exit(2)
    console.print(f"forgot {gone.pref_id} ({escape(gone.text)}); the next version is trained without it")


@app.command("judge-eval")
def judge_eval(file: Path = typer.Argument(..., help="labelled JSONL (format: configs/judge/README.md)"),
               judge: Optional[str] = typer.Option(None, "--judge", help="embedded | llm | rules | auto (default: config)"),
               split: str = typer.Option("all", "--split", help="all | train | test (fixed split by item id)"),
               mistakes: bool = typer.Option(False, "--mistakes", help="list the items judged wrong"),
               config: Optional[Path] = ConfigOpt) -> None:
    """Score a labelled set with a judge: confusion matrix, hint rate, `accuracy: …` last."""
    from clawflow.judge.evaluate import run_eval

    cfg = _cfg(config)
    try:
        typer.echo(run_eval(cfg, file, judge, split, mistakes))
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None


from clawflow import cli_policy  # noqa: E402 - registers train, versions, compare, rollback, chat

cli_policy.register(app, _cfg, ConfigOpt)

from clawflow import cli_connect  # noqa: E402 - registers connect openclaw

cli_connect.register(app, _cfg, ConfigOpt)

from clawflow import cli_users  # noqa: E402 - registers users add, list, remove

cli_users.register(app, _cfg, ConfigOpt)

if __name__ == "__main__":
    app()
