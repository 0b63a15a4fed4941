"""Re-warm on reload (clawflow/serving/rewarm.py): the hottest cached prompts are prefilled with the
new weights before the swap, so the first request after a reload is a prefix-cache hit on the new
version, with the KV a fresh prefill of the new weights gives; a failing or late re-warm swaps cold;
entries never cross versions; prompts longer than the cache are served uncached."""

from __future__ import annotations

import time

import pytest
import torch

from clawflow.serving import rewarm as rewarm_mod
from clawflow.serving.engine import SamplingParams, TorchEngine
from clawflow.serving.prefix_cache import PrefixCache
from _gateway_helpers import close, hf_model, logprobs_under
from test_prefix_cache import SYSTEM, kv


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def chat(engine, question: str, system: str = SYSTEM) -> list[int]:
    return engine.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])


@pytest.fixture
def engine(tiny_model_dir):
    e = TorchEngine(tiny_model_dir, max_batch=4, max_queue=4, prefix_cache_min_tokens=8)
    yield e
    e.close()


# -- the cache's heat ----------------------------------------------------------------------------
def test_hottest_ranks_by_reuse_then_recency_and_a_next_turn_inherits_heat():
    c = PrefixCache(max_tokens=100, min_tokens=1)
    c.store(0, [1, 1, 1], kv([1, 1, 1]))
    c.store(0, [2, 2, 2], kv([2, 2, 2]))
    c.store(0, [3, 3, 3], kv([3, 3, 3]))
    c.store(1, [4, 4, 4], kv([4, 4, 4]))
    for _ in range(2):
        c.lookup(0, [1, 1, 1, 9])
    assert c.hottest(0) == [(1, 1, 1), (3, 3, 3), (2, 2, 2)]  # reused twice, then the most recent
    c.store(0, [2, 2, 2, 5], kv([2, 2, 2, 5]))  # the next turn of chat 2 supersedes its entry
    c.lookup(0, [2, 2, 2, 5, 6])
    c.lookup(0, [2, 2, 2, 5, 6])
    c.lookup(0, [2, 2, 2, 5, 6])
    assert c.hottest(0)[0] == (2, 2, 2, 5) and c.hottest(1) == [(4, 4, 4)]
    assert [t for t, _ in c.entries(1)] == [(4, 4, 4)]


def test_kv_that_does_not_cover_its_tokens_is_never_stored_or_served():
    c = PrefixCache(max_tokens=100, min_tokens=1)
    with pytest.raises(ValueError):
        c.store(0, [1, 2, 3, 4], kv([1, 2, 3]))
    c.store(0, [1, 2, 3, 4], kv([1, 2, 3, 4]))
    key = next(iter(c._entries))
    c._entries[key] = kv([1, 2])  # damaged behind the cache's back
    assert c.lookup(0, [1, 2, 3, 4, 5]) == (0, None) and len(c) == 0


# -- the engine on the tiny model ----------------------------------------------------------------
def test_after_a_reload_the_hot_prompt_is_a_hit_with_the_new_weights_kv(engine, tiny_model_dir, perturbed_model_dir):
    prefix = engine.batcher.prefix
    hot, cold = chat(engine, "Where are the atlases?"), chat(engine, "Poetry?", system="Another shop entirely.")
    engine.generate(cold, greedy())
    engine.generate(hot, greedy())
    hot = hot + [42]
    engine.generate(hot, greedy())  # reuses the first turn, supersedes it and inherits its heat
    assert prefix.hottest(0)[0] == tuple(hot) and len(prefix) == 2

    engine.reload(perturbed_model_dir, version=1)
    info = engine.last_rewarm
    assert info["ok"] and info["complete"] and info["prompts"] == 2, info
    staged = {tokens: layers for _, tokens, layers in engine.batcher._staged[1]}  # the shared policy's: no adapter
    fresh = hf_model(perturbed_model_dir)(torch.tensor([list(hot)]), use_cache=True).past_key_values
    for (k, v), layer in zip(staged[tuple(hot)], fresh.layers):  # the KV a fresh prefill of v1 gives
        assert torch.allclose(k, layer.keys, atol=1e-5) and torch.allclose(v, layer.values, atol=1e-5)

    hits = prefix.hits
    g = engine.generate(hot + [7, 8], greedy())
    assert prefix.hits == hits + 1 and prefix.reused_tokens >= len(hot)  # warm on the new version
    assert prefix.versions() == {1}  # v0's entries are gone, not just skipped
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, hot + [7, 8], g.token_ids), 1e-4)
    plain = TorchEngine(perturbed_model_dir, prefix_cache_tokens=0)
    try:
        assert plain.generate(hot + [7, 8], greedy()).token_ids == g.token_ids
    finally:
        plain.close()


