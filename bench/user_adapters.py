"""Users' own adapters through the gateway (issue #29): N closed-loop streaming clients spread over N
users, each user with a LoRA adapter of their own, against the same N clients on the shared policy
alone, in one run, on one clawflow gateway (SmolLM2-135M, the shipped serving config).

    PYTHONPATH=. .venv/bin/python bench/user_adapters.py --adapters 8 32 --seconds 20 --rounds 2

- `shared`: every client sends the default key: every row decodes on the shared policy (the base);
- `adapters`: client k sends user k's key: every row decodes on its own adapter, grouped in one
  batch (clawflow/serving/multi_lora.py);
- `reloads` (with --reload-every S): as `adapters`, while user 0's adapter is replaced by a new
  version every S seconds (`POST /admin/users/user0/adapter`): the other users' throughput during
  one user's reloads (the issue's target: slowed by at most 10 %).
The modes alternate (shared first in even rounds), with the same prompts drawn from one counter
(bench/serving.py's distinct prompts: no prompt twice, so no prefix-cache favour). Reported as
tokens/s and the ratio adapters / shared (the issue's target: >= 0.8 at 8 users). Adapters are r
--rank on the projections users' adapters train as shipped, with random A and B (bench/multi_lora.py `make_adapters`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from multi_lora import TARGETS, make_adapters  # noqa: E402
from serving import PROMPTS, Draw, Server, measure, model_dir, start_clawflow, stop, wait_idle  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapters", type=int, nargs="+", default=[8, 32], help="users (and clients) per run")
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window per run")
    ap.add_argument("--max-warmup", type=float, default=90.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reload-every", type=float, default=0.0, help="seconds between user 0's reloads (0: no reloads mode)")
    ap.add_argument("--threads", type=int, default=None, help="the gateway's serving.threads (default: the shipped config's)")
    args = ap.parse_args()

    model = model_dir()
    tmp = Path(tempfile.mkdtemp(prefix="bench-user-adapters-"))
    n = max(args.adapters)
    paths = make_adapters(model, n, args.rank, tmp / "adapters")
    keys = {f"user{i}": f"bench-key-{i}" for i in range(n)}
    threads = args.threads
    server = start_clawflow(model, tmp, users={u: hashlib.sha256(k.encode()).hexdigest() for u, k in keys.items()},
                            threads=threads)
    admin = {"Authorization": "Bearer clawflow-admin"}
    root = server.base_url.removesuffix("/v1")
    try:
        for i, (user, path) in enumerate(zip(keys, paths)):
            r = httpx.post(f"{root}/admin/users/{user}/adapter", json={"path": str(path), "version": i + 1},
                           headers=admin, timeout=120)
            r.raise_for_status()
        print(f"SmolLM2-135M, {os.cpu_count()} cores, serving.threads {threads}, {n} users' adapters loaded "
              f"(r {args.rank} on {', '.join(TARGETS)}); "
              f"{args.seconds:g} s windows, {args.rounds} rounds, max_tokens {args.max_tokens}")
        draw = Draw(len(PROMPTS))
        rows = []
        for clients in args.adapters:
            users = list(keys.values())[:clients]
            modes = {"shared": server, "adapters": Server(server.name, server.proc, server.base_url,
                                                            server.api_key, server.model, keys=users)}
            order = ["shared", "adapters"] + (["reloads"] if args.reload_every > 0 else [])
            got: dict[str, list[float]] = {name: [] for name in order}
            reloads: list[float] = []
            for rnd in range(args.rounds):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    wait_idle(server.proc.pid)
                    stop_reloads = threading.Event()
                    worker = threading.Thread(target=reload_loop, args=(root, admin, paths[:2], args.reload_every,
                                                                        stop_reloads, reloads))
                    if name == "reloads":
                        worker.start()
                    res = asyncio.run(measure(modes["adapters" if name == "reloads" else name], clients,
                                              args.seconds, args.max_warmup, args.max_tokens, draw))
                    stop_reloads.set()
                    if name == "reloads":
                        worker.join()
                    got[name].append(res.tok_s)
                    print(f"  {clients:>3} clients, {name:>8}: {res.tok_s:7.1f} tok/s (load {res.load:.2f}, "
                          f"other processes {res.other_cpu:.0%} of the CPU)", flush=True)
            rows.append((clients, {k: statistics.mean(v) for k, v in got.items()}))
        print(f"\n{'clients = users':>16} {'shared tok/s':>13} {'own adapters tok/s':>19} {'ratio':>6}"
              + (f" {'with reloads tok/s':>19} {'vs no reloads':>14}" if args.reload_every > 0 else ""))
        for clients, m in rows:
            line = f"{clients:>16} {m['shared']:>13.1f} {m['adapters']:>19.1f} {m['adapters'] / m['shared']:>6.2f}"
            if "reloads" in m:
                line += f" {m['reloads']:>19.1f} {m['reloads'] / m['adapters']:>14.2f}"
            print(line)
        if reloads:
            print(f"user 0's reloads: {len(reloads)}, median {statistics.median(reloads):.3f} s, "
                  f"max {max(reloads):.3f} s (the admin route's answer time)")
    finally:
        stop(server)


def reload_loop(root: str, admin: dict, paths: list[Path], every: float, stop: threading.Event,
                out: list[float]) -> None:
    """User 0's adapter replaced by the next version every `every` seconds until `stop`."""
    version = 1000
    while not stop.wait(every):
        version += 1
        t0 = time.perf_counter()
        r = httpx.post(f"{root}/admin/users/user0/adapter", json={"path": str(paths[version % 2]), "version": version},
                       headers=admin, timeout=120)
        r.raise_for_status()
        out.append(time.perf_counter() - t0)


if __name__ == "__main__":
    main()
