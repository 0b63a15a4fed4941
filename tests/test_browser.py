"""What a user sees after a training run: headless Chromium (Debian's `chromium`, which `make test`
installs with .ci/install-chromium) finds the train-on-new-feedback run in the Prefect UI and the
registered version in the MLflow UI. Screenshots are kept in $CLAWFLOW_TEST_ARTIFACTS (default: the test's tmp dir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from clawflow.local_stack import wait_http
from conftest import admin, free_port, process_group, running_gateway, use_prefect_api
from flows.train_on_new_feedback import train_on_new_feedback

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")


def chromium(url: str, profile: Path, screenshot: Path, *expected: str, attempts: int = 3) -> str:
    """The DOM after the page's scripts ran (virtual time), with a screenshot of it. The UIs fill
    lists lazily, which a loaded machine may not finish in one budget: reload until `expected` show."""
    for attempt in range(1, attempts + 1):
        argv = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--virtual-time-budget={15000 * attempt}",
                "--window-size=1400,900", f"--screenshot={screenshot}", "--dump-dom", url]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"chromium failed on {url}: {done.stderr[-2000:]}"
        assert screenshot.stat().st_size > 10_000, f"empty screenshot of {url}"
        missing = [text for text in expected if text not in done.stdout]
        if not missing:
            return done.stdout
    raise AssertionError(f"{url} never showed {missing} (see {screenshot}):\n{done.stdout[-3000:]}")


def test_prefect_and_mlflow_uis_show_the_training(make_config, prefect_server, tmp_path):
    if not CHROMIUM.exists():
        pytest.fail("headless Chromium is required: apt-get install -y chromium (.ci/run installs it)")
    artifacts = Path(os.environ.get("CLAWFLOW_TEST_ARTIFACTS") or tmp_path / "artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"browser screenshots in {artifacts}")
    api, env = prefect_server
    cfg = make_config()

    with running_gateway(cfg):
        client = OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=cfg.serving.api_key)
        history = [{"role": "user", "content": "Write a haiku about the sea."}]
        r1 = client.chat.completions.create(model="clawflow-tiny", messages=history, seed=1)
        history += [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "No, that's wrong. Make it shorter, please."}]
        client.chat.completions.create(model="clawflow-tiny", messages=history, seed=2)
        httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg)).raise_for_status()
        with use_prefect_api(api):
            state = train_on_new_feedback(config_path=str(cfg.source_file), return_state=True)
    result = state.result()
    assert result["trained"] and result["version"] == 1 and result["promoted"], result
    run = httpx.get(f"{api}/flow_runs/{state.state_details.flow_run_id}").json()
    assert run["state_type"] == "COMPLETED"

    ui = api.removesuffix("/api")
    chromium(f"{ui}/runs", tmp_path / "profile-prefect", artifacts / "prefect-runs.png",
             "train-on-new-feedback", run["name"])
    chromium(f"{ui}/runs/flow-run/{run['id']}", tmp_path / "profile-prefect", artifacts / "prefect-flow-run.png",
             run["name"], "Completed", "reload-v1")

    port = free_port()
    mlflow_env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    argv = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", cfg.tracking_uri,
            "--default-artifact-root", cfg.artifact_root.as_uri(), "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1"]
    with process_group(argv, mlflow_env, tmp_path / "mlflow.log") as proc:
        wait_http(f"http://127.0.0.1:{port}/health", 180, "MLflow server",
                  failed=lambda: proc.poll() is not None and (tmp_path / "mlflow.log").read_text()[-2000:])
        page = f"http://127.0.0.1:{port}/#/models/{cfg.model.name}"
        chromium(page, tmp_path / "profile-mlflow", artifacts / "mlflow-model.png", "Version 1", "champion", "passed")
