"""`clawflow rollback` from a plain shell (no PREFECT_* in the environment) finds the stack's
Prefect API the way `clawflow up` set it (services.prefect_port), so its event reaches Prefect."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from clawflow.policy import registry


def test_rollback_from_a_plain_shell_reaches_the_stacks_prefect(prefect_server, make_config, tiny_model_dir, tmp_path):
    api, _ = prefect_server
    cfg = make_config(model={"name": "rollback-from-shell"},
                      services={"prefect_port": int(api.rsplit(":", 1)[1].split("/")[0])})
    registry.ensure_base(cfg, tiny_model_dir)
    (tmp_path / "ckpt2").mkdir()
    run = registry.start_run(cfg, "train-2", {}, {})
    registry.promote(cfg, registry.register_checkpoint(cfg, run, tmp_path / "ckpt2", {}))
    registry.end_run(cfg, run)

    shell = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    r = subprocess.run([sys.executable, "-m", "clawflow.cli", "rollback", "--config", str(cfg.source_file)],
                       env=shell, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "champion v2 → v1" in r.stdout, r.stdout + r.stderr
    assert "not sent to Prefect" not in r.stdout + r.stderr, r.stderr

    wanted = {"filter": {"event": {"name": ["clawflow.policy.rolled-back"]},
                         "resource": {"id": ["clawflow.policy.rollback-from-shell.v1"]}}}
    deadline, events = time.monotonic() + 30, []
    while not events and time.monotonic() < deadline:  # events are stored asynchronously
        events = httpx.post(f"{api}/events/filter", json=wanted, timeout=10).json()["events"]
        time.sleep(0.5)
    assert len(events) == 1 and events[0]["payload"] == {"from_version": 2, "to_version": 1}, events
