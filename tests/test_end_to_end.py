"""One real turn from the openai SDK to reloaded weights: gateway → WAL → shard → DuckDB → judge →
torchrun training → MLflow version `champion` → hot reload, under a real Prefect API."""

from __future__ import annotations

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from openai import OpenAI

from clawflow.policy import registry
from conftest import admin, policy_version, running_gateway
from flows.rollback_policy import rollback_policy
from flows.train_on_new_feedback import train_on_new_feedback

FIXED = [{"role": "user", "content": "Say hello."}]


def fixed_reply_logprob(app) -> float:
    engine = app.state.gateway.engine
    prompt = engine.encode_chat(FIXED)
    reply = engine.tokenizer.encode("Hello there! How can I help?", add_special_tokens=False)
    return sum(engine.score(prompt, reply))


def test_conversation_trains_registers_and_reloads(make_config, prefect_api):
    cfg = make_config()
    with running_gateway(cfg) as app:
        client = OpenAI(base_url=f"{cfg.gateway_url}/v1", api_key=cfg.serving.api_key)
        # A three-turn conversation without session headers: the gateway infers the session.
        history = [{"role": "user", "content": "Write a haiku about the sea."}]
        r1 = client.chat.completions.create(model="clawflow-tiny", messages=history, seed=1)
        history += [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "No, that's wrong. Make it shorter, please."}]
        r2 = client.chat.completions.create(model="clawflow-tiny", messages=history, seed=2)
        history += [{"role": "assistant", "content": r2.choices[0].message.content},
                    {"role": "user", "content": "Thanks, perfect!"}]
        client.chat.completions.create(model="clawflow-tiny", messages=history, seed=3)

        httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg)).raise_for_status()
        shards = sorted((cfg.home / "shards").rglob("*.parquet"))  # the background sealer may have made some
        table = pa.concat_tables(pq.read_table(p) for p in shards)
        assert table.num_rows == 3
        assert len(set(table.column("session_id").to_pylist())) == 1  # inferred as one session
        assert sorted(table.column("turn_index").to_pylist()) == [0, 1, 2]

        before = fixed_reply_logprob(app)
        assert policy_version(cfg) == 0
        result = train_on_new_feedback(config_path=str(cfg.source_file))

        assert result["trained"] and result["version"] == 1 and result["promoted"], result
        assert result["samples"] == 2 and result["reward_mean"] == 0.0  # one −1 (correction), one +1 (thanks)
        assert result["reloaded"] is True
        assert policy_version(cfg) == 1
        assert fixed_reply_logprob(app) != before  # the served weights changed

        version, path = registry.resolve(cfg, "champion")
        assert version == 1 and path.endswith(result["mlflow_run"])

        again = train_on_new_feedback(config_path=str(cfg.source_file))
        assert again == {"trained": False, "reason": "no new turns with a next state"}
        assert registry.champion(cfg)[0] == 1
        assert policy_version(cfg) == 1

        # A candidate the gate rejects stays registered, tagged, and never reaches users.
        history = [{"role": "user", "content": "Tell me a joke."}]
        r = client.chat.completions.create(model="clawflow-tiny", messages=history, seed=4)
        history += [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "That's wrong, try again."}]
        client.chat.completions.create(model="clawflow-tiny", messages=history, seed=5)
        httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg))
        strict = yaml.safe_load(cfg.source_file.read_text())
        strict["gate"] = {"max_kl": -1.0}
        strict_path = cfg.source_file.with_name("strict.yaml")
        strict_path.write_text(yaml.safe_dump(strict))
        rejected = train_on_new_feedback(config_path=str(strict_path))
        assert rejected["trained"] and rejected["version"] == 2 and not rejected["promoted"]
        assert "max_kl" in rejected["gate"] and rejected["reloaded"] is False
        assert registry.champion(cfg)[0] == 1 and policy_version(cfg) == 1
        tags = {r["version"]: r["tags"] for r in registry.list_versions(cfg)}
        assert tags[2]["gate"] == "rejected" and "max_kl" in tags[2]["rejected"] and tags[1]["gate"] == "passed"

        # rollback-policy serves a chosen version, then moves back to `previous`.
        moved = rollback_policy(version=2, config_path=str(cfg.source_file))
        assert moved == {"from_version": 1, "to_version": 2, "path": registry.resolve(cfg, 2)[1], "reloaded": True}
        assert policy_version(cfg) == 2
        back = rollback_policy(config_path=str(cfg.source_file))
        assert (back["from_version"], back["to_version"]) == (2, 1)
        assert policy_version(cfg) == 1 and registry.resolve(cfg, "previous")[0] == 2
