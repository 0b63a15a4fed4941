"""CPU training precision (`train.autocast`, clawflow/train/precision.py): chosen by a measured
probe and forced either way by config. The training run under bf16 autocast is
tests/test_train.py::test_bf16_autocast_run_takes_the_fp32_steps_within_rounding (it shares that
module's fp32 run)."""

import torch
from transformers import AutoModelForCausalLM

from clawflow.train import precision
from tests.test_train import base  # noqa: F401 - fixture

CPU = torch.device("cpu")


def test_config_forces_either_way_without_probing():
    assert precision.choose("off", None, CPU) == (False, None)  # no model: a probe would fail
    assert precision.choose("bfloat16", None, CPU) == (True, None)
    assert precision.choose("auto", None, torch.device("cuda")) == (False, None)  # GPUs: mixed_precision


def test_probe_times_both_and_leaves_no_gradients(base):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    enabled, speedup = precision.choose("auto", model, CPU)
    assert speedup is not None and speedup > 0 and enabled == (speedup >= precision.MIN_SPEEDUP)
    assert all(p.grad is None for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32  # autocast never converts the weights
