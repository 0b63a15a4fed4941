"""`clawflow` commands about policies: train, versions, compare, rollback, chat."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def register(app: typer.Typer, load, config_opt) -> None:
    """Add the commands to `app`; `load(config)` returns the Config or exits with a one-line error."""

    def _fail(message: str) -> None:
        console.print(f"[red]error:[/red] {message}", markup=True, highlight=False)
        raise typer.Exit(1)

    user_opt = typer.Option(None, "--user", "-u", help="a user's own adapters (default: the shared policy)")

    def _user(name: str | None) -> str | None:
        import re

        from clawflow.users import NAME_PATTERN

        if name is not None and not re.fullmatch(NAME_PATTERN, name):
            _fail(f"user name {name!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
        return name

    @app.command()
    def train(config: Optional[Path] = config_opt,
              wait: bool = typer.Option(True, "--wait/--no-wait", help="follow the run until it ends")) -> None:
        """Start a train-on-new-feedback run now (through the Prefect deployment) and follow it."""
        import httpx

        from clawflow.local_stack import service_env

        cfg = load(config)
        api = service_env(cfg)["PREFECT_API_URL"]
        try:
            dep = httpx.get(f"{api}/deployments/name/train-on-new-feedback/train-on-new-feedback", timeout=10)
            if dep.status_code == 404:
                _fail("deployment train-on-new-feedback is not deployed (run `clawflow up`)")
            dep.raise_for_status()
            run = httpx.post(f"{api}/deployments/{dep.json()['id']}/create_flow_run", json={}, timeout=10).json()
        except httpx.HTTPError as exc:
            _fail(f"Prefect API at {api} not reachable ({exc.__class__.__name__}); is the stack up?")
        ui = api.removesuffix("/api")
        console.print(f"flow run {run['name']} scheduled: {ui}/runs/flow-run/{run['id']}")
        if wait:
            follow_run(api, run["id"])

    def follow_run(api: str, run_id: str) -> None:
        """A progress bar (the run's training-progress artifact) and a line per finished task."""
        import httpx
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from clawflow import cli_watch

        printed: set[str] = set()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("waiting for a worker", total=100)

            def show(snap: cli_watch.Snapshot) -> None:
                for name, state in snap.tasks:
                    if state in ("Completed", "Failed", "Crashed", "Cached") and name not in printed:
                        printed.add(name)
                        mark = "[green]✓[/green]" if state in ("Completed", "Cached") else "[red]✗[/red]"
                        bar.console.print(f"{mark} {name} {state.lower()}")
                running = [n for n, st in snap.tasks if st in ("Running", "Retrying", "AwaitingRetry")]
                what = snap.phase or snap.state_name
                bar.update(task, completed=snap.percent or 0,
                           description=f"{snap.state_name}: {what}" + (f" ({running[-1]})" if running else ""))

            try:
                final = cli_watch.follow(api, run_id, show)
            except httpx.HTTPError as exc:
                _fail(f"lost the Prefect API while following the run ({exc.__class__.__name__})")
        if final.state_type != "COMPLETED":
            _fail(f"run {final.name} ended {final.state_name}: {final.message or 'see the Prefect UI'}")
        console.print(f"run {final.name} completed: {final.phase or ''}")

    @app.command()
    def versions(config: Optional[Path] = config_opt,
                 wide: bool = typer.Option(False, "--wide", "-w", help="also list the checkpoint paths"),
                 user: Optional[str] = user_opt) -> None:
        """Registered versions with aliases, gate verdicts and training metrics (fits 80 columns;
        --wide adds the checkpoint paths). --user: that user's own adapters."""
        from clawflow.policy import registry

        cfg = registry.for_user(load(config), _user(user))
        rows = registry.list_versions(cfg)
        if user and not rows:
            console.print(f"{user} has no adapter of their own yet: they are served the shared policy")
        console.print(version_table(rows))
        if wide:  # whole lines, not a table column: a path folded into a cell cannot be copied
            for v in rows:
                console.print(f"v{v['version']}  {v['source']}", soft_wrap=True, highlight=False, markup=False)

    @app.command()
    def compare(a: str, b: str, config: Optional[Path] = config_opt) -> None:
        """Versions A and B (numbers or aliases) on the probe set: drift both ways on the fixed
        prompts, and the log-likelihood margin of B over A on recent held-out judged turns."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from clawflow.policy import registry
        from clawflow.policy.gate import drift, judged_probe, load_pair, nonfinite_tensors
        from clawflow.policy.holdout import held_out_turns
        from clawflow.store.catalog import Catalog

        cfg = load(config)
        try:
            (va, pa), (vb, pb) = registry.resolve(cfg, a), registry.resolve(cfg, b)
        except LookupError as exc:
            _fail(str(exc))
        g = cfg.gate
        try:
            judged = held_out_turns(Catalog.for_config(cfg), g.judged_probes, [], g.holdout_fraction)
        except Exception as exc:  # noqa: BLE001 - no store / a locked catalog: compare on the prompts alone
            console.print(f"[yellow]held-out turns unavailable[/yellow] ({exc.__class__.__name__}); prompts only")
            judged = []
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("loading both models", total=2 * len(g.probes) + 2 * len(judged))
            step = lambda: bar.advance(task)  # noqa: E731
            tok, ma, mb = load_pair(pa, pb)
            bar.update(task, description=f"v{va} → v{vb} on {len(g.probes)} prompts")
            ab = drift(tok, ma, mb, g.probes, g.max_new_tokens, step)
            bar.update(task, description=f"v{vb} → v{va} on {len(g.probes)} prompts")
            ba = drift(tok, mb, ma, g.probes, g.max_new_tokens, step)
            bar.update(task, description=f"{len(judged)} held-out judged turns")
            margins = judged_probe(tok, ma, mb, judged, g.max_probe_tokens, step)
        table = Table("", f"v{va} → v{vb}", f"v{vb} → v{va}")
        for key in ab:
            table.add_row(key, f"{ab[key]:.4f}", f"{ba[key]:.4f}")
        table.add_row("non-finite tensors", str(len(nonfinite_tensors(pa))), str(len(nonfinite_tensors(pb))))
        for key, value in margins.items():  # B − A; the reverse is the negation
            table.add_row(key, f"{value:+.4f}" if key.endswith("delta") else f"{value:.0f}",
                          f"{-value:+.4f}" if key.endswith("delta") else f"{value:.0f}")
        console.print(table)

    @app.command()
    def rollback(version: Optional[str] = typer.Argument(None, help="version or alias (default: previous)"),
                 config: Optional[Path] = config_opt, user: Optional[str] = user_opt) -> None:
        """Move `champion` back to VERSION (default: `previous`) and hot-reload the gateway.
        --user: that user's own adapters (only their requests move)."""
        from clawflow.local_stack import adopt_prefect_api
        from clawflow.policy import registry, reload

        cfg = registry.for_user(load(config), _user(user))
        adopt_prefect_api(cfg)  # so clawflow.policy.rolled-back reaches the stack's Prefect
        try:
            result = reload.rollback(cfg, int(version) if version and version.isdigit() else version)
        except (LookupError, reload.GatewayRefused) as exc:
            _fail(str(exc))
        note = "gateway reloaded" if result["reloaded"] else "gateway not running: it starts on the new champion"
        console.print(f"champion v{result['from_version']} → v{result['to_version']} ({note})")

    @app.command()
    def chat(config: Optional[Path] = config_opt, session: Optional[str] = None) -> None:
        """Talk to the gateway in the terminal (/new starts over, /quit leaves). Your replies are the
        feedback the next training learns from."""
        from openai import APIConnectionError, OpenAI

        cfg = load(config)
        client = OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=cfg.serving.api_key)
        headers = {"X-Session-Id": session} if session else None
        history: list[dict] = []
        while True:
            try:
                text = console.input("[bold green]you>[/bold green] ").strip()
            except (EOFError, KeyboardInterrupt):
                break
            if text in ("/quit", "/exit"):
                break
            if text == "/new" or not text:
                history = [] if text == "/new" else history
                continue
            history.append({"role": "user", "content": text})
            reply = ""
            try:
                stream = client.chat.completions.create(model=cfg.model.name, messages=history, stream=True,
                                                        extra_headers=headers)
                console.print("[bold blue]bot>[/bold blue] ", end="")
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        reply += chunk.choices[0].delta.content
                        console.print(chunk.choices[0].delta.content, end="", markup=False, highlight=False)
                console.print()
            except APIConnectionError:
                _fail(f"gateway at {cfg.gateway_url} is not running (clawflow up)")
            history.append({"role": "assistant", "content": reply})


