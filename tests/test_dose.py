"""The gate's dose (clawflow/policy/dose.py): interpolation toward the champion, on real tensors and
real adapter files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from clawflow.policy.dose import ADAPTER_FILE, interpolate, write_dosed


def test_interpolate_endpoints_and_middle():
    champ = {"w": torch.tensor([1.0, 2.0]), "lora_A": torch.tensor([3.0])}
    cand = {"w": torch.tensor([3.0, 6.0]), "lora_A": torch.tensor([5.0])}
    assert torch.equal(interpolate(champ, cand, 1.0)["w"], cand["w"])
    assert torch.allclose(interpolate(champ, cand, 0.5)["w"], torch.tensor([2.0, 4.0]))
    assert torch.allclose(interpolate(champ, cand, 0.25)["lora_A"], torch.tensor([3.5]))


def test_no_champion_adapter_scales_the_delta():
    """From the base (no adapter): B starts at zero and A stays, so B·A is scaled by exactly the dose."""
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    cand = {"x.lora_A.weight": a, "x.lora_B.weight": b}
    d = interpolate({}, cand, 0.25)
    assert torch.equal(d["x.lora_A.weight"], a)
    assert torch.allclose(d["x.lora_B.weight"] @ d["x.lora_A.weight"], 0.25 * (b @ a), atol=1e-6)


@pytest.mark.parametrize("dose", [0.0, -0.5, 1.5])
def test_bad_dose_is_refused(dose):
    with pytest.raises(ValueError):
        interpolate({}, {"w": torch.ones(1)}, dose)


def test_write_dosed_adapter_dir(tmp_path):
    cand, champ = tmp_path / "cand", tmp_path / "champ"
    for d, scale in ((cand, 2.0), (champ, 1.0)):
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": 2}))
        save_file({"m.lora_A.weight": torch.full((2, 3), scale), "m.lora_B.weight": torch.full((3, 2), scale)},
                  str(d / ADAPTER_FILE))
    (cand / "tokenizer.json").write_text("{}")
    out = write_dosed(cand, champ, 0.5, tmp_path / "dose-0.5")
    w = load_file(str(out / ADAPTER_FILE))
    assert torch.allclose(w["m.lora_B.weight"], torch.full((3, 2), 1.5))
    assert (out / "tokenizer.json").is_file() and (out / "adapter_config.json").is_file()
    assert torch.allclose(load_file(str(cand / ADAPTER_FILE))["m.lora_B.weight"], torch.full((3, 2), 2.0))  # untouched
    # a checkpoint written at 0.5, rebuilt at 0.75 (bench/pref_ranking.py): what the gate wrote at 0.75
    again = load_file(str(write_dosed(out, champ, 0.75, tmp_path / "again", written_at=0.5) / ADAPTER_FILE))
    assert torch.allclose(again["m.lora_B.weight"], torch.full((3, 2), 1.75))
    with pytest.raises(ValueError, match="doses must be in"):
        write_dosed(out, champ, 0.75, tmp_path / "bad", written_at=0.0)
