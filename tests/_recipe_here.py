"""The training recipe run in the test's own process: `clawflow.train.recipe.main` with the arguments
torchrun passes its worker (`launch.torchrun_command`), in a one-process gloo group, its output in the
same `<out>.log`.

Tests of what the recipe computes (distill, OPD, best-of-n, rehearsal, preferences, LoRA) use it: a
torchrun launcher and its worker cost ~8 CPU-seconds of start-up each (importing torch and
transformers twice), most of the suite's training cost on 2 cores. The torchrun path itself stays
tested end to end: tests/test_train.py (one and two ranks, resume, a failing worker),
tests/test_train_multinode.py and every flow test launch it as users do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import torch

from clawflow.train import launch
from conftest import free_port


def train(config_path, cfg, base, batch, out, parent_version: int = 0, frozen_base=None, preferences=None,
          cache_dir=None, broad_seed: int | None = None) -> dict:
    """`launch.run_training`'s contract (metrics returned, `TrainingError` on failure), in this process."""
    out = Path(out).resolve()
    cmd = launch.torchrun_command(Path(config_path).resolve(), cfg, Path(base).resolve(), Path(batch).resolve(), out,
                                  parent_version, launch._model_ref(frozen_base),
                                  preferences=Path(preferences).resolve() if preferences else None,
                                  cache_dir=Path(cache_dir).resolve() if cache_dir else None, broad_seed=broad_seed)
    _run(cmd, out.parent / f"{out.name}.log", cfg, "training")
    return json.loads((out / "train_metrics.json").read_text())


def prepare(config_path, cfg, base, preferences, cache_dir, parent_version: int, broad_seed: int,
            gate_cache=None) -> Path:
    """`launch.run_prepare`'s contract, in this process."""
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = launch.prepare_command(Path(config_path).resolve(), Path(base).resolve(), Path(preferences).resolve(),
                                 cache_dir, parent_version, broad_seed,
                                 Path(gate_cache).resolve() if gate_cache else None)
    log = cache_dir / "prepare.log"
    _run(cmd, log, cfg, "prepare")
    return log


def _run(cmd: list[str], log_path: Path, cfg, what: str) -> None:
    from clawflow.train import recipe

    argv = cmd[cmd.index("clawflow.train.recipe") + 1:]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    saved_env = {k: os.environ.get(k) for k in env}
    threads, sigterm = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    os.environ.update(env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            print("$ (in process) " + " ".join(cmd), flush=True)
            rc = recipe.main(argv)
    finally:
        if torch.distributed.is_initialized():  # a recipe that raised left its group
            torch.distributed.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, sigterm)
    if rc != 0:
        raise launch.TrainingError(f"{what} failed (exit {rc}): {launch._reason(log_path, cfg)}", log_path, rc)
