"""Users' own adapters through the gateway (issue #29): the admin route loads one user's adapter,
that user's key decodes with it and their turns record its version, every other key (and the
judge's internal route) keeps the shared policy; a refused adapter changes nothing."""

from __future__ import annotations

import hashlib
import shutil

import httpx
import pytest

from _adapters import make_adapters
from _gateway_helpers import assert_error_json, sealed_turns
from conftest import admin, running_gateway

PROMPT = "Tell me about the sea, in a few words."


def chat(cfg, key: str, text: str = PROMPT, internal: bool = False) -> dict:
    route = "/internal/v1/chat/completions" if internal else "/v1/chat/completions"
    r = httpx.post(f"{cfg.gateway_url}{route}", timeout=120, headers={"Authorization": f"Bearer {key}"},
                   json={"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
                         "logprobs": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["message"]["content"], "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]}


def same(a: dict, b: dict) -> bool:
    return a["text"] == b["text"] and all(abs(x - y) < 1e-3 for x, y in zip(a["logprobs"], b["logprobs"]))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("gw-adapters"))


def test_a_users_adapter_serves_only_their_key_and_their_turns_record_its_version(make_config, adapters, tmp_path):
    keys = {"alice": "alice-key", "bob": "bob-key"}
    cfg = make_config(serving={"users": {u: hashlib.sha256(k.encode()).hexdigest() for u, k in keys.items()}})
    url = f"{cfg.gateway_url}/admin/users/alice/adapter"
    with running_gateway(cfg):
        before = {u: chat(cfg, k) for u, k in keys.items()}
        assert same(before["alice"], before["bob"])  # nobody has an adapter yet: the shared policy

        assert httpx.post(url, json={"path": str(adapters["a0"]), "version": 5}).status_code == 401  # admin only
        r = httpx.post(url, json={"path": str(adapters["a0"]), "version": 5}, headers=admin(cfg), timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["path"], r.json()["version"]) == (str(adapters["a0"]), 5)
        alice, bob = chat(cfg, keys["alice"]), chat(cfg, keys["bob"])
        assert not same(alice, before["alice"])  # hers moved
        assert same(bob, before["bob"]) and same(chat(cfg, cfg.serving.api_key), before["bob"])  # nobody else's
        judge = chat(cfg, cfg.serving.admin_key, internal=True)  # internal callers: the shared policy
        assert same(judge, before["bob"])

        # a corrupt adapter for alice is refused: she keeps v5, nobody moves
        broken = tmp_path / "broken"
        shutil.copytree(adapters["a1"], broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
        err = assert_error_json(httpx.post(url, json={"path": str(broken), "version": 6}, headers=admin(cfg),
                                           timeout=60), 400, "invalid_request_error")
        assert err["code"] == "adapter_refused" and "alice keeps" in err["message"]
        assert httpx.get(url, headers=admin(cfg)).json()["version"] == 5
        assert same(chat(cfg, keys["alice"]), alice) and same(chat(cfg, keys["bob"]), bob)
        assert_error_json(httpx.post(f"{cfg.gateway_url}/admin/users/no%20one/adapter", headers=admin(cfg),
                                     json={"path": str(adapters["a0"])}), 400, "invalid_request_error")

        gone = httpx.delete(url, headers=admin(cfg), timeout=60)
        assert gone.status_code == 200 and gone.json()["path"] is None
        assert same(chat(cfg, keys["alice"], "Back to the shared policy."),
                    chat(cfg, keys["bob"], "Back to the shared policy."))
        turns = sealed_turns(cfg)

    served = {(t["user"], t["adapter_version"]) for t in turns}
    assert ("alice", 5) in served and ("alice", None) in served
    assert all(v is None for u, v in served if u != "alice")  # bob's and the default key's: the shared policy
    assert sum(t["user"] == "alice" and t["adapter_version"] == 5 for t in turns) == 2


def test_a_users_key_reads_and_exports_only_their_own_data(make_config, adapters):
    keys = {"alice": "alice-key", "bob": "bob-key"}
    cfg = make_config(serving={"users": {u: hashlib.sha256(k.encode()).hexdigest() for u, k in keys.items()}})
    base = cfg.gateway_url + "/v1/clawflow"

    def get(path: str, key: str, **params):
        return httpx.get(base + path, params=params, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    with running_gateway(cfg):
        for u, k in keys.items():  # both use session id "shared": neither may see the other's turn in it
            r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {k}", "X-Session-Id": "shared"},
                           json={"messages": [{"role": "user", "content": f"{u} says hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
        httpx.post(f"{cfg.gateway_url}/admin/users/alice/adapter", headers=admin(cfg), timeout=60,
                   json={"path": str(adapters["a0"]), "version": 4}).raise_for_status()
        sealed_turns(cfg)

        me = get("/me", keys["alice"]).json()
        assert (me["user"], me["adapter_version"], me["preferences"]) == ("alice", 4, [])
        assert get("/me", keys["bob"]).json()["adapter_version"] is None
        exported = get("/export", keys["alice"])
        assert exported.status_code == 200
        rows = [line for line in exported.text.splitlines() if line]
        assert len(rows) == 1 and '"alice says hi"' in rows[0] and "bob says hi" not in exported.text

        err = assert_error_json(get("/export", keys["bob"], user="alice"), 403, "permission_error")
        assert "own data" in err["message"]
        assert_error_json(get("/me", "cf-nobody"), 401, "authentication_error")
        as_admin = get("/export", cfg.serving.admin_key, user="bob")  # the admin key reads anyone's
        assert as_admin.status_code == 200 and "bob says hi" in as_admin.text and "alice" not in as_admin.text
        assert get("/me", cfg.serving.admin_key, user="alice").json()["adapter_version"] == 4


def test_rollback_of_a_users_line_reloads_only_their_adapter(make_config, adapters):
    from typer.testing import CliRunner

    from clawflow.cli import app as cli
    from clawflow.policy import registry

    keys = {"alice": "alice-key", "bob": "bob-key"}
    cfg = make_config(serving={"users": {u: hashlib.sha256(k.encode()).hexdigest() for u, k in keys.items()}})
    alice = registry.for_user(cfg, "alice")
    for i, name in enumerate(("a0", "a1"), start=1):  # her v1 and v2, v2 promoted
        run = registry.start_run(alice, f"alice-v{i}", {}, {})
        assert registry.register_checkpoint(alice, run, adapters[name], {}) == i
        registry.promote(alice, i)
    runner = CliRunner(env={"COLUMNS": "200"})
    url = f"{cfg.gateway_url}/admin/users/alice/adapter"
    with running_gateway(cfg):  # it starts on her champion, v2
        assert httpx.get(url, headers=admin(cfg)).json()["version"] == 2
        on_v2, bob = chat(cfg, keys["alice"]), chat(cfg, keys["bob"])
        back = runner.invoke(cli, ["rollback", "--user", "alice", "--config", str(cfg.source_file)])
        assert back.exit_code == 0 and "reloaded" in back.output, back.output
        assert httpx.get(url, headers=admin(cfg)).json()["version"] == 1 and registry.champion(alice)[0] == 1
        assert not same(chat(cfg, keys["alice"]), on_v2) and same(chat(cfg, keys["bob"]), bob)
    assert registry.champion(cfg) is None  # the shared line was never touched
