"""The prefix KV cache: the pure LRU (clawflow/serving/prefix_cache.py), then the batcher with it on the
real tiny model (a hit changes no token and no logprob), reloads, and the gateway's counters."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from clawflow.serving.engine import SamplingParams, TorchEngine
from clawflow.serving.prefix_cache import PrefixCache, common_prefix
from _gateway_helpers import MODEL, close, logprobs_under, metrics, user

SYSTEM = ("You are a careful assistant for a bookshop. Answer in one short sentence, name the shelf, "
          "never invent a title, and ask for the author's name when the title is ambiguous.")


# -- the pure cache ----------------------------------------------------------------------------
def kv(tokens, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer KV whose value at position i is the token there (so a slice shows what it holds)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t + 1000 * i, -t - 1000 * i) for i in range(layers)]


def test_longest_prefix_wins_and_the_slices_hold_that_prefix():
    c = PrefixCache(max_tokens=100, min_tokens=2)
    c.store(0, [1, 2, 3, 9, 9], kv([1, 2, 3, 9, 9]))
    c.store(0, [1, 2, 3, 4, 5, 8], kv([1, 2, 3, 4, 5, 8]))
    n, layers = c.lookup(0, [1, 2, 3, 4, 5, 6, 7])
    assert n == 5 and len(layers) == 2
    assert layers[1][0].flatten().tolist() == [1001, 1002, 1003, 1004, 1005]
    assert layers[1][1].flatten().tolist() == [-1001, -1002, -1003, -1004, -1005]
    assert c.lookup(0, [7, 1, 2, 3]) == (0, None)
    assert (c.lookups, c.hits, c.reused_tokens) == (2, 1, 5)


def test_at_least_one_token_is_left_to_prefill():
    c = PrefixCache(max_tokens=100, min_tokens=2)
    c.store(0, [1, 2, 3, 4], kv([1, 2, 3, 4]))
    assert c.lookup(0, [1, 2, 3, 4])[0] == 3  # the same prompt again: its last token still runs
    assert c.lookup(0, [1, 2, 3])[0] == 2  # a prefix of the entry
    assert c.lookup(0, [1, 2])[0] == 0  # one token would be reused: under min_tokens


def test_min_tokens():
    c = PrefixCache(max_tokens=100, min_tokens=4)
    c.store(0, [1, 2, 3, 4, 5, 6], kv([1, 2, 3, 4, 5, 6]))
    assert c.lookup(0, [1, 2, 3, 7, 7])[0] == 0
    assert c.lookup(0, [1, 2, 3, 4, 7])[0] == 4
    assert (c.hits, c.reused_tokens) == (1, 4)


def test_lru_eviction_by_total_tokens():
    c = PrefixCache(max_tokens=10, min_tokens=1)
    c.store(0, [1, 1, 1, 1], kv([1] * 4))
    c.store(0, [2, 2, 2, 2], kv([2] * 4))
    assert c.lookup(0, [1, 1, 1, 5])[0] == 3  # touches the first: now the second is the oldest
    c.store(0, [3, 3, 3, 3], kv([3] * 4))  # 12 tokens > 10: the least recently used goes
    assert c.tokens == 8 and len(c) == 2
    assert c.lookup(0, [2, 2, 2, 5])[0] == 0
    assert c.lookup(0, [1, 1, 1, 5])[0] == 3 and c.lookup(0, [3, 3, 3, 5])[0] == 3


def test_over_long_entries_are_not_stored():
    c = PrefixCache(max_tokens=4, min_tokens=1)
    c.store(0, [1, 2, 3], kv([1, 2, 3]))
    c.store(0, [5, 6, 7, 8, 9], kv([5, 6, 7, 8, 9]))
    assert len(c) == 1 and c.tokens == 3
    assert c.lookup(0, [5, 6, 7, 8, 9, 10])[0] == 0 and c.lookup(0, [1, 2, 4])[0] == 2


def test_other_versions_are_never_returned_and_drop_version_frees():
    c = PrefixCache(max_tokens=100, min_tokens=1)
    c.store(0, [1, 2, 3, 4], kv([1, 2, 3, 4]))
    c.store(1, [1, 2, 9, 9], kv([1, 2, 9, 9]))
    n, layers = c.lookup(1, [1, 2, 3, 4, 5])
    assert n == 2 and layers[0][0].flatten().tolist() == [1, 2]
    assert c.lookup(2, [1, 2, 3, 4, 5]) == (0, None)
    c.drop_version(0)
    assert c.versions() == {1} and c.tokens == 4
    assert c.lookup(0, [1, 2, 3, 4, 5]) == (0, None)


def test_same_tokens_replace_and_covered_prefixes_are_not_kept_twice():
    c = PrefixCache(max_tokens=100, min_tokens=1)
    c.store(0, [1, 2, 3], kv([1, 2, 3]))
    c.store(0, [1, 2, 3], kv([7, 7, 7]))  # replaced
    assert c.tokens == 3 and c.lookup(0, [1, 2, 3, 4])[1][0][0].flatten().tolist() == [7, 7, 7]
    c.store(0, [1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))  # the next turn of that chat supersedes it
    assert len(c) == 1 and c.tokens == 5
    c.store(0, [1, 2, 3, 4], kv([1, 2, 3, 4]))  # already covered by the longer entry
    assert len(c) == 1 and c.tokens == 5
    assert c.lookup(0, [1, 2, 3, 4, 5, 6])[0] == 5


# -- the batcher on the tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    cached = TorchEngine(tiny_model_dir, max_batch=4, max_queue=4, prefix_cache_tokens=4096, prefix_cache_min_tokens=8)
    plain = TorchEngine(tiny_model_dir, max_batch=4, max_queue=4, prefix_cache_tokens=0)
    yield cached, plain
    cached.close()
    plain.close()


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, top_logprobs=2)


def assert_same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert close(a.logprobs, b.logprobs, 1e-4)
    assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]


def test_a_hit_prefills_only_the_tail_and_changes_nothing(engines, tiny_model_dir):
    cached, plain = engines
    assert plain.batcher.prefix is None
    prefix = cached.batcher.prefix
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where are the atlases?"}]
    p1 = cached.encode_chat(chat)
    p2 = cached.encode_chat([chat[0], {"role": "user", "content": "Do you sell maps of Mars?"}])
    shared = common_prefix(tuple(p1), p2)
    assert shared > 30  # the system prompt

    g1 = cached.generate(p1, greedy())
    assert prefix.hits == 0 and prefix.tokens == len(p1)  # nothing to reuse yet; p1 is kept
    g2 = cached.generate(p2, greedy())
    assert (prefix.hits, prefix.reused_tokens) == (1, shared)
    assert_same(g1, plain.generate(p1, greedy()))
    assert_same(g2, plain.generate(p2, greedy()))

    # the second turn of the first chat re-sends all of its first turn
    turn2 = chat + [{"role": "assistant", "content": g1.text}, {"role": "user", "content": "And globes?"}]
    p3 = cached.encode_chat(turn2)
    reuse = min(max(common_prefix(tuple(p1), p3), common_prefix(tuple(p2), p3)), len(p3) - 1)
    assert reuse >= len(p1) - 1
    g3 = cached.generate(p3, greedy())
    assert (prefix.hits, prefix.reused_tokens) == (2, shared + reuse)
    assert_same(g3, plain.generate(p3, greedy()))

    # every recorded logprob is the policy's: a fresh full forward pass of prompt + response
    for p, g in ((p1, g1), (p2, g2), (p3, g3)):
        assert close(g.logprobs, logprobs_under(tiny_model_dir, p, g.token_ids), 1e-4)


def test_hits_joining_a_running_batch_match_requests_alone(engines, tiny_model_dir):
    """Seeded sampled requests sharing the system prompt, admitted while others decode: each equals
    the same request on the engine without the cache, and the full forward pass."""
    cached, plain = engines
    prompts = [cached.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in ("Poetry?", "Is the cafe open on Sundays at all?", "Cookbooks")]
    hits = cached.batcher.prefix.hits
    params = [SamplingParams(max_new_tokens=10 + 4 * i, seed=i) for i in range(3)]
    futures = []
    for p, sp in zip(prompts, params):
        futures.append(cached.submit(p, sp))
        time.sleep(0.05)  # later requests join a batch already decoding
    gens = [f.result(timeout=120) for f in futures]
    assert cached.batcher.prefix.hits >= hits + 2  # each after the first reuses at least the system prompt
    for p, sp, g in zip(prompts, params, gens):
        assert_same(g, plain.generate(p, sp))
        assert close(g.logprobs, logprobs_under(tiny_model_dir, p, g.token_ids), 1e-4)


def test_a_reload_never_reuses_the_old_models_kv(tiny_model_dir, perturbed_model_dir):
    """Cold swaps (re-warm off): tests/test_rewarm.py has the warm ones."""
    engine = TorchEngine(tiny_model_dir, max_batch=2, max_queue=2, prefix_cache_min_tokens=8, rewarm_tokens=0)
    try:
        prefix = engine.batcher.prefix
        p = engine.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Atlases?"}])
        engine.generate(p, greedy(4))
        assert prefix.versions() == {0}

        engine.reload(perturbed_model_dir, version=1)
        g = engine.generate(p, greedy(4))
        assert prefix.hits == 0 and prefix.versions() == {1}  # v0's entries are gone, not just skipped
        assert close(g.logprobs, logprobs_under(perturbed_model_dir, p, g.token_ids), 1e-4)
        assert engine.generate(p, greedy(4)).token_ids == g.token_ids and prefix.hits == 1  # v1 reuses its own

        # the same version number with other weights is another model: its KV is not reused either
        engine.reload(tiny_model_dir, version=1)
        g = engine.generate(p, greedy(4))
        assert prefix.hits == 1
        assert close(g.logprobs, logprobs_under(tiny_model_dir, p, g.token_ids), 1e-4)
    finally:
        engine.close()


def test_gateway_exports_prefix_cache_counters(served):
    cfg, _ = served
    before = metrics(cfg)
    for q in ("Which shelf has atlases?", "Which shelf has poetry?"):
        r = httpx.post(f"{cfg.gateway_url}/v1/chat/completions", headers=user(cfg), timeout=120, json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM + " (gateway test)"}, {"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
    after = metrics(cfg)
    assert after["clawflow_prefix_cache_hits_total"] >= before["clawflow_prefix_cache_hits_total"] + 1
    reused = "clawflow_prefix_cache_reused_tokens_total"
    assert after[reused] >= before[reused] + 30  # the system prompt
