"""Trajectory store benchmark: WAL append throughput per fsync policy, and training-batch
assembly over 1,000 shards / 1 M turns, DuckDB catalog vs pandas (read every shard + merge).

    .venv/bin/python bench/store.py                      # 1,000 shards, 1 M turns (~1 min to generate)
    .venv/bin/python bench/store.py --shards 100 --turns 100000

Baselines printed side by side: pandas for batch assembly; fsync=always for appends; and one
training step of SmolLM2-135M on this CPU (13.5 s, FIELD_NOTES.md) as the budget assembly must fit.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clawflow.store.catalog import Catalog  # noqa: E402
from clawflow.contracts.turn import ARROW_SCHEMA, TurnRecord  # noqa: E402
from clawflow.store.shards import write_shard  # noqa: E402
from clawflow.store.wal import SegmentWriter  # noqa: E402

TRAIN_STEP_S = 13.5  # FIELD_NOTES.md: one SmolLM2-135M step, batch 4 x 256 tokens, this CPU
BATCH, BUDGET, SESSION_TURNS = 256, 16_384, 10


def _lists(rng, lens, typ, values):
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[: offsets[-1]], type=typ))


def generate(shards_dir: Path, n_shards: int, n_turns: int) -> None:
    """Sessions of 10 turns interleaved so that turn t + 1 usually lands in the next shard."""
    rng = np.random.default_rng(0)
    per = n_turns // n_shards
    live = max(per, 1)  # sessions open at once
    base = np.datetime64("2026-01-01T00:00:00", "us")
    for s in range(n_shards):
        k = np.arange(s * per, (s + 1) * per)
        block = live * SESSION_TURNS
        session = (k // block) * live + k % live
        plen, rlen = rng.integers(16, 64, per), rng.integers(4, 32, per)
        text = [f'[{{"role":"user","content":"message {x}"}}]' for x in k]
        cols = {
            "turn_id": pa.array([f"t{x:010d}" for x in k]),
            "session_id": pa.array([f"s{x:08d}" for x in session]),
            "turn_index": pa.array(((k % block) // live).astype(np.int32)),
            "turn_type": pa.array(np.where(k % 20 == 0, "side", "main")),
            "source": pa.array(["live"] * per), "group_id": pa.nulls(per, pa.string()),
            "created_at": pa.array(base + k.astype("timedelta64[ms]") * 100, type=pa.timestamp("us", tz="UTC")),
            "policy_version": pa.array((k * 10 // n_turns).astype(np.int64)),
            "messages": pa.array(text), "tools": pa.nulls(per, pa.string()),
            "prompt_token_ids": _lists(rng, plen, pa.int32(), rng.integers(0, 49152, plen.sum()).astype(np.int32)),
            "response_token_ids": _lists(rng, rlen, pa.int32(), rng.integers(0, 49152, rlen.sum()).astype(np.int32)),
            "response_logprobs": _lists(rng, rlen, pa.float32(), -rng.random(rlen.sum()).astype(np.float32)),
            "response_text": pa.array([f"answer {x}" for x in k]), "tool_calls": pa.nulls(per, pa.string()),
            "finish_reason": pa.array(["stop"] * per), "new_messages": pa.array(text),
            "session_done": pa.array(np.zeros(per, bool)), "env_reward": pa.nulls(per, pa.float64()),
            "prompt_tokens": pa.array(plen.astype(np.int32)), "response_tokens": pa.array(rlen.astype(np.int32)),
        }
        part = shards_dir / f"date=2026-01-{1 + s * 10 // n_shards:02d}"
        write_shard(pa.table(cols, schema=ARROW_SCHEMA), part / f"shard-{s:05d}.parquet")


def pandas_batch(shards_dir: Path, consumed: set[str], current: int, staleness: int) -> pd.DataFrame:
    """The same batch as `Catalog.select_batch`, the straightforward pandas way."""
    df = pd.concat([pq.read_table(p).to_pandas() for p in sorted(shards_dir.rglob("*.parquet"))], ignore_index=True)
    main = df[df.turn_type == "main"]
    nxt = (main.sort_values(["created_at", "turn_id"]).drop_duplicates(["session_id", "turn_index"])
           [["session_id", "turn_index", "new_messages"]])
    nxt = nxt.assign(turn_index=nxt.turn_index - 1).rename(columns={"new_messages": "next_state"})
    pairs = main.merge(nxt, on=["session_id", "turn_index"])
    pairs = pairs[~pairs.turn_id.isin(consumed) & (current - pairs.policy_version <= staleness)]
    pairs = pairs.sort_values(["created_at", "turn_id"]).head(BATCH)
    cum = (pairs.prompt_tokens + pairs.response_tokens).cumsum()
    return pairs[(cum <= BUDGET) | (np.arange(len(pairs)) == 0)]


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bench_assembly(tmp: Path, n_shards: int, n_turns: int, repeat: int) -> list[tuple[str, str, str]]:
    shards = tmp / "shards"
    t0 = time.perf_counter()
    generate(shards, n_shards, n_turns)
    gen_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in shards.rglob("*.parquet"))
    print(f"generated {n_shards} shards, {n_turns:,} turns, {size / 2**20:.0f} MiB in {gen_s:.1f} s", flush=True)

    cat = Catalog(tmp / "catalog.duckdb", shards)
    reg_s, _ = timed(cat.sync, 1)  # one time per shard: full read with checksums
    with cat._connect() as con:  # the oldest half was trained on already
        src, params = cat.turns_from(con)
        con.execute(f"INSERT INTO consumed SELECT turn_id, 'bench', 0, now() FROM {src} "
                    f"WHERE turn_type = 'main' ORDER BY created_at LIMIT {n_turns // 2}", params).fetchall()
        consumed = {r[0] for r in con.execute("SELECT turn_id FROM consumed").fetchall()}
    current, staleness = 9, 8

    def duck():
        batch = cat.select_batch("bench", BATCH, BUDGET, current_version=current, max_staleness=staleness)
        cat.release("bench")
        return batch

    duck_s, batch = timed(duck, repeat)
    pandas_s, ref = timed(lambda: pandas_batch(shards, consumed, current, staleness), max(1, repeat // 2))
    same = [p.turn_id for p in batch] == ref.turn_id.tolist()
    nexts = [p.next_state for p in batch] == ref.next_state.tolist()
    print(f"batch: {len(batch)} pairs, {sum(p['prompt_tokens'] + p['response_tokens'] for p in batch)} tokens; "
          f"same turns and next states as pandas: {same and nexts}", flush=True)
    return [
        ("batch assembly, DuckDB catalog (warm)", f"{duck_s:.2f} s", f"{pandas_s / duck_s:.1f}x faster than pandas; "
         f"{duck_s / TRAIN_STEP_S:.0%} of one training step"),
        ("batch assembly, pandas read all + merge", f"{pandas_s:.2f} s", "baseline"),
        ("shard registration (once per shard)", f"{reg_s:.2f} s", f"{n_shards} shards read fully, checksums verified"),
    ]


def sample_turn(i: int) -> TurnRecord:
    return TurnRecord(session_id=f"s{i % 97}", turn_index=i, policy_version=1,
                      messages=[{"role": "user", "content": "Summarize this paragraph for me. " * 8}],
                      prompt_token_ids=list(range(200)), response_token_ids=list(range(50)),
                      response_logprobs=[-0.5] * 50, response_text="A short summary. " * 8,
                      finish_reason="stop", new_messages=[{"role": "user", "content": "thanks"}])


def bench_append(tmp: Path, seconds: float) -> list[tuple[str, str, str]]:
    rows, base = [], None
    record = sample_turn(0)
    for policy in ("always", "group", "never"):
        for threads in (1, 8):
            writer = SegmentWriter(tmp / f"wal-{policy}-{threads}", fsync=policy, group_commit_ms=5)
            count = [0] * threads
            stop = time.perf_counter() + seconds

            def work(t: int) -> None:
                while time.perf_counter() < stop:
                    writer.append(record)
                    count[t] += 1

            t0 = time.perf_counter()
            pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
            for th in pool:
                th.start()
            for th in pool:
                th.join()
            rate = sum(count) / (time.perf_counter() - t0)
            writer.close()
            base = base or {}
            base.setdefault(threads, rate)
            note = "baseline" if policy == "always" else f"{rate / base[threads]:.1f}x always"
            rows.append((f"append, fsync={policy}, {threads} thread{'s' if threads > 1 else ''}",
                         f"{rate:,.0f} turns/s", note))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--append-seconds", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir, removed)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = bench_append(Path(tmp), args.append_seconds)
        rows += bench_assembly(Path(tmp), args.shards, args.turns, args.repeat)
    width = max(len(r[0]) for r in rows)
    load = os.getloadavg()[0]
    print(f"\n{'measure':<{width}}  {'result':>16}  vs baseline  (cpus: {os.cpu_count()}, load average: {load:.1f})")
    for name, result, note in rows:
        print(f"{name:<{width}}  {result:>16}  {note}")


if __name__ == "__main__":
    main()