def version_table(rows: list[dict]) -> Table:
    """`clawflow versions`: one line per version in 80 columns (local time as MM-DD HH:MM; a date
    of another year as YYYY-MM-DD): the gate's verdict, the dose it promoted (or `none`), the key
    facts rate and the preference measure at that dose, turns and loss. Every dose's figures are in
    the version's `doses` tag and its MLflow run."""
    table = Table()
    for name in ("ver", "aliases", "created", "gate", "dose", "facts", "pref", "turns", "loss"):
        table.add_column(name, no_wrap=True)  # a date or a number split over two lines is unreadable
    this_year = dt.datetime.now().year
    for v in rows:
        created = dt.datetime.fromtimestamp(v["created"] / 1000)
        when = created.strftime("%m-%d %H:%M" if created.year == this_year else "%Y-%m-%d")
        loss, tags = v["metrics"].get("loss"), v["tags"]
        table.add_row(str(v["version"]), ",".join(v["aliases"]), when, tags.get("gate", ""), tags.get("dose", ""),
                      _short(tags.get("eval.help_facts_rate")), _short(tags.get("eval.pref_gain"), signed=True),
                      tags.get("turns", ""), f"{loss:.3g}" if loss is not None else "")
    return table


def _short(value: str | None, signed: bool = False) -> str:
    if value is None:
        return ""
    try:
        return f"{float(value):+.3f}" if signed else f"{float(value):.3f}"
    except ValueError:
        return value
