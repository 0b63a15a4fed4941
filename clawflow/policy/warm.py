"""The base's side of the gate, measured once when the gateway first starts (issue #27, round time).

The first training round's gate compares its candidate with the champion and the base, which on a
fresh home are the same model: its helpfulness answers (217 questions) and its plain answers to the
preference prompts were generated inside that round, ~35 s on 2 idle cores, while the user waited
for the new version. They depend on nothing the user says, so the gateway starts this in a process
niced 10 as soon as it serves (`gate.warm_on_start`), and the gate then finds them in its cache.
A gate that runs before it has finished measures them itself, as before.

    python -m clawflow.policy.warm --config configs/default.yaml
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from clawflow.config import Config
from clawflow.home import Home


def gate_cache(cfg: Config) -> Path:
    """Where the gate keeps its references' figures and answers (tasks/policy.py passes the same)."""
    return Home(cfg.home).eval / "helpfulness"


def warm_base(cfg: Config, base_dir: str) -> dict[str, float]:
    """The base's helpfulness figures and plain preference answers written into `gate_cache`, each
    generated only when not there yet; the seconds each took."""
    from clawflow import helpfulness as H
    from clawflow.policy import preference_probe as P

    gate, cache, out = cfg.gate, gate_cache(cfg), {}
    if not gate.enabled:
        return out
    loaded: list = []

    def model():
        if not loaded:
            loaded.append(H.load_model(base_dir))
        return loaded[0]

    if gate.helpfulness.enabled:
        t0, h = time.monotonic(), gate.helpfulness
        m, tok = model()
        H.measure(base_dir, H.load_questions(h.questions), h.max_new_tokens, cache_dir=cache,
                  offtopic_threshold=h.offtopic_below, model=m, tokenizer=tok)
        out["helpfulness_s"] = time.monotonic() - t0
    t0, prompts = time.monotonic(), P.load_prompts(gate.preference_prompts)
    P.cached_answers(cache, base_dir, prompts, "", gate.preference_max_tokens,
                     lambda: P.teacher_answers(*model(), prompts, "", gate.preference_max_tokens))
    out["plain_answers_s"] = time.monotonic() - t0
    return out


def start(cfg: Config) -> subprocess.Popen | None:
    """`warm_base` in a niced child process, its output in the home's run/warm-gate.log; None when
    off or the config has no file to hand the child."""
    if not (cfg.gate.enabled and cfg.gate.warm_on_start and cfg.source_file):
        return None
    run = Home(cfg.home).run
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "warm-gate.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "clawflow.policy.warm", "--config", str(cfg.source_file)],
                                env={**os.environ, "CLAWFLOW_HOME": str(cfg.home)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from clawflow.base_model import base_model_dir
    from clawflow.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    import torch

    os.nice(10)  # the gateway answers users meanwhile
    # one thread: with torch's default two, beside a learning bench's busy trainer on 2 cores, it had
    # used 7 CPU-minutes without finishing ~35 s of idle-machine work (threads spinning on each other)
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    seconds = warm_base(cfg, str(base_model_dir(cfg)))
    print("clawflow.policy.warm: the base's gate references ready: "
          + (", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) or "gate off"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
