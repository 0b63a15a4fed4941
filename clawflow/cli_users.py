"""`clawflow users add | list | remove`: who may talk to the gateway (clawflow/users.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clawflow.users import UserError, UserFile

console = Console()


def _when(iso: str) -> str:
    return iso[:16].replace("T", " ")  # minutes, UTC: fits a narrow terminal


def register(app: typer.Typer, load, config_opt) -> None:
    """Add `users …` to `app`; `load(config)` returns the Config or exits with a one-line error."""
    users = typer.Typer(help="Users: each owns an API key, and the turns it sends are recorded as theirs.",
                        no_args_is_help=True)
    app.add_typer(users, name="users")

    def _fail(exc: Exception) -> None:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)

    @users.command()
    def add(name: str = typer.Argument(..., help="1-64 characters of A-Z a-z 0-9 _ . -"),
            config: Optional[Path] = config_opt) -> None:
        """Create a user and print their new API key, once (only its SHA-256 is kept)."""
        cfg = load(config)
        try:
            key = UserFile(cfg.home).add(name, taken={cfg.serving.user, *cfg.serving.users})
        except (UserError, OSError) as exc:
            _fail(exc)
        console.print(f"added user {escape(name)}; their API key, shown only this once (keep it, it cannot be "
                      "shown again):", soft_wrap=True, highlight=False)
        typer.echo(key)  # plain, on a line of its own, for scripts

    @users.command("list")
    def list_(config: Optional[Path] = config_opt) -> None:
        """Every user: where their key is configured, when they were added, whether removed (never keys)."""
        cfg = load(config)
        try:
            stored = UserFile(cfg.home).load()
        except (ValueError, TypeError, KeyError, OSError) as exc:
            _fail(exc)
        table = Table()
        for col in ("user", "key in", "created", "status"):
            table.add_column(col)
        table.add_row(cfg.serving.user, "serving.api_key", "-", "active")
        for name in cfg.serving.users:
            table.add_row(name, "serving.users", "-", "active")
        for u in stored:
            status = f"removed {_when(u.deleted_at)}" if u.deleted_at else "active"
            table.add_row(u.name, "users file", _when(u.created_at), status)
        console.print(table)

    @users.command()
    def remove(name: str = typer.Argument(..., help="the user (`clawflow users list`)"),
               config: Optional[Path] = config_opt) -> None:
        """Remove a user: their key stops working at once; their recorded data stays."""
        cfg = load(config)
        if name == cfg.serving.user or name in cfg.serving.users:
            where = "serving.api_key" if name == cfg.serving.user else "serving.users"
            _fail(UserError(f"{name} owns a key set in the config ({where}); change it there"))
        try:
            gone = UserFile(cfg.home).remove(name)
        except (UserError, OSError) as exc:
            _fail(exc)
        state = "removed" if gone else "was already removed"
        console.print(f"user {escape(name)} {state}: their key is refused from now on. Their recorded turns stay "
                      "until you remove them with `clawflow forget --user NAME`.",
                      soft_wrap=True, highlight=False)
