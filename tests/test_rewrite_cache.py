"""The cross-run rewrite cache (train/rewrite_cache.py): keyed by the weights and the settings."""

from __future__ import annotations

import os

from clawflow.config import TrainConfig
from clawflow.train.rewrite_cache import RewriteCache, prune


def _weights(d, data=b"w"):
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(data)
    return d


def test_a_reply_comes_back_only_for_the_same_weights_prompts_and_settings(tmp_path):
    model, cfg = _weights(tmp_path / "v1"), TrainConfig(rewrite_samples=4)
    cache = RewriteCache(tmp_path / "cache", model, cfg)
    cache.add_replies([(([1, 2, 3], [1, 3]), [7, 8, 9])])
    again = RewriteCache(tmp_path / "cache", model, cfg)  # another process reads the file
    assert again.reply([1, 2, 3], [1, 3]) == [7, 8, 9]
    assert again.reply([1, 2, 3], [1, 4]) is None  # another plain prompt (best-of-n chooses by it)
    assert RewriteCache(tmp_path / "cache", model, TrainConfig(rewrite_samples=2)).reply([1, 2, 3], [1, 3]) is None
    other = _weights(tmp_path / "v2")
    assert RewriteCache(tmp_path / "cache", other, cfg).reply([1, 2, 3], [1, 3]) is None
    st = (model / "model.safetensors").stat()  # the same directory rewritten: other weights
    _weights(model, b"other")
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert RewriteCache(tmp_path / "cache", model, cfg).reply([1, 2, 3], [1, 3]) is None


def test_preference_reports_and_unreadable_files(tmp_path):
    model, cfg = _weights(tmp_path / "v1"), TrainConfig()
    cache = RewriteCache(tmp_path / "cache", model, cfg)
    key = [["p-1", ["Shorter.", "At most 20 words."]], 4]
    assert cache.preference_report(key) is None
    cache.add_preference_report(key, {"taught": "At most 20 words."})
    assert RewriteCache(tmp_path / "cache", model, cfg).preference_report(key) == {"taught": "At most 20 words."}
    assert RewriteCache(tmp_path / "cache", model, cfg).preference_report([["p-1", ["Shorter."]], 4]) is None
    cache.path.write_text("{not json")  # a torn or foreign file counts as empty, and is replaced on write
    fresh = RewriteCache(tmp_path / "cache", model, cfg)
    assert fresh.preference_report(key) is None
    fresh.add_replies([(([1], [2]), [3])])
    assert RewriteCache(tmp_path / "cache", model, cfg).reply([1], [2]) == [3]
    assert RewriteCache(None, model, cfg).reply([1], [2]) is None  # no cache dir: nothing kept


def test_prune_keeps_the_newest_files(tmp_path):
    cfg = TrainConfig()
    paths = []
    for n in range(6):
        cache = RewriteCache(tmp_path / "cache", _weights(tmp_path / f"v{n}"), cfg)
        cache.add_replies([(([n], [n]), [n])])
        os.utime(cache.path, ns=(10**18 + n * 10**9, 10**18 + n * 10**9))
        paths.append(cache.path)
    assert sorted(prune(tmp_path / "cache", keep=4)) == sorted(paths[:2])
    assert [p.exists() for p in paths] == [False, False, True, True, True, True]