def test_shared_system_prompt_is_prefilled_once_and_the_budget_keeps_a_prefix(engine, perturbed_model_dir):
    a, b = chat(engine, "Where are the atlases?"), chat(engine, "Do you sell maps of Mars, or globes?")
    engine.generate(a, greedy(1))
    engine.generate(b, greedy(1))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    engine.reload(perturbed_model_dir, version=1)
    info = engine.last_rewarm
    assert info["prompts"] == 2 and info["prefilled"] <= len(a) + len(b) - shared + 1, info

    engine.rewarm_tokens = shared  # room for the shared prefix only
    engine.reload(perturbed_model_dir, version=2)
    info = engine.last_rewarm
    assert info["ok"] and not info["complete"] and info["prefilled"] == shared, info
    hits, reused = engine.batcher.prefix.hits, engine.batcher.prefix.reused_tokens
    g = engine.generate(a, greedy(3))
    assert engine.batcher.prefix.hits == hits + 1 and engine.batcher.prefix.reused_tokens - reused == shared
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, a, g.token_ids), 1e-4)


def test_prompts_shorter_than_rewarm_min_tokens_are_left_to_prefill_on_demand(engine, perturbed_model_dir):
    short, long = chat(engine, "Atlases?"), chat(engine, "Do you sell maps of Mars, or globes? " * 6)
    engine.generate(short, greedy(1))
    engine.generate(long, greedy(1))
    engine.rewarm_min_tokens = len(short) + 1
    engine.reload(perturbed_model_dir, version=1)
    info = engine.last_rewarm
    assert info["ok"] and info["prompts"] == 1 and info["tokens"] == len(long), info
    reused = engine.batcher.prefix.reused_tokens
    g = engine.generate(short, greedy(1))  # at most the shared system prompt is reused; the rest prefills now
    assert engine.batcher.prefix.reused_tokens - reused < len(short) - 1
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, short, g.token_ids), 1e-4)


@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
def test_a_failing_rewarm_swaps_cold(engine, perturbed_model_dir, monkeypatch, caplog, error):
    p = chat(engine, "Atlases?")
    engine.generate(p, greedy())

    def broken(self, chunk):
        raise error("out of memory (simulated)")

    monkeypatch.setattr(rewarm_mod.RewarmJob, "step", broken)
    engine.reload(perturbed_model_dir, version=1)
    assert engine.policy_version == 1 and not engine.last_rewarm["ok"]
    assert "out of memory" in engine.last_rewarm["error"] and "swapping cold" in caplog.text
    hits = engine.batcher.prefix.hits
    g = engine.generate(p, greedy())
    assert engine.batcher.prefix.hits == hits  # cold: nothing of v0 reused
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, p, g.token_ids), 1e-4)


def test_a_rewarm_past_its_deadline_keeps_what_it_has_and_the_reload_goes_on(engine, perturbed_model_dir):
    p = chat(engine, "Atlases?")
    engine.generate(p, greedy())
    engine.rewarm_max_s = 1e-6
    t0 = time.perf_counter()
    engine.reload(perturbed_model_dir, version=1)
    assert time.perf_counter() - t0 < 30 and engine.policy_version == 1
    assert engine.last_rewarm["ok"] and not engine.last_rewarm["complete"]
    g = engine.generate(p, greedy())
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, p, g.token_ids), 1e-4)


def test_same_version_number_other_weights_rewarms_for_the_new_model(engine, tiny_model_dir, perturbed_model_dir):
    p = chat(engine, "Atlases?")
    engine.reload(perturbed_model_dir, version=1)
    engine.generate(p, greedy())
    engine.reload(tiny_model_dir, version=1)  # the same number, other weights
    hits = engine.batcher.prefix.hits
    g = engine.generate(p, greedy())
    assert engine.batcher.prefix.hits == hits + 1  # warm: re-warmed by the model now serving
    assert close(g.logprobs, logprobs_under(tiny_model_dir, p, g.token_ids), 1e-4)


