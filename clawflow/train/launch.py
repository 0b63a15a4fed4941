"""Run the training recipe as a `torchrun` subprocess and read back its metrics.

The recipe always runs in its own processes (never in the caller's), so a laptop run and a
multi-GPU run are the same command; only `train.nproc` changes. Across nodes (`train.nnodes` > 1)
each node runs `run_training` with its own `train.node_rank` and the same batch and base paths;
node 0's returns the metrics, the others `{"node_rank": N}`. Output goes to
`<out.parent>/<out.name>.log`. An interrupted run leaves `<out>.resume/`; calling `run_training`
again with the same `out` resumes it (that is what a Prefect task retry does).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import clawflow
from clawflow.config import Config

LOG_TAIL_LINES = 30
EXIT_NO_SAMPLES = 3  # the recipe's exit status when the batch holds nothing trainable
PREPARE_NICE = 10  # the prepare step yields the CPU to serving


class TrainingError(RuntimeError):
    """A training run that failed: a one-line reason, then the tail of its log."""

    def __init__(self, reason: str, log_path: Path, returncode: int | None, resumable: bool = False):
        self.reason, self.log_path, self.returncode, self.resumable = reason, log_path, returncode, resumable
        super().__init__(f"{reason}\n--- last lines of {log_path} ---\n{_tail(log_path)}")


def torchrun_command(config_path: Path, cfg: Config, base: Path, batch: Path, out: Path,
                     parent_version: int = 0, frozen_base: str | None = None, stop_after: int = 0,
                     preferences: Path | None = None, cache_dir: Path | None = None,
                     broad_seed: int | None = None) -> list[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *_rendezvous_args(cfg),
        f"--nproc_per_node={cfg.train.nproc}",
        "-m", "clawflow.train.recipe",
        "--config", str(config_path), "--base", str(base), "--batch", str(batch), "--out", str(out),
        "--parent-version", str(parent_version), "--stop-after", str(stop_after),
    ]  # fmt: skip
    return cmd + (["--frozen-base", str(frozen_base)] if frozen_base else []) \
        + (["--preferences", str(preferences)] if preferences else []) \
        + (["--cache-dir", str(cache_dir)] if cache_dir else []) \
        + (["--broad-seed", str(broad_seed)] if broad_seed is not None else [])


def _rendezvous_args(cfg: Config) -> list[str]:
    """`--standalone` on one node; across nodes, torchrun's c10d rendezvous (no restarts: a failed
    run is retried by Prefect, which sees the reason)."""
    t = cfg.train
    if t.nnodes == 1:
        return ["--standalone"]
    return [f"--nnodes={t.nnodes}", f"--node-rank={t.node_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={t.rdzv_endpoint}", f"--rdzv-id={t.rdzv_id}",
            f"--rdzv-conf=join_timeout={max(1, round(t.rdzv_timeout_s))}", "--max-restarts=0"]


def run_training(
    config_path: Path,
    cfg: Config,
    base: Path,
    batch: Path,
    out: Path,
    timeout_s: float | None = None,
    parent_version: int = 0,
    frozen_base: str | Path | None = None,
    stop_after: int = 0,
    preferences: Path | None = None,
    cache_dir: Path | None = None,
    broad_seed: int | None = None,
) -> dict:
    """Train `base` (registry version `parent_version`) on the samples in `batch`, writing a
    checkpoint directory at `out`. `frozen_base` is the OPD teacher / KL reference when the config
    asks for the frozen base; `stop_after` stops resumably after that many steps (tests, time boxes);
    `preferences` a JSON file of the user's standing preferences to distil; `cache_dir` keeps
    rewrites across runs (train/rewrite_cache.py); `broad_seed` picks the general prompts.

    Returns the parsed `out/train_metrics.json`; raises `TrainingError` on a non-zero exit or
    a timeout (the whole process group is stopped); `.resumable` tells whether a rerun resumes.
    """
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    node = cfg.train.node_rank
    log_path = out.parent / (f"{out.name}.log" if node == 0 else f"{out.name}.node{node}.log")
    env = _child_env()
    cmd = torchrun_command(Path(config_path).resolve(), cfg, Path(base).resolve(), Path(batch).resolve(), out,
                           parent_version, _model_ref(frozen_base), stop_after,
                           Path(preferences).resolve() if preferences else None,
                           Path(cache_dir).resolve() if cache_dir else None, broad_seed)
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise TrainingError(f"training timed out after {timeout_s:g} s", log_path, None, _resumable(out))
    if rc != 0:
        rc = _root_cause_exit(log_path) or rc  # torchrun itself exits 1 whatever its worker returned
        raise TrainingError(f"training failed (exit {rc}): {_reason(log_path, cfg)}", log_path, rc, _resumable(out))
    if node > 0:  # global rank 0, on node 0, writes the checkpoint and its metrics
        return {"node_rank": node}
    return json.loads((out / "train_metrics.json").read_text())


def prepare_command(config_path: Path, base: Path, preferences: Path, cache_dir: Path, parent_version: int,
                    broad_seed: int, gate_cache: Path | None = None) -> list[str]:
    """`recipe --prepare` under torchrun, one process (rank 0 generates alone)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "clawflow.train.recipe", "--prepare", "--config", str(config_path), "--base", str(base),
            "--preferences", str(preferences), "--cache-dir", str(cache_dir), "--parent-version", str(parent_version),
            "--broad-seed", str(broad_seed)] + (["--gate-cache", str(gate_cache)] if gate_cache else [])


