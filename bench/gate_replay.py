"""A recorded candidate through today's gate: would the shipped gate promote it now? (#27)

Reads a finished learning bench's home (bench/learning.py keeps it under /tmp), takes a registered
version's checkpoint, its parent as served (the base for a version trained from it) and the
preferences its teacher read (`preferences.json` beside the weights), and runs
`clawflow/policy/gate.py` `evaluate_doses` with configs/default.yaml's `gate` section as it ships
now. Held-out judged turns are not replayed (with standing preferences the preference measure and
the stance check decide what was learned). Prints the verdict then and now. `--skip-helpfulness`
leaves out the facts check, which the version passed or failed when it was gated (minutes on 2 cores).

    PYTHONPATH=. .venv/bin/python bench/gate_replay.py /tmp/clawflow-learning-lowercase_casual-XXXX/lowercase_casual 2 --skip-helpfulness
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from clawflow.config import REPO_ROOT, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("home", type=Path, help="a learning bench's home (holds bench-config.yaml)")
    parser.add_argument("versions", type=int, nargs="+")
    parser.add_argument("--skip-helpfulness", action="store_true",
                        help="leave out the facts check (measured when the version was gated; the slowest part)")
    args = parser.parse_args(argv)
    os.environ["CLAWFLOW_HOME"] = str(args.home)
    from mlflow import MlflowClient

    from clawflow.base_model import base_model_dir
    from clawflow.policy.gate import evaluate_doses

    cfg = load_config(args.home / "bench-config.yaml")
    gate = load_config(REPO_ROOT / "configs" / "default.yaml").gate
    if args.skip_helpfulness:
        gate = gate.model_copy(update={"helpfulness": gate.helpfulness.model_copy(update={"enabled": False})})
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    base = str(base_model_dir(cfg))
    for v in args.versions:
        mv = client.get_model_version(cfg.model.name, str(v))
        tags = mv.tags or {}
        parent = int(tags.get("parent_version", 0))
        champion = client.get_model_version(cfg.model.name, str(parent)).source if parent else base
        taught = json.loads((Path(mv.source) / "preferences.json").read_text())["taught"]
        with tempfile.TemporaryDirectory() as work:
            verdict = evaluate_doses(gate, mv.source, champion, Path(work), judged=[], base_dir=base,
                                     cache_dir=Path(work) / "cache", taught=taught)
        shown = {k: v for k, v in verdict.metrics.items() if k.startswith("shown")}
        print(f"v{v} (from v{parent}; the teacher read {taught!r})\n"
              f"  then: {tags.get('gate')} at dose {tags.get('dose')}, preference {tags.get('eval.pref_gain')}\n"
              f"  now:  {'passed' if verdict.passed else 'rejected'} at dose {verdict.dose}: {verdict.reason}\n"
              f"  shown: {json.dumps(shown)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
