"""Hot-reload cost on SmolLM2-135M-Instruct fp32 CPU: wall time of `POST /admin/reload` and the
gateway's resident memory before, during (peak, sampled every 20 ms) and after, idle and under 8
streaming clients, plus the requests that failed while it happened (target: none).

    .venv/bin/python bench/reload.py            # ~2 min
    .venv/bin/python bench/reload.py --reloads 3 --clients 8

Baseline printed beside it: the same checkpoint loaded from scratch in a fresh process
(`AutoModelForCausalLM.from_pretrained`), i.e. what a restart would cost before serving again. The
new weights load beside the old ones (a request in flight finishes on its version), so the peak is
about one extra model (~0.54 GB); the old model is freed when its last request ends. The checkpoint
is the same directory each time, so it comes from the page cache (a cold disk adds its read time).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import TOPICS, model_dir, start_clawflow, stop  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """Max RSS of `pid` while active (a thread reading /proc every 20 ms)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


async def clients_until(base_url: str, key: str, n: int, stop_at: asyncio.Event, failures: list, done: list) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)

    async def one(k: int) -> None:
        j = 0
        while not stop_at.is_set():
            j += 1
            try:
                stream = await client.chat.completions.create(
                    model="smollm2-135m-instruct", max_tokens=24, temperature=0, stream=True,
                    messages=[{"role": "user", "content": f"Tell me about {TOPICS[(k + j) % len(TOPICS)]}."}])
                async for _ in stream:
                    pass
                done.append(1)
            except Exception as exc:  # any failure during a reload is what this bench counts
                failures.append(repr(exc))

    await asyncio.gather(*(one(k) for k in range(n)))


def reload_once(url: str, path: str, pid: int) -> tuple[float, float, float, float]:
    before = rss_mb(pid)
    with Sampler(pid) as s:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/admin/reload", json={"path": path}, timeout=600,
                       headers={"Authorization": "Bearer clawflow-admin"})
        wall = time.perf_counter() - t0
    r.raise_for_status()
    time.sleep(2)  # the old model is dropped once its last request ends
    return wall, before, s.peak, rss_mb(pid)


def fresh_load_seconds(path: str) -> tuple[float, float]:
    code = ("import time,resource,torch;t=time.perf_counter();from transformers import AutoModelForCausalLM;"
            f"m=AutoModelForCausalLM.from_pretrained({path!r},dtype=torch.float32);"
            "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[-2]), float(out[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reloads", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    model = model_dir()
    tmp = Path(tempfile.mkdtemp(prefix="bench-reload-"))
    print(f"model {model}; load average {os.getloadavg()}", flush=True)
    ours = start_clawflow(model, tmp)
    url, pid = ours.base_url.removesuffix("/v1"), ours.proc.pid
    rows = []
    try:
        httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"Authorization": "Bearer clawflow"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).raise_for_status()
        for _ in range(args.reloads):
            rows.append(("idle", *reload_once(url, model, pid)))

        async def loaded() -> tuple[list, list]:
            stop_at, failures, done = asyncio.Event(), [], []
            load = asyncio.create_task(clients_until(ours.base_url, ours.api_key, args.clients, stop_at, failures, done))
            await asyncio.sleep(5)
            for _ in range(args.reloads):
                rows.append((f"{args.clients} streams", *await asyncio.to_thread(reload_once, url, model, pid)))
            stop_at.set()
            await load
            return failures, done

        failures, done = asyncio.run(loaded())
    finally:
        stop(ours)
    base_s, base_rss = fresh_load_seconds(model)
    print(f"\nPOST /admin/reload, SmolLM2-135M fp32 ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")
    print(f"{'while':<12} {'wall s':>7} {'x fresh':>7} {'RSS before MB':>14} {'peak MB':>8} {'after MB':>9}")
    for name, wall, before, peak, after in rows:
        print(f"{name:<12} {wall:>7.2f} {wall / base_s:>7.2f} {before:>14.0f} {peak:>8.0f} {after:>9.0f}")
    print(f"baseline: a fresh process, import transformers + from_pretrained: {base_s:.2f} s, its peak RSS {base_rss:.0f} MB")
    print(f"requests under load: {len(done)} completed, {len(failures)} failed{': ' + failures[0] if failures else ''}")


if __name__ == "__main__":
    main()