def run_prepare(config_path: Path, cfg: Config, base: Path, preferences: Path, cache_dir: Path,
                parent_version: int, broad_seed: int, timeout_s: float | None = None,
                gate_cache: Path | None = None) -> Path:
    """`recipe --prepare` as one niced process (rank 0 generates alone; it must not slow the serving
    it runs beside): the rewrites the next run from `base` reads, written into `cache_dir`, and the
    teacher answers its gate reads, into `gate_cache`.
    Returns the log's path; raises `TrainingError` when it fails."""
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = cache_dir / "prepare.log"
    env = _child_env()
    cmd = prepare_command(Path(config_path).resolve(), Path(base).resolve(), Path(preferences).resolve(), cache_dir,
                          parent_version, broad_seed, Path(gate_cache).resolve() if gate_cache else None)
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=lambda: os.nice(PREPARE_NICE))
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise TrainingError(f"prepare timed out after {timeout_s:g} s", log_path, None)
    if rc != 0:
        raise TrainingError(f"prepare failed (exit {rc}): {_reason(log_path, cfg)}", log_path, rc)
    return log_path


def _child_env() -> dict:
    """This environment, with clawflow importable in the children."""
    env = dict(os.environ)
    pkg_root = str(Path(clawflow.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def _model_ref(ref: str | Path | None) -> str | None:
    """A local directory made absolute (the workers may run elsewhere), a hub id kept as it is."""
    if ref is None:
        return None
    return str(Path(ref).resolve()) if Path(ref).is_dir() else str(ref)


def _resumable(out: Path) -> bool:
    return (out.with_name(out.name + ".resume") / "state.json").is_file()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the run's process group (torchrun and its workers), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# a worker's own crash line: a C++ abort (`terminate called`, `what():`) or a Python exception
_CRASH = re.compile(r"(terminate called .*|what\(\):.*|(\[[^\]]*\]:?\s*)?[A-Za-z_][\w.]*(Error|Exception): .*)$")


def _reason(log_path: Path, cfg: Config | None = None) -> str:
    """The recipe's own error line if it printed one, a rendezvous that did not form, else the
    last non-empty log line."""
    text = log_path.read_text(errors="replace")
    if cfg is not None and cfg.train.nnodes > 1 and re.search(r"Rendezvous\w*(Timeout|Connection|Closed)Error", text):
        t = cfg.train
        return (f"rendezvous {t.rdzv_id!r} at {t.rdzv_endpoint} did not form: {t.nnodes} nodes expected "
                f"within {t.rdzv_timeout_s:g} s (node {t.node_rank})")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith("clawflow.train: error:")]
    if ours:
        return ours[-1].removeprefix("clawflow.train: error: ")
    # a worker's own crash (a C++ abort, a Python exception) says more than torchrun's closing banner
    crash = [ln for ln in lines if _CRASH.match(ln)]
    return crash[-1] if crash else lines[-1] if lines else "no output"



def _root_cause_exit(log_path: Path) -> int | None:
    """The failed worker's exit status from torchrun's "Root Cause" summary, if it printed one."""
    text = log_path.read_text(errors="replace")
    cause = text.rfind("Root Cause")
    found = re.search(r"exitcode\s*:\s*(-?\d+)", text[cause:]) if cause >= 0 else None
    return int(found.group(1)) if found else None


def _tail(log_path: Path) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    except OSError:
        return "(no log)"
