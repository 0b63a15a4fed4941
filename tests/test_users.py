"""Users: `clawflow users` gives each user a key; the gateway records each key's turns as its owner's."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from typer.testing import CliRunner

from _gateway_helpers import assert_error_json, client_for, sealed_turns
from clawflow.cli import app as cli
from clawflow.config import ConfigError, load_config
from clawflow.home import Home
from clawflow.users import KeyRefused, KeyResolver, UserFile
from conftest import running_gateway

runner = CliRunner(env={"COLUMNS": "200"})


def users(cfg, *args: str):
    return runner.invoke(cli, ["users", *args, "--config", str(cfg.source_file)])


def chat(cfg, key: str, text: str) -> httpx.Response:
    return httpx.post(f"{cfg.gateway_url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})


def test_each_key_records_its_own_user_and_removed_or_unknown_keys_get_401(make_config):
    carol_key = "carol-kept-in-config"
    cfg = make_config(serving={"users": {"carol": hashlib.sha256(carol_key.encode()).hexdigest()}})
    with running_gateway(cfg):
        added = users(cfg, "add", "alice")  # while the gateway runs: no restart needed
        assert added.exit_code == 0, added.output
        alice_key = added.output.strip().splitlines()[-1]
        assert alice_key.startswith("cf-") and len(alice_key) > 30

        for key, text in ((alice_key, "Alice speaks."), (cfg.serving.api_key, "The default key speaks."),
                          (carol_key, "Carol speaks.")):
            assert chat(cfg, key, text).status_code == 200
        client_for(cfg, alice_key).models.list()  # the OpenAI client authenticates with it too

        err = assert_error_json(chat(cfg, "cf-nobody", "Who?"), 401, "authentication_error")
        assert "API key" in err["message"]

        removed = users(cfg, "remove", "alice")
        assert removed.exit_code == 0 and "clawflow forget" in removed.output, removed.output
        err = assert_error_json(chat(cfg, alice_key, "Alice again."), 401, "authentication_error")
        assert "alice" in err["message"] and "removed" in err["message"]
        turns = {json.loads(t["messages"])[-1]["content"]: t["user"] for t in sealed_turns(cfg)}

    assert turns == {"Alice speaks.": "alice", "The default key speaks.": cfg.serving.user, "Carol speaks.": "carol"}
    stored = Home(cfg.home).users_file.read_text()
    assert alice_key not in stored and hashlib.sha256(alice_key.encode()).hexdigest() in stored
    listed = users(cfg, "list")
    assert listed.exit_code == 0 and alice_key not in listed.output
    assert all(word in listed.output for word in ("alice", "removed", "carol", cfg.serving.user))


@pytest.mark.parametrize("name, why", [
    ("bob", "already exists"),  # added just before
    ("default", "already exists"),  # serving.user (and the owner of pre-user turns)
    ("carol", "already exists"),  # serving.users
    ("gone", "was removed"),  # a removed user's name stays theirs
    ("a b", "1-64 characters"),
    ("x" * 65, "1-64 characters"),
])
def test_users_add_refuses_taken_and_bad_names(make_config, name, why):
    cfg = make_config(serving={"users": {"carol": "ab" * 32}})
    assert users(cfg, "add", "bob").exit_code == 0
    assert users(cfg, "add", "gone").exit_code == 0 and users(cfg, "remove", "gone").exit_code == 0
    before = Home(cfg.home).users_file.read_text()
    r = users(cfg, "add", name)
    assert r.exit_code != 0 and r.output.startswith("error:") and why in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert Home(cfg.home).users_file.read_text() == before


def test_users_remove_refuses_unknown_and_configured_users(make_config):
    cfg = make_config(serving={"users": {"carol": "ab" * 32}})
    for name in ("nobody", cfg.serving.user, "carol"):
        r = users(cfg, "remove", name)
        assert r.exit_code != 0 and r.output.startswith("error:"), r.output


def test_serving_users_must_be_hashes_of_distinct_keys_and_not_the_default_user(make_config):
    for bad, said in (({"eve": "not-a-hash"}, "SHA-256"), ({"Bad name": "ab" * 32}, "1-64"),
                      ({"a": "ab" * 32, "b": "AB" * 32}, "same key"), ({"default": "ab" * 32}, "serving.user")):
        with pytest.raises(ConfigError, match=said):
            make_config(serving={"users": bad})
    assert make_config(serving={"users": {"eve": "AB" * 32}}).serving.users == {"eve": "ab" * 32}


def test_an_unreadable_users_file_lets_no_file_user_in(make_config):
    cfg = make_config()
    key = UserFile(cfg.home).add("dan")
    keys = KeyResolver(cfg)
    assert keys.resolve(key) == "dan" and keys.resolve(cfg.serving.api_key) == cfg.serving.user
    Home(cfg.home).users_file.write_text("{not json")
    with pytest.raises(KeyRefused):
        keys.resolve(key)
    assert keys.resolve(cfg.serving.api_key) == cfg.serving.user
    assert load_config(cfg.source_file).serving.users == {}
