"""`clawflow connect openclaw`: OpenClaw's JSON5 config merged (never clobbered), backed up when
changed, left untouched when unreadable; the served model and window come from the gateway."""

from __future__ import annotations

import json
from pathlib import Path

import json5
import pytest
from typer.testing import CliRunner

from _gateway_helpers import MODEL
from clawflow.cli import app
from clawflow.openclaw import Served, default_path, merge, model_entry

S = Served("http://127.0.0.1:30000/v1", "key", "smollm2-135m-instruct", 8192, 256)

USER_FILE = """// my OpenClaw settings
{
  agents: {defaults: {workspace: "~/work", model: {primary: "openai/gpt-5", fallbacks: ["anthropic/x"]}}},
  models: {providers: {openai: {apiKey: "sk-mine", models: []}}},
  tools: {allow: ["read"],},  // trailing commas and comments: JSON5
  gateway: {port: 18789},
}
"""


def test_merge_points_openclaw_at_the_gateway_and_keeps_everything_else():
    before = json5.loads(USER_FILE)
    new, changes = merge(before, S)
    assert before == json5.loads(USER_FILE)  # the input is not modified
    provider = new["models"]["providers"]["clawflow"]
    assert provider == {"baseUrl": S.base_url, "apiKey": "key", "api": "openai-completions",
                        "models": [model_entry(S)]}
    # declared window: twice the served one, so OpenClaw neither clamps max_tokens nor compacts early
    assert provider["models"][0]["contextWindow"] == 16384 and provider["models"][0]["maxTokens"] == 256
    assert new["agents"]["defaults"]["model"] == {"primary": "clawflow/smollm2-135m-instruct",
                                                 "fallbacks": ["anthropic/x"]}
    assert new["tools"] == {"allow": ["read"], "profile": "minimal"}  # 8192 tokens: the minimal prompt
    assert new["models"]["providers"]["openai"] == before["models"]["providers"]["openai"]
    assert new["agents"]["defaults"]["workspace"] == "~/work" and new["gateway"] == {"port": 18789}
    assert any(c.startswith("agents.defaults.model.primary: openai/gpt-5 → clawflow/") for c in changes)
    assert not any("key" in c.split(":", 1)[1] for c in changes if "apiKey" in c)  # keys are not printed
    assert merge(new, S) == (new, [])  # idempotent


def test_merge_updates_our_model_in_place_and_leaves_big_windows_their_tools():
    cfg = {"models": {"providers": {"clawflow": {"models": [
        {"id": "other", "contextWindow": 1}, {"id": S.model, "contextWindow": 8192, "cost": {"input": 0}}]}}},
        "agents": {"defaults": {"model": "openai/gpt-5"}}, "tools": {"profile": "full"}}
    big = Served(S.base_url, S.api_key, S.model, 131072, 512)
    new, _ = merge(cfg, big)
    models = new["models"]["providers"]["clawflow"]["models"]
    assert models[0] == {"id": "other", "contextWindow": 1}
    assert models[1] == {**model_entry(big), "cost": {"input": 0}}  # the user's extra field stays
    assert new["agents"]["defaults"]["model"] == {"primary": f"clawflow/{S.model}"}
    assert new["tools"] == {"profile": "full"}  # a large window keeps the user's profile
    assert merge(cfg, S)[0]["tools"] == {"profile": "minimal"}  # a small one needs the minimal prompt


def test_default_path_resolves_like_openclaw(tmp_path):
    assert default_path({"HOME": "/h"}) == Path("/h/.openclaw/openclaw.json")
    assert default_path({"HOME": "/h", "OPENCLAW_HOME": "/oc"}) == Path("/oc/.openclaw/openclaw.json")
    assert default_path({"HOME": "/h", "OPENCLAW_STATE_DIR": "~/state"}) == Path("/h/state/openclaw.json")
    assert default_path({"HOME": "/h", "OPENCLAW_CONFIG_PATH": "/etc/oc.json5"}) == Path("/etc/oc.json5")


def connect(cfg, path: Path, *extra: str):
    return CliRunner().invoke(app, ["connect", "openclaw", "--config-file", str(path), "--config",
                                    str(cfg.source_file), *extra])


def test_cli_merges_into_the_users_file_with_a_backup_from_the_running_gateway(served, tmp_path):
    cfg, _ = served
    path = tmp_path / "openclaw.json"
    path.write_text(USER_FILE)
    out = connect(cfg, path)
    assert out.exit_code == 0, out.output
    written = json.loads(path.read_text())  # plain JSON (valid JSON5), as OpenClaw writes it
    model = written["models"]["providers"]["clawflow"]["models"][0]
    assert model["id"] == MODEL and model["contextWindow"] == 2 * 2048  # the gateway's /v1/models
    assert model["maxTokens"] == cfg.serving.max_new_tokens
    assert written["models"]["providers"]["clawflow"]["baseUrl"] == f"{cfg.gateway_url}/v1"
    assert written["gateway"] == {"port": 18789} and written["tools"]["allow"] == ["read"]
    backups = list(tmp_path.glob("openclaw.json.bak-*"))
    assert len(backups) == 1 and backups[0].read_text() == USER_FILE
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # it holds API keys

    again = connect(cfg, path)
    assert again.exit_code == 0 and "unchanged" in again.output
    assert len(list(tmp_path.glob("openclaw.json.bak-*"))) == 1  # nothing changed, nothing written

    fresh = tmp_path / "new" / "openclaw.json"
    assert connect(cfg, fresh).exit_code == 0 and json.loads(fresh.read_text())["tools"] == {"profile": "minimal"}
    assert not list(fresh.parent.glob("*.bak-*"))


@pytest.mark.parametrize("content, reason", [
    ("{agents: {defaults: ", "not valid JSON5"),
    ("[1, 2]", "must hold a JSON5 object"),
    (b"\xff\xfe{}", "cannot read"),
])
def test_cli_refuses_a_bad_file_in_one_line_and_leaves_it_untouched(make_config, tmp_path, content, reason):
    cfg = make_config()
    path = tmp_path / "oc" / "openclaw.json"
    path.parent.mkdir()
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = path.read_bytes()
    out = connect(cfg, path, "--context-window", "8192")
    assert out.exit_code == 1 and reason in out.output and "untouched" in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1 and "Traceback" not in out.output
    assert path.read_bytes() == before and list(path.parent.iterdir()) == [path]  # no backup, no temp file


def test_cli_needs_the_gateway_or_a_window(make_config, tmp_path):
    cfg = make_config()  # nothing listens on its port
    out = connect(cfg, tmp_path / "openclaw.json")
    assert out.exit_code == 1 and "not running" in out.output and "--context-window" in out.output
    assert not (tmp_path / "openclaw.json").exists()
    ok = connect(cfg, tmp_path / "openclaw.json", "--context-window", "65536")
    assert ok.exit_code == 0, ok.output
    written = json.loads((tmp_path / "openclaw.json").read_text())
    assert written["models"]["providers"]["clawflow"]["models"][0]["contextWindow"] == 131072
    assert "tools" not in written  # a large window: OpenClaw's default tools fit
