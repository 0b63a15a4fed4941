"""The real agent as a client: OpenClaw (npm, pinned, installed by .ci/install-openclaw into
.tools/openclaw), set up by `clawflow connect openclaw`, talks to a real gateway for two turns; the
user corrects it. Its turns are recorded in one inferred session, the correction is the first turn's
next state, the embedded judge scores that turn −1 with a clean hint, and a training run consumes it.

A machine where OpenClaw cannot be installed fails this test with the installer's reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from _gateway_helpers import sealed_turns
from clawflow.base_model import model_dir
from clawflow.cli import app
from clawflow.config import REPO_ROOT, JudgeConfig, default_home
from clawflow.envelopes import normalize_text
from clawflow.judge.hints import extract_hint
from clawflow.policy import reload
from clawflow.store.catalog import Catalog
from conftest import drain_prefect_events, running_gateway

pytestmark = pytest.mark.slow
TOOLS = REPO_ROOT / ".tools" / "openclaw"
QUESTION = "What is the capital of France?"
CORRECTION = "No, that's wrong. The capital of France is Paris. Just say Paris."
WINDOW = 16384  # OpenClaw's prompt with the minimal tools profile is ~7,700 tokens


@pytest.fixture(scope="module")
def openclaw() -> dict[str, str]:
    """The environment that runs the project-local `openclaw` (its Node first on PATH)."""
    done = subprocess.run([str(REPO_ROOT / ".ci" / "install-openclaw")], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # never a skip: a machine without the agent has not tested it
        pytest.fail(f"OpenClaw could not be installed (.ci/install-openclaw): {done.stderr.strip()[-1500:]}")
    node = next((TOOLS / "node_modules").glob("node-linux-*/bin"))
    return {"PATH": f"{node}:{TOOLS / 'node_modules' / '.bin'}:{os.environ['PATH']}", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model with room for OpenClaw's prompt (RoPE has no trained length to outgrow)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-16k"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    return str(out)


class Wire:
    """What crossed the wire for chat completions around the real app: the request's `stream`
    flag, the response's status, content type and last bytes."""

    def __init__(self, app):
        self.app, self.calls = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        call = {"body": b"", "tail": b""}
        self.calls.append(call)

        async def rx():
            message = await receive()
            call["body"] += message.get("body", b"") if message["type"] == "http.request" else b""
            return message

        async def tx(message):
            if message["type"] == "http.response.start":
                call["status"], call["type"] = message["status"], dict(message["headers"]).get(b"content-type")
            elif message["type"] == "http.response.body":
                call["tail"] = (call["tail"] + message.get("body", b""))[-300:]
            await send(message)

        await self.app(scope, rx, tx)


def agent(env: dict[str, str], home: Path, text: str) -> dict:
    done = subprocess.run(["openclaw", "agent", "--local", "--session-id", "e2e", "-m", text, "--json"],
                          env={**os.environ, **env, "HOME": str(home)}, cwd=home, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"openclaw failed ({done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout)


def test_openclaw_conversation_is_recorded_judged_and_trained(openclaw, long_context_model, make_config,
                                                             prefect_api, tmp_path):
    from flows.train_on_new_feedback import train_on_new_feedback

    reader = model_dir(JudgeConfig().embedded.reader, default_home())  # the judge's shared copy
    cfg = make_config(model={"name": "clawflow-tiny-16k", "path": long_context_model},
                      judge={"backend": "embedded", "embedded": {"reader": {"path": reader}}},
                      gate={"holdout_fraction": 0.0},  # the one judged turn trains, not held out
                      train={"objective": "combined"})  # RL on the −1 and OPD on its hint: both use the turn
    home = tmp_path / "openclaw-home"
    home.mkdir()
    wire: list[Wire] = []
    with running_gateway(cfg, lambda a: wire.append(Wire(a)) or wire[0]):
        connected = CliRunner().invoke(app, ["connect", "openclaw", "--config", str(cfg.source_file),
                                             "--config-file", str(home / ".openclaw" / "openclaw.json")])
        assert connected.exit_code == 0, connected.output
        first, second = agent(openclaw, home, QUESTION), agent(openclaw, home, CORRECTION)
        turns = sorted(sealed_turns(cfg), key=lambda t: t["turn_index"])

    # OpenClaw streamed both requests and got complete streams, whose text it took as the reply
    calls = wire[0].calls
    assert len(calls) == 2 and all(json.loads(c["body"])["stream"] is True for c in calls)
    assert all(c["status"] == 200 and c["type"].startswith(b"text/event-stream") for c in calls)
    assert all(c["tail"].endswith(b"data: [DONE]\n\n") for c in calls)
    for out, turn in zip((first, second), turns):
        assert out["meta"]["finalAssistantRawText"].strip() == turn["response_text"].strip(), (out["meta"], turn)

    # one session, inferred (OpenClaw sends no session header), turn 0 then turn 1
    assert [t["turn_index"] for t in turns] == [0, 1], turns
    assert turns[0]["session_id"] == turns[1]["session_id"] and turns[0]["session_id"].startswith("inferred-")
    # the correction is the first turn's next state, recorded byte-exact as received (its envelope too)
    added = json.loads(turns[1]["new_messages"])
    assert len(added) == 1 and added[0]["role"] == "user" and added[0]["content"].endswith(CORRECTION)
    assert added[0]["content"] != CORRECTION and normalize_text(added[0]["content"]) == CORRECTION
    first_user = next(m for m in json.loads(turns[0]["messages"]) if m["role"] == "user")
    assert "\n\nRuntime: agent=" in first_user["content"] and normalize_text(first_user["content"]) == QUESTION

    # the training run judges turn 0 by the correction (−1, the user's words as the hint) and trains on it
    drain_prefect_events()
    assert reload.provision(cfg)[0] == 1
    result = train_on_new_feedback(config_path=str(cfg.source_file), reload=False)
    assert result["trained"] and result["samples"] == 1, result
    judged = pq.read_table(cfg.home / "judgments").to_pylist()
    assert [(j["turn_id"], j["judge"], j["score"]) for j in judged] == [(turns[0]["turn_id"], "embedded", -1)]
    assert judged[0]["hint"] == extract_hint(CORRECTION, cfg.judge.hint_min_chars) and "Paris" in judged[0]["hint"]
    samples = pq.read_table(cfg.home / "runs" / result["mlflow_run"] / "samples.parquet").to_pylist()
    assert [s["turn_id"] for s in samples] == [turns[0]["turn_id"]] and samples[0]["hint"] == judged[0]["hint"]
    assert Catalog.for_config(cfg).stats()["consumed"] == 1  # it trains once