def test_a_prompt_longer_than_the_cache_is_served_uncached(tiny_model_dir, perturbed_model_dir):
    e = TorchEngine(tiny_model_dir, max_batch=2, max_queue=2, prefix_cache_tokens=32, prefix_cache_min_tokens=8)
    try:
        p = chat(e, "Which shelf has the atlases, the maps and the globes, please?")
        assert len(p) > 32
        g = e.generate(p, greedy())
        assert e.batcher.prefix.tokens == 0 and g.finish_reason in ("length", "stop")
        e.reload(perturbed_model_dir, version=1)
        assert e.last_rewarm == {**e.last_rewarm, "ok": True, "prompts": 0}
        g = e.generate(p, greedy())
        assert close(g.logprobs, logprobs_under(perturbed_model_dir, p, g.token_ids), 1e-4)
    finally:
        e.close()


def test_requests_are_served_by_the_old_version_while_a_rewarm_runs(engine, perturbed_model_dir, monkeypatch):
    """A slow re-warm (the new weights cost 10 ms more a token) over several hot prompts: a request
    sent meanwhile is served, by the old version, before the reload returns."""
    import threading

    for q in ("Atlases?", "Poetry?", "Maps?", "Globes?", "Cookbooks?", "Novels?"):
        engine.generate(chat(engine, q, system=f"{SYSTEM} ({q})"), greedy(1))
    slow_new_weights(engine, monkeypatch, per_token=0.01)
    reload = threading.Thread(target=engine.reload, args=(perturbed_model_dir, 1))
    reload.start()
    time.sleep(0.15)
    g = engine.generate(chat(engine, "Open on Sundays?"), greedy(6))
    assert reload.is_alive() and g.policy_version == 0 and len(g.token_ids) == 6
    reload.join(60)
    assert engine.policy_version == 1 and engine.last_rewarm["ok"] and engine.last_rewarm["prompts"] >= 1


# -- no turn waits behind a reload (issue 28) ----------------------------------------------------
PER_TOKEN_S = 0.003  # what the new weights cost per token: a slow machine's prefill, measurable here


def long_system(engine, tokens: int = 1500) -> str:
    """A system prompt of about `tokens` tokens (the tiny model's context is 2,048), varied text."""
    words = ("atlases", "poetry", "maps", "globes", "cookbooks", "novels", "comics", "journals", "letters")
    rules, i = [SYSTEM], 0
    while len(engine.tokenizer(" ".join(rules))["input_ids"]) < tokens:
        rules.append(f"Rule {i}: shelve the {words[i % 9]} by author, then by title, on row {i * 7 % 31}.")
        i += 1
    return " ".join(rules)


def slow_new_weights(engine, monkeypatch, per_token: float = PER_TOKEN_S) -> None:
    """Every model the engine loads from here on costs `per_token` more seconds per input token,
    spread over its decoder layers (a hook on each layer's real input norm, which every forward runs:
    the fused step's and transformers')."""
    load = engine._load

    def slow_load(path):
        model = load(path)
        layers = model.model.layers
        for layer in layers:
            layer.input_layernorm.register_forward_hook(
                lambda m, args, out: time.sleep(args[0].numel() // args[0].shape[-1] * per_token / len(layers)))
        return model

    monkeypatch.setattr(engine, "_load", slow_load)


def sampled(n: int) -> SamplingParams:  # seeded: the random tiny model rarely says EOS, and the tokens repeat
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=11)


def start_reload(engine, path: str, version: int):
    """A reload in a thread, returned 0.2 s after its re-warm started (prefilling alone: nothing else runs)."""
    import threading

    reload = threading.Thread(target=engine.reload, args=(path, version))
    reload.start()
    deadline = time.monotonic() + 60
    while not ((job := engine.batcher._rewarm) is not None and job.started):
        assert time.monotonic() < deadline and reload.is_alive(), "the re-warm never started"
        time.sleep(0.005)
    time.sleep(0.2)
    return reload


def served_alone(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    plain = TorchEngine(model_dir, prefix_cache_tokens=0)
    try:
        return plain.generate(prompt, params).token_ids
    finally:
        plain.close()


@pytest.mark.parametrize("layered", [True, False], ids=["by-layer", "by-chunk"])
def test_a_turn_sent_during_a_long_rewarm_is_served_long_before_it_ends(engine, tiny_model_dir, perturbed_model_dir,
                                                                        monkeypatch, layered):
    """The re-warm of one ~1.5k-token prompt on slow new weights takes seconds and starts alone; a
    turn sharing its system prompt, sent meanwhile, waits at most a step or two: it is served by the
    old version (whose cached KV of that prompt it reuses) well before the re-warm ends, with the
    tokens it gets alone; and the re-warm still completes, so the new version's cache holds the prompt.
    by-layer: the Llama-family path (steps stop between decoder layers); by-chunk: any other model's
    (transformers' forward, a chunk a step; the tiny Llama taken for one here)."""
    if not layered:
        monkeypatch.setattr(rewarm_mod.fused_step, "supports", lambda model: False)
    system = long_system(engine)
    hot = chat(engine, "Where are the atlases?", system=system)
    engine.generate(hot, greedy(1))
    turn = chat(engine, "Open on Sundays?", system=system)
    shared = next(i for i, (x, y) in enumerate(zip(hot, turn)) if x != y)
    assert shared > 1400

    slow_new_weights(engine, monkeypatch)
    reload = start_reload(engine, perturbed_model_dir, 1)
    prefix = engine.batcher.prefix
    hits, reused = prefix.hits, prefix.reused_tokens
    t0 = time.perf_counter()
    g = engine.generate(turn, sampled(8))
    latency = time.perf_counter() - t0
    assert reload.is_alive(), "the turn waited for the whole re-warm"
    reload.join(120)
    info = engine.last_rewarm
    # the re-warm alone: >= 1.4k tokens x 3 ms; the turn: a step in progress + its allowance + its own work
    assert info["ok"] and info["complete"] and info["seconds"] > 1400 * PER_TOKEN_S, info
    assert latency < info["seconds"] / 4, (latency, info)
    assert info["chunks"] > 5, info  # it was chunked although it started alone
    assert g.policy_version == 0 and prefix.hits == hits + 1 and prefix.reused_tokens - reused >= shared - 1
    assert g.token_ids == served_alone(tiny_model_dir, turn, sampled(8))

    hits, reused = prefix.hits, prefix.reused_tokens  # the new version's cache holds the re-warmed prompt
    g = engine.generate(turn, greedy(3))
    assert g.policy_version == 1 and prefix.hits == hits + 1 and prefix.reused_tokens - reused >= shared
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, turn, g.token_ids), 1e-4)


