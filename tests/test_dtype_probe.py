"""serving.dtype: auto settles on bf16 only where the start-up probe measures it clearly faster;
explicit settings (serving.dtype, or model.dtype) are never second-guessed; a failing probe keeps fp32."""

from __future__ import annotations

import httpx
import pytest

from clawflow.serving import dtype_probe
from clawflow.serving.server import serving_dtype
from conftest import admin


def test_explicit_settings_skip_the_probe(monkeypatch):
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: pytest.fail("probed"))
    assert dtype_probe.choose("float32", 64, 128) == ("float32", None)
    assert dtype_probe.choose("bfloat16", 64, 128) == ("bfloat16", None)


@pytest.mark.parametrize("prefill, decode, pick", [(2.0, 1.3, "bfloat16"), (1.05, 2.0, "float32"),
                                                   (2.0, 0.8, "float32"), (0.45, 0.5, "float32")])
def test_auto_picks_bf16_only_when_clearly_faster(monkeypatch, prefill, decode, pick):
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: {"prefill_speedup": prefill, "decode_speedup": decode})
    assert dtype_probe.choose("auto", 64, 128)[0] == pick


def test_a_failing_probe_keeps_float32(monkeypatch):
    def broken(*a):
        raise RuntimeError("no bf16 kernels")

    monkeypatch.setattr(dtype_probe, "probe", broken)
    assert dtype_probe.choose("auto", 64, 128) == ("float32", None)


def test_the_probe_measures_both_dtypes_quickly():
    import time

    t0 = time.perf_counter()
    found = dtype_probe.probe(64, 256)
    assert set(found) == {"prefill_speedup", "decode_speedup"} and all(v > 0 for v in found.values())
    assert time.perf_counter() - t0 < 10


def test_serving_dtype_from_config(make_config, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: {"prefill_speedup": 3.0, "decode_speedup": 1.5})
    assert serving_dtype(make_config(serving={"dtype": "auto"}), tiny_model_dir) == "bfloat16"
    assert serving_dtype(make_config(serving={"dtype": "float32"}), tiny_model_dir) == "float32"
    explicit = make_config(serving={"dtype": "auto"}, model={"dtype": "float32"})
    assert serving_dtype(explicit, tiny_model_dir) == "float32"  # model.dtype written down: honoured


def test_gateway_reports_its_dtype(served):
    cfg, _ = served
    assert httpx.get(f"{cfg.gateway_url}/admin/policy", headers=admin(cfg)).json()["dtype"] == "float32"
