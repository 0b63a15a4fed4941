"""Agent-session bench: what a personal agent's user waits for, turn by turn, across hot reloads.

An OpenClaw-shaped request (bench/agent_prompt.py: a ~7.4k-token system prompt + the minimal tool
schemas, enveloped user messages, the whole history re-sent each turn), several sessions and turns,
a hot reload (`POST /admin/reload` to the default model's checkpoint, as after every training run)
between rounds. Two `clawflow serve` gateways on SmolLM2-135M-Instruct (configs/default.yaml), one
with re-warm on reload (`serving.rewarm_tokens` at its default) and one with it off (0: the swap
drops the prefix cache cold), get the same requests step by step, alternating which goes first.
Streamed, greedy, --max-tokens new tokens; a request's time is send → last chunk.

Printed per kind of turn (median, both gateways, and off/on): cold (first request ever), new
session (same system prompt and tools, other user), next turn (same session), after reload (the
active session's next turn, the first request after the swap), during reload (the active session's
next turn sent 1 s into a reload: with re-warm on it is served by the old version while the re-warm
gives way to it, issue 28's target <= 2.5 s; with it off the swap is done by then and the turn is the
cold first one), after reload, new session; the reload's own wall time (the re-warm delays it: the
difference is printed) and what it re-warmed (chunks, and how often it gave way to requests); which
version served each turn sent during a reload, and failures (target: none).

    .venv/bin/python bench/agent_session.py                 # ~7 min on 2 quiet cores
    .venv/bin/python bench/agent_session.py --reloads 3 --sessions 3 --turns 3 --during 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_prompt import QUESTIONS, build, wrap  # noqa: E402
from serving import ROOT, VENV_BIN, Server, free_port, model_dir, stop, wait_ready  # noqa: E402

MODEL = "smollm2-135m-instruct"
ADMIN = {"Authorization": "Bearer clawflow-admin"}  # configs/default.yaml's admin key


def start(model: str, tmp: Path, name: str, rewarm_tokens: int | None) -> Server:
    import subprocess

    port, home = free_port(), tmp / name
    home.mkdir(parents=True)
    raw = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    raw["home"] = str(home)
    raw["model"] = {"name": MODEL, "path": model}
    raw["serving"]["port"] = port
    if rewarm_tokens is not None:
        raw["serving"]["rewarm_tokens"] = rewarm_tokens
    (home / "config.yaml").write_text(yaml.safe_dump(raw))
    log = home / "serve.log"
    proc = subprocess.Popen([str(VENV_BIN / "clawflow"), "serve", "--config", str(home / "config.yaml")], cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}/healthz", proc, log)
    return Server(name, proc, f"http://127.0.0.1:{port}/v1", raw["serving"].get("api_key", "clawflow"), MODEL)


class Gateway:
    """One contender: its server, its sessions' histories, its timings per kind of turn."""

    def __init__(self, server: Server, system: str, tools: list[dict], max_tokens: int):
        from openai import OpenAI

        self.server, self.system, self.tools, self.max_tokens = server, system, tools, max_tokens
        self.url = server.base_url.removesuffix("/v1")
        self.client = OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=900)
        self.sessions: dict[str, list[dict]] = {}
        self.times: dict[str, list[float]] = {}
        self.reused: dict[str, list[float]] = {}  # prefix-cache tokens each timed turn reused
        self.reloads: list[dict] = []  # the timed reloads (nothing else runs meanwhile)
        self.during: list[tuple[float, str]] = []  # (seconds, version) of each turn sent during a reload
        self.during_reloads: list[dict] = []  # those reloads
        self.failures: list[str] = []
        self.replies: list[str] = []

    def turn(self, session: str, kind: str | None, stream: bool = True) -> tuple[float, str]:
        """One turn of `session`; (seconds, the policy version that served it when not streamed)."""
        msgs = self.sessions.setdefault(session, [{"role": "system", "content": self.system}])
        n = (len(msgs) - 1) // 2
        msgs.append({"role": "user", "content": wrap(QUESTIONS[(n + len(session)) % len(QUESTIONS)], n, session)})
        reused = self.metric("clawflow_prefix_cache_reused_tokens_total")
        t0, text, fp = time.perf_counter(), [], "?"
        try:
            out = self.client.chat.completions.create(model=MODEL, messages=msgs, tools=self.tools, stream=stream,
                                                      max_tokens=self.max_tokens, temperature=0)
            if not stream:  # streamed chunks do not carry the version
                text, fp = [out.choices[0].message.content or ""], out.system_fingerprint
            for c in out if stream else ():
                if c.choices and c.choices[0].delta.content:
                    text.append(c.choices[0].delta.content)
        except Exception as exc:  # counted, and the turn is left out of the history
            self.failures.append(f"{kind or 'during'}: {exc!r}")
            msgs.pop()
            return time.perf_counter() - t0, "failed"
        seconds = time.perf_counter() - t0
        msgs.append({"role": "assistant", "content": "".join(text)})
        self.replies.append("".join(text))
        if kind:
            self.times.setdefault(kind, []).append(seconds)
            self.reused.setdefault(kind, []).append(self.metric("clawflow_prefix_cache_reused_tokens_total") - reused)
        return seconds, fp

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def reload(self, path: str, during_session: str | None = None) -> None:
        """POST /admin/reload; with `during_session`, its next turn is sent a second into the reload,
        timed as "during reload", not streamed (the reply names the version that served it); such a
        reload is kept out of the timed reloads (the turn shares the machine with it)."""
        out: dict = {}

        def side():
            time.sleep(1.0)
            out["during"] = self.turn(during_session, "during reload", stream=False)

        t = threading.Thread(target=side)
        if during_session:
            t.start()
        t0 = time.perf_counter()
        r = httpx.post(f"{self.url}/admin/reload", json={"path": path}, timeout=900, headers=ADMIN)
        wall = time.perf_counter() - t0
        if during_session:
            t.join()
            self.during.append(out["during"])
        r.raise_for_status()
        (self.during_reloads if during_session else self.reloads).append({"wall": wall, **r.json()})


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(on: Gateway, off: Gateway, args, prompt_tokens: int) -> None:
    dtype = httpx.get(f"{on.url}/admin/policy", headers=ADMIN, timeout=60).json().get("dtype")
    print(f"\nAgent sessions on clawflow serve, SmolLM2-135M-Instruct {dtype} ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores, load average now {os.getloadavg()[0]:.1f}): system prompt + tools "
          f"{prompt_tokens} tokens, {args.max_tokens} new tokens, greedy, streamed; median seconds (n)")
    print(f"{'turn':<26} {'re-warm on':>14} {'re-warm off':>14} {'off / on':>9}   "
          "prefix-cache tokens reused (on / off)")
    for kind in ("cold", "new session", "next turn", "after reload", "during reload", "after reload, new session"):
        a, b = on.times.get(kind, []), off.times.get(kind, [])
        print(f"{kind:<26} {median(a):>9.2f} ({len(a):>2}) {median(b):>9.2f} ({len(b):>2}) "
              f"{median(b) / median(a):>8.2f}x   {median(on.reused.get(kind, [])):.0f} / "
              f"{median(off.reused.get(kind, [])):.0f}")
    ra, rb = [r["wall"] for r in on.reloads], [r["wall"] for r in off.reloads]
    print(f"{'reload (POST wall)':<26} {median(ra):>9.2f} ({len(ra):>2}) {median(rb):>9.2f} ({len(rb):>2})  "
          f"delay +{median(ra) - median(rb):.2f} s")
    for r in on.reloads + on.during_reloads:
        w = r.get("rewarm") or {}
        print(f"  re-warm v{r['version']}{' (a turn sent 1 s in)' if r in on.during_reloads else ''}: "
              f"{w.get('seconds')} s, {w.get('prefilled')} tokens prefilled in {w.get('chunks')} chunks, gave way "
              f"{w.get('yielded')} times, {w.get('prompts')} prompts ({w.get('tokens')} tokens) staged, "
              f"complete={w.get('complete')}; POST wall {r['wall']:.2f} s")
    for g in (on, off):
        d = ", ".join(f"{s:.2f} s on {fp}" for s, fp in g.during)
        print(f"turns sent 1 s into a reload, {g.server.name}: {d or '-'}; failed requests, all: "
              f"{len(g.failures)} {g.failures[:1]}")
    print(f"same replies on both: {on.replies == off.replies}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=2, help="sessions before the first reload")
    ap.add_argument("--turns", type=int, default=3, help="turns of each of those sessions")
    ap.add_argument("--reloads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=7400, help="system prompt + tool schemas")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--during", type=int, default=2,
                    help="reloads at the end, each with the active session's next turn sent 1 s into it")
    ap.add_argument("--no-during", dest="during", action="store_const", const=0, help="--during 0")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model = model_dir()
    system, tools, prompt_tokens = build(AutoTokenizer.from_pretrained(model), args.prompt_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    print(f"model {model}; load average {os.getloadavg()}; logs under {tmp}", flush=True)
    servers = [start(model, tmp, "re-warm on", None), start(model, tmp, "re-warm off", 0)]
    on, off = (Gateway(s, system, tools, args.max_tokens) for s in servers)
    step = [0]

    def both(fn) -> None:  # the same step on both gateways, alternating which goes first
        for g in ((on, off) if step[0] % 2 == 0 else (off, on)):
            fn(g)
        step[0] += 1

    try:
        both(lambda g: g.client.chat.completions.create(  # first forward's one-time costs: not the cache's
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2))
        both(lambda g: g.turn("s0", "cold"))
        for s in range(args.sessions):
            for t in range(args.turns):
                if s or t:
                    both(lambda g, s=s, t=t: g.turn(f"s{s}", "new session" if t == 0 else "next turn"))
        active = f"s{args.sessions - 1}"
        for r in range(args.reloads):
            both(lambda g: g.reload(model))
            both(lambda g: g.turn(active, "after reload"))
            both(lambda g, r=r: g.turn(f"r{r}", "after reload, new session"))
            both(lambda g, r=r: g.turn(f"r{r}", "next turn"))
            active = f"r{r}"  # the session used last
        for _ in range(args.during):  # the same session as the after-reload turns: the same kind of turn
            both(lambda g: g.reload(model, active))
        report(on, off, args, prompt_tokens)
    finally:
        for s in servers:
            stop(s)


if __name__ == "__main__":
    main()