def test_a_long_stream_lends_the_rewarm_at_most_its_allowance(engine, tiny_model_dir, perturbed_model_dir,
                                                              monkeypatch):
    """A stream that outlasts its allowance: the re-warm gives way to it (it yields) once the stream
    has waited `rewarm_yield_s` behind it, so its three longest pauses together stay within that and a
    step, its tokens are those it gets alone, and it ends before the reload; the re-warm completes."""
    system = long_system(engine, 1000)
    engine.generate(chat(engine, "Where are the atlases?", system=system), greedy(1))
    turn = chat(engine, "Tell me about every shelf.", system=system)
    slow_new_weights(engine, monkeypatch)
    reload = start_reload(engine, perturbed_model_dir, 1)
    stamps: list[float] = []
    t0 = time.perf_counter()
    g = engine.batcher.submit(turn, sampled(150), lambda *_: stamps.append(time.perf_counter()) or True).result(120)
    assert reload.is_alive(), "the stream waited for the whole re-warm"
    reload.join(120)
    # what the stream waited behind re-warm steps shows as a few long pauses between its tokens
    gaps = [b - a for a, b in zip([t0, *stamps], stamps)]
    slack = 0.5  # a busy machine's scheduling noise; the re-warm alone takes several seconds
    assert sum(sorted(gaps)[-3:]) < engine.batcher.rewarm_yield_s + engine.batcher.rewarm_slice_s + slack, gaps
    info = engine.last_rewarm
    assert info["ok"] and info["complete"] and info["yielded"] > 0, info
    assert len(stamps) == 150 and g.token_ids == served_alone(tiny_model_dir, turn, sampled(150))


def test_a_rewarm_stopped_by_its_deadline_mid_chunk_keeps_a_whole_prefix(engine, perturbed_model_dir, monkeypatch):
    """The deadline falls while a chunk is part-way through the new model's layers: the job keeps
    the prefix every layer holds, and the new version serves from it with its own weights' KV."""
    system = long_system(engine)
    hot = chat(engine, "Where are the atlases?", system=system)
    engine.generate(hot, greedy(1))
    slow_new_weights(engine, monkeypatch)
    engine.rewarm_max_s = 1.5  # of the ~4.5 s it needs
    engine.reload(perturbed_model_dir, version=1)
    info = engine.last_rewarm
    assert info["ok"] and not info["complete"] and 8 <= info["tokens"] < len(hot) - 100, info
    prefix = engine.batcher.prefix
    hits, reused = prefix.hits, prefix.reused_tokens
    g = engine.generate(hot, greedy(3))
    assert prefix.hits == hits + 1 and prefix.reused_tokens - reused == info["tokens"]
    assert close(g.logprobs, logprobs_under(perturbed_model_dir, hot, g.token_ids), 1e-4)
