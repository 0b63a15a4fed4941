"""Users' own adapters in the embedded engine (issue #29): requests of several users, interleaved in
one batch, each decode exactly what an engine serving only that user's adapter (or the base)
decodes; one user's new adapter, a refused one, or a reload of the shared weights leaves the other
users' replies token for token as they were."""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import wait

import pytest

from _adapters import make_adapters
from clawflow.serving.engine import TorchEngine
from clawflow.serving.generation import SamplingParams
from clawflow.serving.multi_lora import AdapterError

# shared by every user, longer than the prefix cache's 16-token minimum: a cached prompt of one
# adapter must never serve another's
PROMPTS = [random.Random(i).sample(range(100, 20000), 40) for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


class Reply:
    """A greedy reply's tokens and their logprobs: the same tokens, logprobs within rounding (the
    grouped deltas and peft's add in another order). The random tiny model often repeats one token,
    so the logprobs are what shows a decode step that missed its adapter."""

    def __init__(self, gen):
        self.ids, self.logprobs = gen.token_ids, gen.logprobs

    def __eq__(self, other):
        return self.ids == other.ids and all(abs(a - b) < 1e-3 for a, b in zip(self.logprobs, other.logprobs))

    def __repr__(self):
        return f"Reply({self.ids}, {[round(x, 4) for x in self.logprobs]})"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("user-adapters"))


@pytest.fixture(scope="module")
def alone(tiny_model_dir, adapters, tmp_path_factory):
    """Each prompt's greedy reply from an engine serving only the base, or one adapter merged into
    full weights by peft (an independent reference: no LoRA path of the engine is involved)."""
    from clawflow.train.lora import merge

    merged = tmp_path_factory.mktemp("merged")
    out = {}
    for name, path in [("base", tiny_model_dir), *adapters.items()]:
        engine = TorchEngine(str(path if name == "base" else merge(path, merged / name)), threads=1)
        try:
            out[name] = [Reply(engine.generate(p, GREEDY)) for p in PROMPTS]
        finally:
            engine.close()
    return out


def _interleaved(engine, users: list[str | None]) -> dict[str | None, list[Reply]]:
    """Every user's reply to every prompt, all submitted at once (twice: the second round hits the
    prefix cache), so the users' rows share batches and forwards."""
    replies: dict[str | None, list[Reply]] = {}
    for _ in range(2):
        futures = {(u, i): engine.submit(p, GREEDY, user=u) for i, p in enumerate(PROMPTS) for u in users}
        wait(futures.values())
        for u in users:
            replies[u] = [Reply(futures[(u, i)].result()) for i in range(len(PROMPTS))]
    return replies


