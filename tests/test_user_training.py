"""Each user's corrections train that user's own adapter (issue #29), on the shipped recipe (LoRA,
distill, rehearsal, broad prompts, `kl_beta`): `train-on-new-feedback` under a real Prefect API, a
real MLflow store, Parquet shards and DuckDB, torchrun training, and the real gateway serving.

After alice's run, her version line (`<model>.alice`) has v1 and the gateway serves it to her key
alone: bob's greedy replies are token for token what they were, the shared line is untouched, and
a restarted gateway loads her adapter again. The gate is off here (its verdicts are the subject of
tests/test_shipped_recipe.py); this test is about whose line a run trains and who is served it."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import yaml
from test_gate_judged import seal_turns
from test_store import shard_rows
from test_shipped_recipe import FUNCTION_WORD_PROMPTS, champion_adapter, sessions, shipped_recipe_config
from transformers import AutoTokenizer
from typer.testing import CliRunner

from clawflow.cli import app as cli
from clawflow.config import load_config
from clawflow.policy import registry, reload
from clawflow.prefs.store import PreferenceStore
from clawflow.store.catalog import Catalog
from conftest import admin, free_port, running_gateway

KEYS = {"alice": "alice-key", "bob": "bob-key"}
PROMPTS = FUNCTION_WORD_PROMPTS[:16]  # the isolation target: 16 prompts, token for token


def config(tmp_path, tiny_model_dir):
    cfg, _ = shipped_recipe_config(tmp_path, tiny_model_dir)
    raw = yaml.safe_load(cfg.source_file.read_text())
    raw["serving"].update(port=free_port(), users={u: hashlib.sha256(k.encode()).hexdigest() for u, k in KEYS.items()})
    raw["gate"]["enabled"] = False
    cfg.source_file.write_text(yaml.safe_dump(raw))
    return load_config(cfg.source_file)


def replies(cfg, key: str) -> list[tuple[str, list[float]]]:
    out = []
    for p in PROMPTS:
        r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": p}], "max_tokens": 4, "temperature": 0,
                             "logprobs": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["message"]["content"], [round(e["logprob"], 3) for e in choice["logprobs"]["content"]]))
    return out


def turns_of(user: str, tok, version: int, n: int = 6):
    """The shipped-recipe test's first `n` sessions (s1 and s4: length corrections), sent by `user`."""
    out = sessions(tok, version)[:n]
    for first, second, _ in out:
        first.user = second.user = user
        first.turn_id, second.turn_id = f"{user}-{first.turn_id}", f"{user}-{second.turn_id}"
    return out


@pytest.mark.slow  # one flow run: torchrun training of alice's adapter
def test_alices_corrections_train_her_own_adapter_and_only_she_is_served_it(tmp_path, tiny_model_dir, prefect_api):
    from flows.train_on_new_feedback import train_on_new_feedback

    cfg = config(tmp_path, tiny_model_dir)
    assert reload.provision(cfg) == (1, tiny_model_dir)
    shared = champion_adapter(cfg, tiny_model_dir, cfg.home / "checkpoints" / "shared-v2")
    run = registry.start_run(cfg, "train-from-v1", {}, {})
    assert registry.register_checkpoint(cfg, run, shared, {"parent_version": "1"}) == 2
    registry.promote(cfg, 2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seal_turns(cfg.home, turns_of("alice", tok, 2) + turns_of("bob", tok, 2, n=2))
    assert Catalog.for_config(cfg).pending_users() == {"alice": 6, "bob": 2}
    assert cfg.train.min_turns == 4  # shipped: bob's 2 wait for more

    with running_gateway(cfg):
        before = {u: replies(cfg, k) for u, k in KEYS.items()}
        assert before["alice"] == before["bob"]  # both on the shared policy v2
        result = train_on_new_feedback(config_path=str(cfg.source_file), return_state=True).result()
        assert result["trained"] and result["user"] == "alice" and result["version"] == 1, result
        assert result["promoted"] and result["reloaded"], result
        served = httpx.get(f"{cfg.gateway_url}/admin/users/alice/adapter", headers=admin(cfg)).json()
        assert served["version"] == 1
        after = {u: replies(cfg, k) for u, k in KEYS.items()}
        assert after["bob"] == before["bob"]  # the isolation target: bob's replies, token for token
        assert after["alice"] != before["alice"]  # hers moved: her own adapter
        assert registry.champion(cfg)[0] == 2  # the shared line is untouched
        assert Catalog.for_config(cfg).pending_users() == {"bob": 2}  # bob's wait: not his line, not alice's

    alice = registry.for_user(cfg, "alice")
    assert registry.model_name(alice) == "clawflow-tiny.alice" and registry.champion(alice)[0] == 1
    assert registry.user_lines(cfg) == ["alice"]
    runner = CliRunner(env={"COLUMNS": "200"})
    listed = runner.invoke(cli, ["versions", "--user", "alice", "--config", str(cfg.source_file)])
    assert listed.exit_code == 0 and "champion" in listed.output, listed.output
    none = runner.invoke(cli, ["versions", "--user", "bob", "--config", str(cfg.source_file)])
    assert none.exit_code == 0 and "bob has no adapter of their own" in none.output, none.output
    back = runner.invoke(cli, ["rollback", "--user", "alice", "--config", str(cfg.source_file)])
    assert back.exit_code == 1 and "previous" in back.output and registry.champion(alice)[0] == 1, back.output

    with running_gateway(cfg):  # a restarted gateway serves alice her champion again
        assert httpx.get(f"{cfg.gateway_url}/admin/users/alice/adapter", headers=admin(cfg)).json()["version"] == 1
        assert replies(cfg, KEYS["alice"]) == after["alice"] and replies(cfg, KEYS["bob"]) == before["bob"]

        # forgetting alice: her turns, preferences and adapter versions go; the gateway stops serving hers
        checkpoint = registry.champion(alice)[1]
        forgot_at = datetime.now(UTC)
        gone = runner.invoke(cli, ["forget", "--user", "alice", "--yes", "--config", str(cfg.source_file)])
        assert gone.exit_code == 0 and "1 adapter versions" in gone.output, gone.output
        assert httpx.get(f"{cfg.gateway_url}/admin/users/alice/adapter", headers=admin(cfg)).json()["path"] is None
        assert replies(cfg, KEYS["alice"]) == before["alice"]  # the shared policy again
    assert registry.user_lines(cfg) == [] and not Path(checkpoint).exists()
    assert PreferenceStore.for_config(cfg).load() == []
    left = [t for t in shard_rows(cfg.home / "shards") if t["user"] == "alice"]
    assert left and all(t["created_at"] > forgot_at for t in left)  # only what she said after being forgotten
