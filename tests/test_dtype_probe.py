"""serving.dtype: auto settles on bf16-weights only where the start-up probe (the model itself, fp32 and
bf16-weights) measures it clearly faster at prefill and not slower at long-context decode; explicit settings
(serving.dtype, or model.dtype) are never second-guessed; a failing probe keeps fp32."""

from __future__ import annotations

import httpx
import pytest

from clawflow.serving import dtype_probe
from clawflow.serving.server import serving_dtype
from conftest import admin


def test_explicit_settings_skip_the_probe(monkeypatch):
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: pytest.fail("probed"))
    assert dtype_probe.choose("float32", "unused") == ("float32", None)
    assert dtype_probe.choose("bfloat16", "unused") == ("bfloat16", None)
    assert dtype_probe.choose("bf16-weights", "unused") == ("bf16-weights", None)


@pytest.mark.parametrize("prefill, decode, pick", [
    (2.0, 1.1, "bf16-weights"), (1.05, 2.0, "float32"), (0.45, 0.5, "float32"),
    (1.54, 0.48, "float32"),  # full bf16 on an AVX512-BF16 EPYC: faster prefill, 2x slower decode after 4k tokens
    (1.39, 1.29, "bf16-weights"),  # bf16-weights on the same EPYC
])
def test_auto_picks_bf16_only_when_clearly_faster(monkeypatch, prefill, decode, pick):
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: {"prefill_speedup": prefill, "decode_speedup": decode})
    assert dtype_probe.choose("auto", "unused")[0] == pick


def test_a_failing_probe_keeps_float32(monkeypatch, tmp_path):
    assert dtype_probe.choose("auto", str(tmp_path / "no-model")) == ("float32", None)


def test_the_probe_times_the_model_in_both_dtypes(tiny_model_dir, monkeypatch):
    import time

    monkeypatch.setattr(dtype_probe, "CONTEXT", 256)
    t0 = time.perf_counter()
    found = dtype_probe.probe(tiny_model_dir)
    assert set(found) == {"prefill_speedup", "decode_speedup"} and all(v > 0 for v in found.values())
    assert time.perf_counter() - t0 < 30


def test_serving_dtype_from_config(make_config, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: {"prefill_speedup": 3.0, "decode_speedup": 1.2})
    assert serving_dtype(make_config(serving={"dtype": "auto"}), tiny_model_dir) == "bf16-weights"
    assert serving_dtype(make_config(serving={"dtype": "float32"}), tiny_model_dir) == "float32"
    explicit = make_config(serving={"dtype": "auto"}, model={"dtype": "float32"})
    assert serving_dtype(explicit, tiny_model_dir) == "float32"  # model.dtype written down: honoured


def test_default_serves_float32_without_probing(make_config, tiny_model_dir, monkeypatch):
    # the eval gate measures helpfulness in fp32: the default serves what it measured
    monkeypatch.setattr(dtype_probe, "probe", lambda *a: pytest.fail("probed"))
    assert serving_dtype(make_config(), tiny_model_dir) == "float32"


def test_gateway_reports_its_dtype(served):
    cfg, _ = served
    answer = httpx.get(f"{cfg.gateway_url}/admin/policy", headers=admin(cfg)).json()
    assert answer["dtype"] == "float32" and answer["linear_kernel"] in {"onednn", "aten"}  # auto: settled