def test_interleaved_users_each_get_their_own_adapter(tiny_model_dir, adapters, alone, tmp_path):
    engine = TorchEngine(tiny_model_dir, threads=1, max_batch=16)
    try:
        before = _interleaved(engine, ["carol"])["carol"]
        assert before == alone["base"]
        engine.load_user_adapter("alice", str(adapters["a0"]))
        info = engine.load_user_adapter("bob", str(adapters["a1"]))
        assert info["bytes"] > 0 and engine.user_adapter("bob") == str(adapters["a1"])
        got = _interleaved(engine, ["alice", "bob", "carol", None])
        assert got["alice"] == alone["a0"] and got["bob"] == alone["a1"]
        assert got["carol"] == got[None] == before  # the isolation target: carol's replies, token for token
        assert alone["a0"] != alone["base"] and alone["a1"] != alone["base"]  # the adapters do change replies
        assert _interleaved(engine, ["bob"])["bob"] == alone["a1"]  # every row on one adapter: no gather

        # alice's next version: hers move, the others' do not; the old one is dropped once unused. Her
        # cached prompts were re-warmed with it before it served her: her next turns reuse that KV.
        info = engine.load_user_adapter("alice", str(adapters["a2"]))
        assert info["rewarm"]["ok"] and info["rewarm"]["prompts"] == len(PROMPTS), info
        hits = engine.stats().prefix_cache_hits
        assert [Reply(engine.generate(p, GREEDY, user="alice")) for p in PROMPTS] == alone["a2"]
        assert engine.stats().prefix_cache_hits - hits == len(PROMPTS)
        got = _interleaved(engine, ["alice", "bob", "carol"])
        assert got["alice"] == alone["a2"] and got["bob"] == alone["a1"] and got["carol"] == before
        multi = engine._policy.model.clawflow_multi_lora
        assert {key[0] for key in multi.keys()} == {"alice", "bob"} and len(multi.keys()) == 2

        # a corrupt adapter for bob is refused: bob keeps his, nobody else moves
        broken = tmp_path / "broken"
        shutil.copytree(adapters["a0"], broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
        with pytest.raises(AdapterError):
            engine.load_user_adapter("bob", str(broken))
        got = _interleaved(engine, ["alice", "bob", "carol"])
        assert got["alice"] == alone["a2"] and got["bob"] == alone["a1"] and got["carol"] == before

        # the shared weights reloaded while a replaced adapter still waits to be dropped: every user's
        # adapter rides on, and the re-warm is not held up by the drop (which waits for the reload)
        # The users' prompts are re-warmed on the new weights with their own adapters, so their next
        # turns reuse that KV (and decode what their adapter alone decodes from it).
        engine.load_user_adapter("alice", str(adapters["a2"]))
        _interleaved(engine, ["alice"])  # her prompts cached under her new adapter version
        assert engine.reload(tiny_model_dir, 1) < 20 and engine.last_rewarm["ok"] and engine.last_rewarm["prompts"]
        assert engine.last_rewarm["users_prompts"] >= 2 * len(PROMPTS)  # alice's and bob's
        hits = engine.stats().prefix_cache_hits
        got = {u: [Reply(engine.generate(p, GREEDY, user=u)) for p in PROMPTS] for u in ("alice", "bob", "carol")}
        assert engine.stats().prefix_cache_hits - hits == 3 * len(PROMPTS)  # every turn found its re-warmed KV
        assert got["carol"] == before
        assert got["bob"] == alone["a1"]
        assert got["alice"] == alone["a2"]

        engine.unload_user_adapter("alice")
        assert engine.user_adapter("alice") is None
        assert _interleaved(engine, ["alice"])["alice"] == before
    finally:
        engine.close()


def test_a_lora_shared_policy_and_users_adapters_trained_on_the_same_base(tiny_model_dir, adapters, alone,
                                                                            tmp_path):
    """The shared policy is an adapter itself (the shipped LoRA recipe's champion): a user's adapter,
    trained on the base, replaces it on that user's rows (base + theirs, not base + shared + theirs),
    and a reload of the shared adapter moves only the rows that have none."""
    engine = TorchEngine(str(adapters["a1"]), threads=1, max_batch=16)
    try:
        engine.load_user_adapter("alice", str(adapters["a0"]))
        got = _interleaved(engine, ["alice", "carol", None])
        assert got["alice"] == alone["a0"] and got["carol"] == got[None] == alone["a1"]
        assert engine.score(PROMPTS[0], alone["a1"][0].ids) == pytest.approx(alone["a1"][0].logprobs, abs=1e-3)

        engine.reload(str(adapters["a2"]), 2)  # the shared policy's next version
        got = _interleaved(engine, ["alice", "carol"])
        assert got["alice"] == alone["a0"] and got["carol"] == alone["a2"]

        # an adapter trained on other weights would ride on the wrong model: refused, alice keeps hers
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(adapters["a2"], elsewhere)
        cfg = json.loads((elsewhere / "adapter_config.json").read_text())
        (elsewhere / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(tmp_path)}))
        with pytest.raises(AdapterError, match="trained on"):
            engine.load_user_adapter("alice", str(elsewhere))
        assert _interleaved(engine, ["alice"])["alice"] == alone["a0"]
    finally:
        engine.close()


def test_a_shared_adapter_served_with_peft_refuses_users_adapters(tiny_model_dir, adapters, alone, tmp_path):
    """An adapter the per-row path cannot apply exactly (here a per-module rank) is served with peft;
    users' adapters are then refused, with the reason, and everyone gets the shared policy."""
    odd = tmp_path / "odd"
    shutil.copytree(adapters["a1"], odd)
    cfg = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**cfg, "rank_pattern": {"q_proj": cfg["r"]}}))
    engine = TorchEngine(str(odd), threads=1)
    try:
        assert hasattr(engine._policy.model, "peft_config")
        with pytest.raises(AdapterError, match="served with peft"):
            engine.load_user_adapter("alice", str(adapters["a0"]))
        assert Reply(engine.generate(PROMPTS[0], GREEDY, user="alice")) == alone["a1"][0]
    finally:
        engine.close()


def test_the_least_recently_used_adapter_is_dropped_and_loaded_again_on_its_next_request(tiny_model_dir, adapters,
                                                                                          alone):
    engine = TorchEngine(tiny_model_dir, threads=1, max_loaded_adapters=2)
    try:
        engine.load_user_adapter("alice", str(adapters["a0"]))
        engine.load_user_adapter("bob", str(adapters["a1"]))
        assert _interleaved(engine, ["bob"])["bob"] == alone["a1"]  # bob used last: alice is the LRU
        engine.load_user_adapter("dave", str(adapters["a2"]))
        multi = engine._policy.model.clawflow_multi_lora
        _interleaved(engine, [None])  # a pass of the decode loop drops what was retired
        assert {key[0] for key in multi.keys()} == {"bob", "dave"}
        assert engine.user_adapter("alice") == str(adapters["a0"])  # still hers, not held
        got = _interleaved(engine, ["alice", "dave"])  # alice's comes back; bob, now the LRU, goes
        assert got["alice"] == alone["a0"] and got["dave"] == alone["a2"]
        assert {key[0] for key in multi.keys()} == {"alice", "dave"}
        assert _interleaved(engine, ["bob"])["bob"] == alone["a1"]
    finally:
        engine.close()
